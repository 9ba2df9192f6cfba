"""CUDA graph replay of a kernel program on ``cuda()``: one launch per step.

A kernel program (:mod:`.program`) already runs the same kernels on the same buffers in
the same order every call. :func:`capture` records that sequence once with CuPy's stream
capture (``runtime.Capture``); every later call copies what changed into the graph's fixed
buffers and launches the graph. A graph keeps every device address it saw, so every buffer
it touches must stay where it was at capture time:

* **intermediates** live where the memory plan put them in one arena the graph holds, the
  others in blocks of the graph's own, reused only by a buffer of the same size made after
  the last kernel that used the previous one;
* **buffers from before the call** (tensor arguments, parameters, optimizer state, a
  gradient that accumulates) get one fixed buffer each; a call copies a buffer in (one
  device-to-device copy) only when it is not that buffer already: a new batch is copied, a
  parameter the graph updated last call is not;
* **state the step replaces** (a new weight, a moment, BatchNorm's running statistics) is
  computed by the graph and copied back, inside the graph, into the fixed buffer it was
  read from; that buffer is what the state then holds, so the next call copies nothing.
  State the step sets without reading it (the gradients after ``reset_grad``) is left in the
  graph's own buffers, which the next call overwrites in place;
* **the step's result** is copied out into new buffers after the launch: a returned loss
  stays valid after later calls;
* **host data**: the random draws of the step (dropout masks) are drawn on the host before
  the launch in the recorded order, from the same ``needle.random`` streams as eagerly, and
  copied into buffers of their own; so are host constants. The deferred label checks of
  ``SoftmaxLoss``/``Embedding`` are queued again for the fixed label buffer on every call.

So the kernels and their inputs are those of the plain kernel replay: the results are
bitwise equal. :func:`capture` returns a string saying why instead where a graph cannot
hold the step: not ``cuda()``, a CuPy without stream capture, Python scalars recomputed per
call (``effects.replayed``: Adam's bias corrections would be frozen), a kernel that checks
device values the step computes, an allocation the recording did not see, or an operation
the capture refused (a host synchronisation).

Example (``cpu()`` has no graphs: the reason comes back):
    >>> import needle as ndl, numpy as np
    >>> from needle.compiler.recorder import record_kernels
    >>> from needle.compiler.program import Before, build_program
    >>> x = ndl.Tensor(np.ones(3), device=ndl.cpu_numpy())
    >>> with record_kernels(ndl.cpu_numpy()) as rec:
    ...     y = x * 2
    >>> capture(build_program(rec, Before({}, [x]), {}, (x,), {}, y))
    'CUDA graphs need a cuda() program, got cpu_numpy()'
"""
from __future__ import annotations

import functools
import gc

import numpy as np

from needle.autograd import Tensor
from needle.autograd.versions import note_replaced
from needle.backend_ndarray.ndarray import _view

from .codegen import generate, random_fill
from .fusion import slots_of
from .program import _rebuild
from .recorder import Alloc, Call, Const, PyCall, RandomFill, Ref

__all__ = ["GraphReplay", "capture"]


class GraphReplay:
    """A captured kernel program: :meth:`run` is one call of the step (see the module
    docstring). ``copies`` counts the device-to-device copies the last call queued before
    its launch."""

    def __init__(self, program, graph, fixed: list, made: tuple, back: dict, fills: list,
                 checks: list, blocks: list, runtime):
        self.program, self.graph, self.fixed, self.made = program, graph, fixed, made
        self.fills, self.checks, self.runtime = fills, checks, runtime
        self._blocks = blocks  # the intermediates' memory: the graph's addresses
        self._nbytes = [max(a.size, 1) * a.itemsize for a in fixed]
        self._results = _result_slots(program.result)
        self._back = back  # made index -> the fixed buffer the graph copies it back into
        self._kept: list = [None] * len(program._installs)  # see _install
        self.copies = 0

    def run(self, handles: list, tensors: list):
        rt, copies = self.runtime, 0
        for fixed, handle, nbytes in zip(self.fixed, handles, self._nbytes, strict=True):
            if handle is not fixed:
                rt.copy_device(fixed.ptr(), handle.ptr(), nbytes)
                copies += 1
        for fill, out in self.fills:  # in the recorded order: the same draws as eagerly
            fill(out)
        for defer, ids, n, k, what in self.checks:
            defer(ids, n, k, what)
        rt.launch_graph(self.graph)
        self.copies = copies
        out = list(self.made)
        for j, fixed in self._back.items():
            out[j] = fixed
        array_type = self.program.device.mod.Array
        for j in self._results:
            src = self.made[j]
            copy = out[j] = array_type(src.size, src.dtype)
            rt.copy_device(copy.ptr(), src.ptr(), max(src.size, 1) * src.itemsize)
        return self._install(out, tensors)

    def _install(self, out: list, tensors: list):
        """What :meth:`KernelProgram.finish` does, with the views and gradient tensors of
        the graph's fixed buffers made once: a location that still holds the one installed
        by the last call is left as it is (its buffer was updated in place)."""
        kept, results = self._kept, self._results
        for i, (container, key, loc, slot, shape, strides, offset, device, as_tensor,
                requires_grad, note) in enumerate(self.program._installs):
            value = None if slot is None else kept[i]
            if value is None and slot is not None:
                value = _view(shape, strides, offset, device, out[slot])
                if as_tensor:
                    value = Tensor.make_const(value, requires_grad=requires_grad)
                if slot not in results:  # a result slot gets a new copy every call
                    kept[i] = value
            if container is None:
                loc.set(value, tensors)
            elif getattr(container, key) is not value:
                setattr(container, key, value)
            if note:  # a parameter's data changed: saved tensors of older graphs see it
                owner = container if container is not None else tensors[loc.arg]
                if isinstance(owner, Tensor):
                    note_replaced(owner)
        return _rebuild(self.program.result, out.__getitem__, self.program.device)


def capture(program, arena: dict | None = None) -> GraphReplay | str:
    """Capture ``program`` (a prepared :class:`~.program.KernelProgram`) as a CUDA graph, or
    say why it cannot be (see the module docstring). ``arena`` (slot -> (offset, bytes)) is
    where the memory plan puts the buffers it holds in its arena."""
    mod = program.device.mod
    if getattr(mod, "__device_name__", None) != "cuda":
        return f"CUDA graphs need a cuda() program, got {program.device.name}()"
    from needle.backend_ndarray._cuda import runtime

    why = runtime.graphs_unsupported()
    if why is not None:
        return why
    ops = getattr(program, "ops_run", None)
    if ops is None or program.native is not None:
        return "the program has no generated Python runner to capture"
    if any(isinstance(op, PyCall) for op in ops):
        return ("the step's replayed() Python (an optimizer's step count) gives kernels new "
                "scalars on every call: a graph would freeze them")
    fills: list = []
    ops = [_host_fill(op, fills, mod) for op in ops]
    host_slots = {op.args[0].slot for op in ops
                  if isinstance(op, Call) and op.name == "graph_host_fill"}
    made_slots = program._made
    order, sizes = _blocks(ops, set(made_slots), host_slots, arena or {})
    fn, _, _ = generate(program._rec, program._external_slots, made_slots, ops, mod)
    fixed = [mod.Array(b.meta[4], b.meta[3]) for b in program.binders]
    back = _copy_back(program, fixed, ops)
    blocks = [runtime.allocate(n) for n in sizes]
    pieces = [_Piece(blocks[block], offset, nbytes) for block, offset, nbytes in order]
    checks: list = []
    try:
        graph, made = _capture(fn, fixed, back, pieces, checks, mod, runtime)
    except _Refused as exc:
        return str(exc)
    except Exception as exc:  # noqa: BLE001 - any failure of the capture means: no graph
        return f"the capture failed ({type(exc).__name__}: {exc})"
    for i, (_, out) in enumerate(fills):
        if out is None:
            return "a host fill of the step was not reached while capturing"
        fills[i] = (fills[i][0], out)
    bound: dict = {}  # one check per label buffer (the loss's backward checks them again)
    for ids, n, k, what in checks:
        owner = next((f for f in fixed if f.ptr() == ids.ptr()), None)
        if owner is None:
            return ("a kernel checks device values the step computes on the host (ids made "
                    "inside the step): a graph would skip the check")
        bound.setdefault((id(owner), n, k), (mod._defer_ids_check, owner, n, k, what))
    return GraphReplay(program, graph, fixed, made, back, fills, list(bound.values()), blocks,
                       runtime)


class _Refused(Exception):
    pass


class _Piece:
    """What a buffer made while capturing holds: its address, and the block around it."""

    __slots__ = ("ptr", "nbytes", "block")

    def __init__(self, block, offset: int, nbytes: int):
        self.ptr, self.nbytes, self.block = int(block.ptr) + offset, nbytes, block


def _capture(fn, fixed, back, pieces, checks, mod, runtime):
    served = [0]

    def allocate(nbytes: int):
        k = served[0]
        if k >= len(pieces) or pieces[k].nbytes < nbytes:
            raise _Refused("a kernel allocates a buffer the recording did not see (a "
                           "workspace made inside a kernel call)")
        served[0] += 1
        return pieces[k]

    def defer(ids, n, k, what):
        checks.append((ids, int(n), int(k), what))

    previous_allocator = mod.get_allocator()
    previous_defer = getattr(mod, "_defer_ids_check", None)
    mod.set_allocator(allocate)
    if previous_defer is not None:
        mod._defer_ids_check = defer
    # a garbage collection while capturing could free device objects (an event, a stream)
    # whose CUDA calls would invalidate the capture
    collecting = gc.isenabled()
    gc.disable()
    try:
        with runtime.Capture() as cap:
            made = fn(list(fixed))
            for j, target in back.items():
                src = made[j]
                runtime.copy_device(target.ptr(), src.ptr(), max(src.size, 1) * src.itemsize)
    finally:
        if collecting:
            gc.enable()
        mod.set_allocator(previous_allocator)
        if previous_defer is not None:
            mod._defer_ids_check = previous_defer
    if served[0] != len(pieces):
        raise _Refused(f"the capture made {served[0]} buffers, the recording {len(pieces)}")
    return cap.graph, made


def _host_fill(op, fills: list, mod):
    """A random draw or a host constant copied to the device becomes a call that notes its
    buffer: the replay fills it on the host side before each launch."""
    if isinstance(op, RandomFill):
        fill, slot = random_fill(op, mod), op.slot
    elif isinstance(op, Call) and op.name == "from_numpy" and isinstance(op.args[0], Const):
        fill, slot = functools.partial(op.fn, op.args[0].array), op.args[1].slot
    else:
        return op
    index = len(fills)
    fills.append((fill, None))

    def note(out):
        fills[index] = (fill, out)

    return Call("graph_host_fill", note, (Ref(slot),))


def _blocks(ops: list, keep: set, host: set, arena: dict) -> tuple[list, list]:
    """``(block, offset, bytes)`` for each allocation in order, and the blocks' sizes. Block 0
    is the plan's arena when ``arena`` places buffers; any other buffer gets a block of its
    size that no live buffer uses (one whose buffer's last op has run). Buffers filled from
    the host before the launch (``host``) have blocks of their own, and those that outlive
    the program (``keep``) are never given up."""
    last: dict[int, int] = {}
    for i, op in enumerate(ops):
        for slot in slots_of(op):
            last[slot] = i
    placed = {slot: where for slot, where in arena.items() if slot not in host}
    sizes: list = [max(off + n for off, n in placed.values())] if placed else []
    free: dict[int, list] = {}
    order: list = []
    block_of: dict[int, int] = {}
    for i, op in enumerate(ops):
        if isinstance(op, Alloc):
            nbytes = max(op.size, 1) * np.dtype(op.dtype).itemsize
            if op.slot in placed:
                order.append((0, placed[op.slot][0], placed[op.slot][1]))
            else:
                spare = free.get(nbytes) if op.slot not in host else None
                block = spare.pop() if spare else len(sizes)
                if block == len(sizes):
                    sizes.append(nbytes)
                order.append((block, 0, nbytes))
                block_of[op.slot] = block
        for slot in set(slots_of(op)):
            if last[slot] == i and slot in block_of and slot not in keep and slot not in host:
                free.setdefault(sizes[block_of[slot]], []).append(block_of[slot])
    return order, sizes


def _copy_back(program, fixed: list, ops: list) -> dict:
    """``{made index: fixed buffer}`` for state the step reads and replaces with a buffer of
    the same size, type and view: the graph copies the new value back where it read it."""
    alloc = {op.slot: (op.size, op.dtype) for op in ops if isinstance(op, Alloc)}
    read = {b.loc.ident: (b, f) for b, f in zip(program.binders, fixed, strict=True)
            if b.loc is not None}
    back = {}
    for s in program.setters:
        found = read.get(s.loc.ident)
        if found is None or s.slot is None or s.slot in back:
            continue
        b, f = found
        size, dtype = alloc.get(program._made[s.slot], (None, None))
        if (size, dtype) == (b.meta[4], b.meta[3]) and tuple(s.view) == b.meta[:3] \
                and s.as_tensor == b.through_tensor:
            back[s.slot] = f
    return back


def _result_slots(spec) -> list:
    if spec[0] == "tensor":
        return [spec[1]]
    if spec[0] in ("tuple", "list"):
        return [slot for s in spec[1] for slot in _result_slots(s)]
    return []
