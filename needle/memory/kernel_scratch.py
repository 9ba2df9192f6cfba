"""Kernel scratch (the ``workspace`` category) predicted from a kernel call's arguments alone.

A backend's kernels may take memory of their own besides their operands. Which do, and how
much, is a property of the backend's source; this module states it per backend so that a
shape-only trace (:mod:`needle.memory.shape_trace`) can charge the same bytes, at the same
moments, to its simulated allocator:

* ``cpu_numpy``: no kernel allocates through needle's allocator (NumPy's own temporaries live
  outside it: neither measured nor predicted). Workspace is 0.
* ``cpu`` (``src/matmul_impl.h``): the packed matrix multiply (``matmul``,
  ``matmul_strided``) keeps two *thread-local* packing buffers per OpenMP thread, one for
  panels of A and one for panels of B. A call asks each thread of its team for buffers of a
  size fixed by the shapes, the strides, the instruction set's blocking (MR, NR, KC, MC, NC)
  and the thread count; a buffer grows (freed, then allocated at the new size) when a call
  asks for more and is never shrunk or freed while its thread lives. float16 products and
  ``matmul_tiled`` also take one transient buffer (``(m n + n p + m p)`` float32 or elements)
  for the length of the call. The convolutions' scratch (``src/conv_impl.h``) is not
  modelled: a trace that meets one says so (:attr:`CppScratch.unmodelled`).

Thread ``r`` of a team is the OpenMP pool's ``r``-th thread (0: the calling thread), the same
one for every call, as libgomp keeps its pool.

Example (128 x 784 @ 784 x 100 on two threads: B is read in place, each thread packs its 64
rows of A, KC = 192 by 72 rows of float32):

    >>> s = CppScratch("avx512", threads=2, min_flops=2e6)
    >>> s.requests("matmul", "float32", 128, 784, 100, (784, 1), (100, 1))
    [(0, 'a', 55296), (1, 'a', 55296)]
"""
from __future__ import annotations

__all__ = ["GEMM_BLOCKING", "CppScratch", "NoScratch", "scratch_model"]

# isa -> dtype -> (MR, NR, KC, MC, NC, direct A/B reads, A panels read in place at most)
# (src/gemm_micro_impl.h: GemmConfig; MC = 24 MR for float32, 16 MR for float64)
GEMM_BLOCKING = {
    "avx512": {"float32": (12, 32, 192, 288, 3072, True, 8),
               "float64": (12, 16, 256, 192, 2048, True, 8)},
    "avx2": {"float32": (6, 16, 192, 144, 3072, True, 8),
             "float64": (6, 8, 256, 96, 2048, True, 8)},
    "baseline": {"float32": (4, 8, 256, 96, 2048, False, 0),
                 "float64": (4, 8, 256, 96, 2048, False, 0)},
}
_ITEM = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}
_DIRECT_B_BYTES = 256 << 10       # use_direct_b: a B this small is read in place
_DIRECT_B_FEW_ROWS_BYTES, _DIRECT_B_FEW_ROWS = 1 << 20, 256
_PRIVATE_PACK_BYTES, _PACK_ALL_BYTES = 64 << 10, 512 << 10
_UNMODELLED = ("conv2d_forward", "conv2d_forward_bias", "conv2d_weight_grad",
               "conv2d_input_grad")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class NoScratch:
    """A backend whose kernels take no scratch from needle's allocator (``cpu_numpy``)."""

    unmodelled: frozenset = frozenset()

    def call(self, name: str, args, alloc) -> None:
        return None


class CppScratch:
    """The ``cpu`` backend's packing buffers, per (thread, ``"a"``/``"b"``), as the C++
    kernels size them (see the module docstring). ``call`` charges one kernel call to
    ``alloc`` (a :class:`~needle.memory.caching_allocator.CachingAllocator`)."""

    def __init__(self, isa: str, threads: int, min_flops: float):
        if isa not in GEMM_BLOCKING:
            from ._errors import MemoryArgumentError
            raise MemoryArgumentError(f"kernel scratch: unknown instruction set, expected one "
                                      f"of {sorted(GEMM_BLOCKING)}, got {isa!r}")
        self.isa, self.threads, self.min_flops = isa, int(threads), float(min_flops)
        self.held: dict = {}  # (thread, slot) -> the live Block
        self.log: list = []   # (kernel, thread, slot, bytes) of every growth, in order
        self.unmodelled: set = set()
        # test hook: scale one kernel's requests (a planted wrong model must be caught)
        self.scale: dict = {}

    # ---- what a product asks for ----------------------------------------------------------
    def requests(self, name, dtype, m, n, p, a_strides, b_strides) -> list:
        """``[(thread, slot, bytes)]`` the packing buffers a product asks for, in order."""
        if dtype in ("float16", "bfloat16"):  # widened to compact float32 first
            dtype, a_strides, b_strides = "float32", (n, 1), (p, 1)
        mr, nr, kc, mc, nc, direct, max_panels = GEMM_BLOCKING[self.isa][dtype]
        item = _ITEM[dtype]
        (ars, acs), (brs, bcs) = a_strides, b_strides
        if m == 1 and bcs == 1 and n > 0:
            return []  # gemv_rows: B read row by row, nothing packed
        nt = self.threads if 2.0 * m * n * p >= self.min_flops else 1
        if m == 0 or p == 0 or n == 0:
            return []
        nbytes = n * p * item
        spread = (brs * item) % 64 != 0 or (brs * item // 64) % 4 != 0
        direct_b = direct and bcs == 1 and (nbytes <= _DIRECT_B_BYTES or (
            m <= _DIRECT_B_FEW_ROWS and nbytes <= _DIRECT_B_FEW_ROWS_BYTES and spread))
        row = ars * item
        a_spread = row < 4096 - 256 or 256 <= row % 4096 <= 4096 - 256
        direct_a = direct and acs == 1 and (
            (direct_b and p <= 2 * nr) or (_cdiv(p, nr) <= max_panels and a_spread))
        kc_max, k_blocks = min(kc, n), _cdiv(n, kc)
        panels = 8 if mr >= 12 else 4
        out = []
        if not direct_b and m <= mc and p >= 4 * nt * panels * nr:  # gemm_narrow
            for r in range(nt):
                if not direct_a:
                    out.append((r, "a", k_blocks * kc_max * _cdiv(m, mr) * mr * item))
                out.append((r, "b", kc_max * panels * nr * item))
            return out
        ic_blocks = nt * _cdiv(m, nt * mc)
        mc_used = min(mc, _cdiv(m, ic_blocks))
        nc_max = min(nc, _cdiv(p, nr) * nr)
        all_bytes = k_blocks * kc_max * nc_max * item
        private_b = not direct_b and nt > 1 and p <= nc and all_bytes <= _PRIVATE_PACK_BYTES
        pack_all = not direct_b and nt > 1 and p <= nc and (
            private_b or (k_blocks > 1 and all_bytes <= _PACK_ALL_BYTES))
        if not (direct_b or private_b):  # one B buffer, on the calling thread, shared
            out.append((0, "b", (k_blocks if pack_all else 1) * kc_max * nc_max * item))
        for r in range(nt):
            out.append((r, "a", kc_max * _cdiv(mc_used, mr) * mr * item))
            if private_b:
                out.append((r, "b", k_blocks * kc_max * nc_max * item))
        return out

    # ---- charging a call ------------------------------------------------------------------
    def _get(self, name: str, key, nbytes: int, alloc) -> None:
        block = self.held.get(key)
        if block is not None and nbytes <= block.requested:
            return
        if block is not None:
            block.release()  # Scratch::get frees the old buffer before taking the new one
        self.held[key] = alloc.allocate(nbytes, category="workspace")
        self.log.append((name, *key, nbytes))

    def call(self, name: str, args, alloc) -> None:
        """Charge the kernel call ``name(*args)`` (shape-only handles) to ``alloc``."""
        if name in _UNMODELLED:
            self.unmodelled.add(name)
            return
        if name not in ("matmul", "matmul_strided", "matmul_tiled"):
            return
        a, b, out, m, n, p = args[:6]
        dtype = out.dtype
        scale = self.scale.get(name, 1.0)
        if name == "matmul_strided":
            strides = (args[7], args[8]), (args[10], args[11])
        else:
            strides = (n, 1), (p, 1)
        elements = m * n + n * p + m * p
        transients = []  # needle_alloc'd for the length of the call, freed in reverse
        if name == "matmul_tiled":
            if dtype not in ("float16", "bfloat16") and 2.0 * m * n * p < 1e6:
                return  # small tiled products loop over the tiles in place
            transients.append(alloc.allocate(elements * _ITEM[dtype], category="workspace"))
        if dtype in ("float16", "bfloat16"):  # widened to float32, multiplied, rounded back
            transients.append(alloc.allocate(elements * 4, category="workspace"))
        for thread, slot, nbytes in self.requests(name, dtype, m, n, p, *strides):
            self._get(name, (thread, slot), int(nbytes * scale), alloc)
        for block in reversed(transients):
            block.release()


def scratch_model(device):
    """The scratch model of ``device``'s backend: :class:`CppScratch` for ``cpu`` (read from
    the loaded module: instruction set, thread count, parallel threshold), :class:`NoScratch`
    for ``cpu_numpy``, None where needle has none (``cuda``)."""
    name = getattr(device, "name", None)
    if name == "cpu_numpy":
        return NoScratch()
    if name == "cpu":
        mod = device.mod
        return CppScratch(mod._get_isa(), mod.get_num_threads(), mod._parallel_min_flops())
    return None
