"""The CUDA backend's pure-Python parts, on any machine: launcher logic, availability, sources.

No CuPy needed: grids, scalar casts, dtype and size checks, view packing and reduction plans
are checked here; the .cu sources are compiled to PTX with nvcc when it is installed, and every
kernel name the Python side can ask for must be an entry of that PTX.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess

import numpy as np
import pytest

import needle.backend_ndarray as nd
from needle._core.errors import DTypeError, ShapeError
from needle.backend_ndarray import ndarray_backend_cuda as B
from needle.backend_ndarray._cuda import launch as L
from needle.backend_ndarray._cuda import runtime


class FakeBuffer:
    def __init__(self, size, dtype, ptr=0x1000):
        self.size, self.dtype, self._ptr = size, dtype, ptr

    def ptr(self):
        return self._ptr


def test_cuda_device_disabled_without_raising_here():
    dev = nd.cuda()
    assert dev.enabled() in (True, False)
    if not B.available():
        assert not dev.enabled()
        assert B.unavailable_reason()  # says why (no cupy / no device)


def test_disable_switch(monkeypatch):
    monkeypatch.setattr(runtime, "_cupy", None)
    monkeypatch.setattr(runtime, "_reason", None)
    monkeypatch.setenv("NEEDLE_DISABLE_CUDA", "1")
    assert runtime.available() is False
    assert "NEEDLE_DISABLE_CUDA" in runtime.unavailable_reason()


def test_kernel_names_and_scalar_casts():
    assert L.kernel_name("reduce_block_sum", "float64") == "reduce_block_sum_f64"
    assert L.kernel_name("ewise_cast", "float16", "float64") == "ewise_cast_f64_f16"
    with pytest.raises(DTypeError, match="expected one of"):
        L.kernel_name("ewise_add", "int32")
    for dtype in ("float32", "float64", "float16"):
        v = L.scalar_arg(0.1, dtype)
        assert type(v) is np.dtype(dtype).type and v == np.dtype(dtype).type(0.1)
        assert v.nbytes == np.dtype(dtype).itemsize  # a Python float would be 8 bytes


@pytest.mark.parametrize("n,blocks", [(1, 1), (256, 1), (257, 2), (10**8, 390625),
                                      (2**40, 2**31 - 1)])
def test_elementwise_grid(n, blocks):
    assert L.launch_config("elementwise", n) == ((blocks,), (256,))


@pytest.mark.parametrize("n,blocks", [(1, 1), (1024, 1), (1025, 2), (10**8, 97657),
                                      (2**40, 2**30), (2**45, 2**31 - 1)])
def test_packed_grid_has_a_thread_per_four_elements(n, blocks):
    assert L.PACK == 4
    assert L.launch_config("packed", n) == ((blocks,), (256,))


def test_matmul_grid_covers_output():
    for dtype in ("float32", "float64", "float16"):
        bm, bn = L.MATMUL_TILES[dtype]
        (gx, gy), block = L.launch_config("matmul", (1000, 300), dtype)
        assert block == (256,) and gx * bn >= 300 > (gx - 1) * bn and gy * bm >= 1000 > \
            (gy - 1) * bm
    with pytest.raises(ShapeError, match="too many rows"):
        L.launch_config("matmul", (2**40, 4), "float32")


def test_tile_shapes_match_the_kernel_source():
    src = open(os.path.join(runtime.KERNEL_DIR, "matmul.cu"), encoding="utf-8").read()
    for suffix, dtype in (("f32", "float32"), ("f16", "float16"), ("f64", "float64")):
        body = re.search(rf"matmul_{suffix}\(.*?gemm_body<\w+, (\d+), (\d+),", src, re.S)
        assert (int(body.group(1)), int(body.group(2))) == L.MATMUL_TILES[dtype]


def test_prepare_checks_and_casts():
    spec = L.KernelSpec("elementwise.cu", "scalar_mul", ("a", "scalar", "a", "i64"))
    a, out = FakeBuffer(10, "float16", 0x100), FakeBuffer(10, "float16", 0x200)
    name, grid, block, args = L.prepare(spec, "float16", 10, (a, 2.5, out, 10))
    assert name == "scalar_mul_f16" and grid == (1,) and block == (256,)
    assert [type(x) for x in args] == [np.uint64, np.float16, np.uint64, np.int64]
    assert int(args[0]) == 0x100 and int(args[2]) == 0x200
    with pytest.raises(DTypeError, match="expected float16, got float32"):
        L.prepare(spec, "float16", 10, (FakeBuffer(10, "float32"), 2.5, out, 10))
    with pytest.raises(ShapeError, match="at least 10 elements, got 9"):
        L.prepare(spec, "float16", 10, (FakeBuffer(9, "float16"), 2.5, out, 10))
    with pytest.raises(DTypeError, match="contiguous CUDA buffer"):
        L.prepare(spec, "float16", 10, (np.zeros(10, np.float16), 2.5, out, 10))


@pytest.mark.parametrize("path", ["fast", "checked"])
def test_kernel_argument_scalars_are_kept_by_value_and_exact(path, monkeypatch):
    """Addresses and sizes become NumPy scalars once per value (building one costs ~2,000
    instructions), on the fast converter and on the checked path alike: the right type and
    value every time, a new address or size its own scalar, the store bounded."""
    monkeypatch.setattr(L, "_U64", {})  # the generated converters read the dicts they got
    monkeypatch.setattr(L, "_I64", {})
    spec = L.KernelSpec("elementwise.cu", "scalar_mul", ("a", "scalar", "a", "i64"))
    if path == "checked":
        spec._plans.clear()
        L._launch_plan(spec, "float32", None)
        name, params, scalar_type, per_block, _ = spec._plans[("float32", None)]
        spec._plans[("float32", None)] = (name, params, scalar_type, per_block, None)
    seen = {}
    for ptr, n in ((0x100, 10), (0x300, 12), (0x100, 10), (0x200, 10), (2**63 + 0x100, 7)):
        a, out = FakeBuffer(n, "float32", ptr), FakeBuffer(n, "float32", ptr + 0x40)
        _, _, _, args = L.prepare(spec, "float32", n, (a, 2.5, out, n))
        assert [type(x) for x in args] == [np.uint64, np.float32, np.uint64, np.int64]
        assert (int(args[0]), int(args[2]), int(args[3])) == (ptr, ptr + 0x40, n)
        first = seen.setdefault((ptr, n), args)
        assert args[0] is first[0] and args[3] is first[3]  # kept, not made again
    # a float or a bool size gives its np.int64 without standing in for an int later
    assert type(L.kernel_i64(3.0)) is np.int64 and int(L.kernel_i64(3.0)) == 3
    assert int(L.kernel_i64(True)) == 1 and 3.0 not in L._I64 and True not in L._I64
    monkeypatch.setattr(L, "MAX_KEPT_SCALARS", 4)
    values = [int(L.kernel_u64(0x1000 + i)) for i in range(10)]
    assert values == [0x1000 + i for i in range(10)] and len(L._U64) <= 4
    assert [int(L.kernel_i64(i)) for i in range(10)] == list(range(10)) and len(L._I64) <= 4


def test_a_buffer_with_only_ptr_takes_the_checked_path_with_the_same_arguments():
    """The fast converter reads the address from the Array's ``_ptr`` field; a buffer that
    only has ``ptr()`` is converted by the checked path, to the same arguments."""

    class PtrOnly:
        def __init__(self, size, dtype, ptr):
            self.size, self.dtype, self._address = size, dtype, ptr

        def ptr(self):
            return self._address

    spec = L.KernelSpec("elementwise.cu", "scalar_mul", ("a", "scalar", "a", "i64"))
    for a, out in ((FakeBuffer(10, "float32", 0x500), FakeBuffer(10, "float32", 0x600)),
                   (PtrOnly(10, "float32", 0x500), PtrOnly(10, "float32", 0x600))):
        _, _, _, args = L.prepare(spec, "float32", 10, (a, 2.0, out, 10))
        assert [int(x) for x in args] == [0x500, 2, 0x600, 10]


def test_a_kernel_instantiated_for_some_dtypes_refuses_the_others():
    spec = L.KernelSpec("fused.cu", "embedding_forward", ("a", "a", "a", "i64", "i64", "i64"),
                        "indexed", dtypes=("float32", "float64"))
    bufs = [FakeBuffer(8, "float64") for _ in range(3)]
    assert L.prepare(spec, "float64", 8, (*bufs, 4, 2, 4))[0] == "embedding_forward_f64"
    half = [FakeBuffer(8, "float16") for _ in range(3)]
    with pytest.raises(DTypeError, match="embedding_forward: unsupported dtype.*float16"):
        L.prepare(spec, "float16", 8, (*half, 4, 2, 4))


def test_reduce_workspace_has_the_compute_dtype():
    spec = L.KernelSpec("reduce.cu", "reduce_partial_sum", ("a", "acc", "i64", "i64", "i64"),
                        "rows")
    a, work = FakeBuffer(100, "float16"), FakeBuffer(8, "float32")
    name, grid, _, _ = L.prepare(spec, "float16", 8, (a, work, 2, 50, 4))
    assert name == "reduce_partial_sum_f16" and grid == (8,)
    with pytest.raises(DTypeError, match="expected float32"):
        L.prepare(spec, "float16", 8, (a, FakeBuffer(8, "float16"), 2, 50, 4))


def _element_offsets(shape, strides, offset):
    idx = np.indices(shape).reshape(len(shape), -1)
    return offset + (np.asarray(strides)[:, None] * idx).sum(axis=0)


@pytest.mark.parametrize("shape,strides", [
    ((2, 3, 4), (12, 4, 1)), ((4, 3, 2), (1, 4, 12)), ((3, 1, 4), (-8, 99, -1)),
    ((3, 4, 5), (0, 1, 0)), ((2,) * 9, tuple(2**k for k in range(8, -1, -1))),
    ((5, 2, 3), (6, 3, 1)), ((1, 1), (1, 1))])
def test_merge_dims_keeps_element_order(shape, strides):
    mshape, mstrides = L.merge_dims(shape, strides)
    assert len(mshape) <= len(shape) and 1 not in mshape
    want = _element_offsets(shape, strides, 7)
    got = _element_offsets(mshape, mstrides, 7) if mshape else np.array([7])
    np.testing.assert_array_equal(got, want)


def test_pack_view_layout_and_limit():
    v = L.pack_view((3, 4, 5), (40, -10, 2), 11)
    assert v.shape == (1,) and v.nbytes == 152
    assert (v["size"][0], v["offset"][0], v["ndim"][0]) == (60, 11, 3)
    assert list(v["shape"][0]) == [3, 4, 5, 0, 0, 0, 0, 0]
    assert list(v["strides"][0]) == [40, -10, 2, 0, 0, 0, 0, 0]
    with pytest.raises(ShapeError, match="at most 8"):
        L.pack_view((2,) * 9, (3**k for k in range(9)), 0)


@pytest.mark.parametrize("rows,size,sms,kind", [
    (1000, 32, 132, "small"), (1000, 33, 132, "warp"), (1000, 1025, 132, "block"),
    (528, 10**6, 132, "block"),
    (1, 10**8, 132, "split"), (4, 5000, 132, "split"), (1, 4000, 132, "block")])
def test_reduce_plan(rows, size, sms, kind):
    plan = L.plan_reduce(rows, size, sms)
    assert plan.kind == kind
    if kind == "split":
        assert 1 < plan.chunks and rows * plan.chunks <= 4 * sms + rows
        assert -(-size // plan.chunks) >= L.MIN_CHUNK // 2


def test_kernel_source_inlines_the_header():
    text = runtime.kernel_source("elementwise.cu")
    assert '#include "common.cuh"' not in text and "struct StridedView" in text


# ---- nvcc: every source compiles, every requested kernel exists ---------------------------------
def _requested_kernels():
    """(source, name) of every kernel the backend module can launch, every dtype."""
    dtypes = tuple(L.SUFFIX)
    out = set()
    for value in list(vars(B).values()) + [c.cell_contents for f in vars(B).values()
                                           if callable(f) and getattr(f, "__closure__", None)
                                           for c in f.__closure__]:
        if isinstance(value, L.KernelSpec):
            for dtype in (d for d in dtypes if d in value.dtypes):
                if "src" in value.params:
                    out |= {(value.source, L.kernel_name(value.base, dtype, s)) for s in dtypes}
                else:
                    out.add((value.source, L.kernel_name(value.base, dtype)))
    return out


def test_every_protocol_entry_point_exists():
    names = ["Array", "to_numpy", "from_numpy", "fill", "compact", "ewise_setitem",
             "scalar_setitem", "ewise_cast", "matmul", "matmul_tiled", "reduce_sum",
             "reduce_max", "reduce_min", "set_num_threads", "get_num_threads"]
    names += [f"ewise_{n}" for n in ("add", "sub", "mul", "div", "maximum", "minimum", "power",
                                     "eq", "ge", "neg", "log", "exp", "tanh", "sqrt", "abs",
                                     "sign", "sigmoid")]
    names += [f"scalar_{n}" for n in ("add", "sub", "rsub", "mul", "div", "rdiv", "power",
                                      "rpower", "maximum", "minimum", "eq", "ge", "le")]
    assert [n for n in names if not callable(getattr(B, n, None))] == []
    assert B.__device_name__ == "cuda" and B.__tile_size__ > 1


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
@pytest.mark.parametrize("own_half", [False, True], ids=["cuda_fp16", "own_half"])
def test_sources_compile_and_define_every_kernel(tmp_path, own_half):
    requested = _requested_kernels()
    assert len(requested) > 150
    for source in sorted({s for s, _ in requested}):
        ptx = tmp_path / (source + ".ptx")
        cmd = ["nvcc", "--ptx", "-arch=sm_90", "-std=c++17", "-o", str(ptx),
               os.path.join(runtime.KERNEL_DIR, source)]
        subprocess.run(cmd + (["-DNEEDLE_OWN_HALF"] if own_half else []), check=True,
                       capture_output=True, timeout=240)
        entries = set(re.findall(r"\.entry\s+(\w+)", ptx.read_text()))
        missing = sorted(n for s, n in requested if s == source and n not in entries)
        assert missing == [], f"{source}: kernels missing from the PTX: {missing}"
