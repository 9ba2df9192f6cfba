"""``CompiledStep``: a step function captured once per signature and replayed in one arena.

Per call signature (:func:`~needle.compiler.signature.signature`) a cache entry goes through:

1. *warm-up* (``warmup`` calls, default 1): eager. Optimisers create their state and a
   step's first-call-only allocations happen here, not in the trace.
2. *trace*: the call runs eagerly under :func:`needle.memory.trace`, which records every
   buffer of the forward, the backward and the optimiser update with its lifetime;
   :func:`~needle.compiler.arena.plan_arena` then chooses the intermediates one arena holds
   and their offsets (the others come from the pools when the step asks, as eagerly).
3. *recorded replays* (two calls): the step's Python runs with the device's allocator serving
   the k-th request at its planned arena offset (``cpu()``: the C++ allocator itself;
   ``cpu_numpy()``/``cuda()``: an arena swapped into the backend module) while its kernel
   calls are recorded (:mod:`needle.compiler.recorder`); two equal recordings make the
   signature's kernel program (:mod:`needle.compiler.program`).
4. *kernel replays*: the program runs the recorded kernels in the same arena, without the
   step's Python, after a guard found the step's state as the program left it
   (:mod:`needle.compiler.state`). A step whose Python does more than the kernels show (a
   host read, hooks, a checkpoint region's RNG replay, a Python counter such as Adam's)
   stays on plan-following Python replays; :meth:`CompiledStep.replay_mode` says why.

The same kernels run in the same order on the same inputs, so the results are bitwise the
eager ones; random ops draw from the ``needle.random`` streams as eagerly (fresh masks every
step), checkpoint regions recompute, hooks (DDP's included) fire.

A replay that leaves the traced program (another allocation size or count, or a buffer that
lives longer than traced) is served from the pools from that request on, so it still computes
the right values; the entry is then traced again on its next call, and after
``max_retraces`` such divergences it stays eager (``stats()["eager_signatures"]``).

Memory: a Python replay's peak of requested bytes above those live before it is exactly
``memory()["planned_peak_bytes"]`` (the arena, held for the whole call, plus the pools'
buffers as traced), a kernel replay's at most that (a program frees a pool buffer right
after its last kernel). With the default ``arena="bounded"`` the planned peak is at most the
traced eager call's (:mod:`needle.compiler.arena` says why holding every intermediate in the
arena can need more); ``arena="all"`` holds them all.

While a compiled step runs, reading tensor values on the host (``loss.numpy()``) raises
:class:`~needle.CompileError` naming the line (:mod:`needle.compiler.guard`).
"""
from __future__ import annotations

import warnings
from collections import OrderedDict

from needle._core.errors import CompileError
from needle.memory import trace
from needle.memory.replay import run_plan

from . import effects as _effects
from .arena import POLICIES, plan_arena
from .guard import refuse_host_reads
from .program import Before, NotReplayable, build_program, flat_arguments
from .recorder import Alloc, record_kernels
from .signature import signature
from .state import WalkTooLarge, discover, snapshot

__all__ = ["CompiledStep", "compile"]

# Programs dropped because a step's state changed between calls (a learning rate, eval()):
# past this many, the signature keeps its Python replays (re-recording costs two calls).
MAX_RERECORDS = 8



class _Entry:
    __slots__ = ("calls", "graph", "plan", "divergences", "eager", "last_divergence",
                 "eager_peak_bytes", "program", "candidate", "python_reason", "rerecords",
                 "arena", "cuda_graph", "graph_reason")

    def __init__(self):
        self.calls = 0
        self.graph = None
        self.plan = None
        self.divergences = 0
        self.eager = False
        self.last_divergence = None
        self.eager_peak_bytes = None
        self.program = None  # the verified kernel program: replays run it
        self.candidate = None  # a recorded program waiting for a second, equal recording
        self.python_reason = None  # why replays run the step's Python, or None
        self.rerecords = 0  # programs dropped because the step's state changed between calls
        self.arena = None  # the ArenaChoice of the plan (needle.compiler.arena)
        self.cuda_graph = None  # the program captured as a CUDA graph (.graph), if it is
        self.graph_reason = None  # why the program replays without one

    def forget_plan(self) -> None:
        self.plan = self.graph = self.program = self.candidate = None
        self.python_reason = None  # the next trace records and decides afresh
        self.forget_program()

    def forget_program(self) -> None:
        self.cuda_graph = self.graph_reason = None


class CompiledStep:
    """The callable :func:`compile` returns (see the module docstring)."""

    _needle_opaque_state = True  # not part of any step's state (needle.compiler.state)

    def __init__(self, fn, *, max_cache: int = 8, warmup: int = 1, max_retraces: int = 2,
                 device=None, kernels: bool = True, fusion: bool = True, native: bool = True,
                 arena: str = "bounded", graphs: bool | None = None):
        if not callable(fn):
            raise CompileError(f"compile: expected a callable step, got {fn!r}")
        if arena not in POLICIES:
            raise CompileError(f"compile: bad arena, expected one of {POLICIES}, got "
                               f"{arena!r}")
        for name, value, low in (("max_cache", max_cache, 1), ("warmup", warmup, 0),
                                 ("max_retraces", max_retraces, 0)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise CompileError(
                    f"compile: bad {name}, expected an int >= {low}, got {value!r}")
        self.fn = fn
        self.max_cache = max_cache
        self.warmup = warmup
        self.max_retraces = max_retraces
        self.device = device
        self.kernels = kernels
        self.fusion = fusion
        self.native = native
        self.arena = arena
        if graphs is not None and not isinstance(graphs, bool):
            raise CompileError(f"compile: bad graphs, expected None, True or False, got "
                               f"{graphs!r}")
        self.graphs = graphs
        self._cache: OrderedDict[tuple, _Entry] = OrderedDict()
        self._counts = {"calls": 0, "traces": 0, "replays": 0, "kernel_replays": 0,
                        "graph_replays": 0, "captures": 0, "divergences": 0, "evictions": 0,
                        "eager_calls": 0}
        self._last = None
        self.__wrapped__ = fn
        self.__doc__ = getattr(fn, "__doc__", None)

    @property
    def _name(self) -> str:
        return f"compiled step {getattr(self.fn, '__qualname__', repr(self.fn))}"

    def _entry(self, key) -> _Entry:
        entry = self._cache.get(key)
        if entry is not None:
            self._cache.move_to_end(key)
            return entry
        entry = self._cache[key] = _Entry()
        while len(self._cache) > self.max_cache:
            self._cache.popitem(last=False)
            self._counts["evictions"] += 1
        return entry

    def __call__(self, *args, **kwargs):
        # A compiled step called inside another one runs eagerly (inside the outer one's trace
        # or plan): one allocator plan at a time per device, and the outer plan covers the
        # inner calls. effects.compiling() is the per-thread flag.
        if _effects.compiling():
            self._counts["calls"] += 1
            self._counts["eager_calls"] += 1
            return self.fn(*args, **kwargs)
        _effects.set_compiling(True)
        try:
            return self._call(args, kwargs)
        finally:
            _effects.set_compiling(False)

    def _call(self, args, kwargs):
        key = signature(args, kwargs)
        entry = self._entry(key)
        self._last = entry
        self._counts["calls"] += 1
        if entry.program is not None:  # (a program implies a plan, past warm-up, not eager)
            # the hot path: a kernel program runs none of the step's Python, so it needs no
            # host-read guard; a refused binding records anew below, in this same call
            bound = entry.program.bind(args, kwargs)
            if not isinstance(bound, str):
                entry.calls += 1
                return self._run_program(entry, *bound, args)
            self._state_changed(entry, bound)
        call = self.fn if not kwargs else (lambda *a: self.fn(*a, **kwargs))
        with refuse_host_reads(self._name):
            if entry.eager or entry.calls < self.warmup:
                entry.calls += 1
                self._counts["eager_calls"] += 1
                return call(*args)
            entry.calls += 1
            if entry.plan is None:
                return self._trace(entry, call, args, kwargs)
            if self.kernels and entry.python_reason is None:
                result, divergence = self._record(entry, call, args, kwargs)
            else:
                result, divergence = run_plan(entry.plan, *args, strict=False, fn=call)
        return self._count(entry, result, divergence)

    def _count(self, entry: _Entry, result, divergence):
        if divergence is None:
            self._counts["replays"] += 1
        else:
            self._counts["divergences"] += 1
            entry.divergences += 1
            entry.last_divergence = divergence
            entry.forget_plan()
            entry.eager = entry.divergences > self.max_retraces
        return result

    # ---- kernel programs ----------------------------------------------------------------
    def _record(self, entry: _Entry, call, args, kwargs):
        """A replay that runs the step's Python while recording its kernels; two equal
        recordings in a row make the kernel program that later replays run."""
        if entry.candidate is not None and entry.candidate.guard is not None:
            changed = entry.candidate.guard.failure()
            if changed is not None:  # the state moved between the two: record afresh
                self._state_changed(entry, changed)
                if entry.python_reason is not None:
                    return run_plan(entry.plan, *args, strict=False, fn=call)
        try:
            roots = discover(self.fn)
            tensors = flat_arguments(args, kwargs)
            before = Before(snapshot(roots, tensors), tensors)
        except (NotReplayable, WalkTooLarge) as exc:
            entry.python_reason = str(exc)
            return run_plan(entry.plan, *args, strict=False, fn=call)
        recordings = []

        def recorded(*a):
            with record_kernels(entry.graph.device) as rec:
                recordings.append(rec)
                return call(*a)

        result, divergence = run_plan(entry.plan, *args, strict=False, fn=recorded)
        rec = recordings[0]
        if divergence is not None:
            return result, divergence
        try:
            program = build_program(rec, before, snapshot(roots, tensors), args, kwargs,
                                    result, device=entry.graph.device)
        except (NotReplayable, WalkTooLarge) as exc:
            entry.python_reason = str(exc)
            entry.candidate = None
            return result, None
        previous, entry.candidate = entry.candidate, program
        if previous is not None:
            if previous.shape() == program.shape():
                entry.program, entry.candidate = program, None
                kernel, arena = _fusion(program, entry.plan) if self.fusion else (None, None)
                program.prepare(kernel, arena, native=self.native)
            else:
                entry.python_reason = ("two calls of the step ran different kernels or "
                                       "arguments (its Python depends on more than the "
                                       "signature and the state the compiler guards)")
                entry.candidate = None
        return result, None

    def _state_changed(self, entry: _Entry, reason: str) -> None:
        """The guard or a binding refused the program (a learning rate set, ``eval()``, an
        argument of another layout): this call and the next record anew, under the same
        plan; a step whose state keeps changing gives up on programs after
        ``MAX_RERECORDS`` such changes and keeps its Python replays."""
        entry.program = entry.candidate = None
        entry.forget_program()
        entry.rerecords += 1
        entry.last_divergence = reason
        if entry.rerecords > MAX_RERECORDS:
            entry.python_reason = (f"the step's state changed between calls {entry.rerecords} "
                                   f"times (last: {reason})")

    def _run_program(self, entry: _Entry, handles: list, tensors: list, args):
        program = entry.program
        replay = entry.cuda_graph
        if replay is None and entry.graph_reason is None and self.graphs is not False:
            replay = self._capture(entry)
        if replay is not None:
            result = replay.run(handles, tensors)
            self._counts["kernel_replays"] += 1
            self._counts["graph_replays"] += 1
            self._counts["replays"] += 1
            return result
        made, divergence = run_plan(entry.plan, *args, strict=False,
                                    fn=lambda *a: program.execute(handles, tensors))
        result = program.finish(made, tensors)
        self._counts["kernel_replays"] += 1
        return self._count(entry, result, divergence)

    def _capture(self, entry: _Entry):
        """Capture the entry's program as a CUDA graph once (:mod:`.graph`); None, with
        ``entry.graph_reason`` set, where it cannot be (warned once when ``graphs=True``
        asked for one)."""
        from .graph import capture

        captured = capture(entry.program, _arena_slots(entry.program, entry.plan))
        if isinstance(captured, str):
            entry.graph_reason = captured
            if self.graphs:
                warnings.warn(f"{self._name}: replays without a CUDA graph: {captured}",
                              RuntimeWarning, stacklevel=4)
            return None
        entry.cuda_graph = captured
        self._counts["captures"] += 1
        return captured

    def _trace(self, entry: _Entry, call, args, kwargs):
        box = []

        def keep(*a):
            box.append(call(*a))  # the result outlives the call: its buffers are outputs

        # the trace's own event count gives the eager peak: no reset of the user's peaks
        graph = trace(keep, *args, device=self.device or _device_of(args, kwargs))
        entry.eager_peak_bytes = graph.eager_peak_bytes
        entry.arena = plan_arena(graph, self.arena)
        entry.graph, entry.plan = graph, entry.arena.plan
        self._counts["traces"] += 1
        return box[0]

    # ---- introspection ------------------------------------------------------------------
    def stats(self) -> dict:
        """Counts: calls, traces, replays (kernel_replays among them, graph_replays among
        those), captures (of CUDA graphs), divergences, evictions, eager_calls; cache_size and
        eager_signatures (entries that gave up planning)."""
        out = dict(self._counts)
        out["cache_size"] = len(self._cache)
        out["eager_signatures"] = sum(e.eager for e in self._cache.values())
        return out

    def memory(self) -> dict:
        """The plan of the signature called last: ``arena_bytes``, ``planned_peak_bytes``
        (requested bytes above those live before a replay: the arena, held for the whole
        call, plus what the pools hold as traced), ``eager_peak_bytes`` (the same measure of
        the traced eager call; the planned peak stays within it unless ``arena="all"``),
        ``naive_bytes`` and ``lower_bound_bytes`` of the arena, ``arena_buffers`` of
        ``intermediates`` and their ``arena_share`` of bytes (:mod:`.arena`); empty before a
        trace."""
        entry = self._last
        if entry is None or entry.plan is None:
            return {}
        p, g, a = entry.plan, entry.graph, entry.arena
        return {"arena_bytes": p.peak_bytes, "planned_peak_bytes": a.planned_peak_bytes,
                "eager_peak_bytes": entry.eager_peak_bytes, "naive_bytes": p.naive_bytes,
                "lower_bound_bytes": p.lower_bound_bytes, "strategy": p.strategy,
                "arena_buffers": a.arena_buffers, "intermediates": a.intermediates,
                "arena_share": a.arena_share, "arena_policy": a.policy, "ops": len(g.ops)}

    def replay_mode(self) -> dict:
        """How the signature called last replays: ``mode`` is ``"kernels"`` (the recorded
        kernel program, no Python: with ``kernels`` calls, ``fused_runs`` of them fused, and
        its ``runner``), ``"recording"`` (its Python runs while the kernels are recorded,
        before a program is trusted), ``"python"`` (the step's Python under the plan;
        ``reason`` says why), or ``"eager"``/``"warm-up"``."""
        return _mode(self._last, self.kernels) if self._last is not None else {"mode": "none"}

    def replay_modes(self) -> list[dict]:
        """:meth:`replay_mode` of every cached signature, most called first, each with its
        ``calls``."""
        entries = sorted(self._cache.values(), key=lambda e: -e.calls)
        return [{**_mode(e, self.kernels), "calls": e.calls} for e in entries]

    def reset(self) -> None:
        """Forget every trace (the next call of each signature warms up again)."""
        self._cache.clear()


def _mode(entry: _Entry, kernels: bool) -> dict:
    if entry.eager:
        return {"mode": "eager", "reason": entry.last_divergence}
    if entry.program is not None:
        return {"mode": "kernels", "kernels": entry.program.n_kernels,
                "fused_runs": entry.program.fused_runs,
                "runner": "C++" if entry.program.native is not None else "Python",
                "graph": entry.cuda_graph is not None, "graph_reason": entry.graph_reason}
    if entry.plan is None:
        return {"mode": "warm-up"}
    if not kernels or entry.python_reason is not None:
        return {"mode": "python", "reason": entry.python_reason or "compiled with kernels=False"}
    return {"mode": "recording"}


def _fusion(program, plan) -> tuple:
    """``(ewise_program, arena)`` for :meth:`KernelProgram.prepare`: the backend's fused
    kernel and where the plan puts each recorded buffer (buffers sharing arena bytes must not
    meet in one fused run); ``(None, None)`` where fusion does not apply."""
    kernel = getattr(program.device.mod, "ewise_program", None)
    arena = _arena_slots(program, plan)
    if kernel is None or arena is None:
        return None, None  # no fused kernel, or a recording that does not line up
    return kernel, arena


def _arena_slots(program, plan) -> dict | None:
    """slot -> (offset, bytes) of each recorded buffer the plan holds in its arena; None
    where the recording does not line up with the plan's allocations."""
    allocs = [op for op in program.ops if isinstance(op, Alloc)]
    sequence = plan.graph.allocations
    if len(allocs) != len(sequence):
        return None
    arena = {}
    for op, (tensor_id, _) in zip(allocs, sequence, strict=True):
        offset = plan.assignments.get(tensor_id)
        if offset is not None:
            arena[op.slot] = (offset, plan.sizes[tensor_id])
    return arena


def _device_of(args, kwargs):
    """The device of the first tensor argument, looking inside lists, tuples and dicts (a
    step taking a list of batches runs on their device, not on the default one)."""
    from needle.memory.trace import _device_of as first_device

    try:
        tensors = flat_arguments(args, kwargs)
    except NotReplayable:  # a NumPy argument: the first tensor at the top level decides
        tensors = []
    from needle.backend_ndarray import NDArray

    for t in tensors:
        if isinstance(t.cached_data, NDArray):
            return t.cached_data.device
    return first_device(args, None)


def compile(fn=None, *, max_cache: int = 8, warmup: int = 1, max_retraces: int = 2,
            device=None, kernels: bool = True, fusion: bool = True, native: bool = True,
            arena: str = "bounded", graphs: bool | None = None):
    """Capture ``fn`` (a training or inference step) once per call signature and replay it
    with its intermediate buffers in one planned arena (those that keep a replay within the
    eager call's peak memory).

    ``fn(*args)`` may run the forward, ``loss.backward()`` and ``optimizer.step()``; it must
    not read tensor values on the host (refused with :class:`~needle.CompileError`). A new
    shape, dtype or device of a tensor argument traces again; at most ``max_cache``
    signatures are kept (least recently used evicted). Usable as ``@compile`` or
    ``compile(fn, ...)``.

    After two recorded replays a step whose Python only drives kernels replays as a kernel
    program (``kernels=False``: never); its elementwise runs are fused (``fusion``) and on
    ``cpu()`` it runs from C++ (``native``; False keeps the generated Python function).
    ``arena="bounded"`` keeps a replay's peak memory within the eager call's; ``"all"`` puts
    every intermediate in the arena (:mod:`needle.compiler.arena`).
    On ``cuda()`` a kernel program is captured once as a CUDA graph and each call launches
    it (``graphs=None``, the default, or True; False: never): inputs are copied into the
    graph's fixed buffers, parameters and optimizer state updated in place, the result
    copied out; gradients stay in the graph's buffers, overwritten by the next call
    (:mod:`needle.compiler.graph`). Where a graph cannot hold the step the program replays
    without one and ``replay_mode()["graph_reason"]`` says why (a warning too with
    ``graphs=True``).
    ``replay_mode()`` says which, or why a step keeps running its Python.

    Example:
        >>> import numpy as np, needle as ndl
        >>> w = ndl.Tensor(np.ones((4, 4)), device=ndl.cpu_numpy())
        >>> @ndl.compile
        ... def step(x):
        ...     return ndl.ops.relu(x @ w) * 2
        >>> x = ndl.Tensor(np.ones((2, 4)), device=ndl.cpu_numpy())
        >>> outs = [step(x).numpy() for _ in range(3)]  # warm-up, trace, replay
        >>> step.stats()["traces"], step.stats()["replays"], outs[2].tolist()[0]
        (1, 1, [8.0, 8.0, 8.0, 8.0])
    """
    if fn is None:
        return lambda f: CompiledStep(f, max_cache=max_cache, warmup=warmup,
                                      max_retraces=max_retraces, device=device,
                                      kernels=kernels, fusion=fusion, native=native,
                                      arena=arena, graphs=graphs)
    return CompiledStep(fn, max_cache=max_cache, warmup=warmup, max_retraces=max_retraces,
                        device=device, kernels=kernels, fusion=fusion, native=native,
                        arena=arena, graphs=graphs)
