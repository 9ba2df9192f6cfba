"""bfloat16 without ``ml_dtypes`` imported up front.

``import needle`` does not import ``ml_dtypes`` (its import costs most of a second in every
process of a job); the first bfloat16 a process meets imports it. Each case below runs in a
fresh interpreter that has imported needle's public modules and nothing else, checks that
``ml_dtypes`` is still absent, then meets its first bfloat16 through one entry point (an op, a
file, a message, a kernel argument) and checks the values that come out.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import needle as ndl

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_PRELUDE = """
import sys
import numpy as np
import needle as ndl
import needle.amp, needle.distributed, needle.nn, needle.optim, needle.serialization
assert "ml_dtypes" not in sys.modules, "import needle imported ml_dtypes"
"""
# 1 + 2**-8 + 2**-12 lies above the halfway point between the bfloat16 neighbours 1 and
# 1 + 2**-7: rounded once it is 1.0078125
_ABOVE_HALF = 1 + 2 ** -8 + 2 ** -12

CASES = {
    "tensor_cpu_numpy": """
        t = ndl.Tensor([1.5, %r], device=ndl.cpu_numpy(), dtype="bfloat16")
        assert t.dtype == "bfloat16", t.dtype
        assert t.numpy().astype(np.float64).tolist() == [1.5, 1.0078125], t.numpy()
    """ % _ABOVE_HALF,
    "tensor_cpu": """
        t = ndl.Tensor([1.5, %r], device=ndl.cpu(), dtype="bfloat16")
        assert t.numpy().astype(np.float64).tolist() == [1.5, 1.0078125], t.numpy()
    """ % _ABOVE_HALF,
    "astype": """
        t = ndl.Tensor([%r, 3.0], device=ndl.cpu_numpy()).astype("bfloat16")
        assert str(t.numpy().dtype) == "bfloat16", t.numpy().dtype
        assert (t + t).numpy().astype(np.float64).tolist() == [2.0, 6.0]
    """ % (1 + 2 ** -9),
    "init": """
        t = ndl.init.ones(2, 3, device=ndl.cpu_numpy(), dtype="bfloat16")
        assert t.dtype == "bfloat16" and t.numpy().sum(dtype=np.float32) == 6.0
    """,
    "autocast": """
        a = ndl.Tensor(np.full((2, 2), 1.5, np.float32), device=ndl.cpu_numpy())
        with ndl.amp.autocast(dtype="bfloat16"):
            out = a @ a
        assert out.dtype == "bfloat16", out.dtype
        assert out.numpy().astype(np.float64).tolist() == [[4.5, 4.5], [4.5, 4.5]]
    """,
    "load_needle_file": """
        state = ndl.load(PATH)
        assert str(state["w"].dtype) == "bfloat16", state["w"].dtype
        assert state["w"].astype(np.float64).tolist() == [1.5, 1.0078125]
    """,
    "load_safetensors": """
        t = ndl.load(PATH, device=ndl.cpu_numpy())["w"]
        assert t.dtype == "bfloat16", t.dtype
        assert t.numpy().astype(np.float64).tolist() == [1.5, 1.0078125]
    """,
    "message_header": """
        from needle.distributed import _wire
        header = _wire.unpack_header(np.frombuffer(bytes.fromhex(HEADER), np.uint8), "recv")
        assert header.dtype == "bfloat16" and header.nbytes == 4, header
        payload = np.frombuffer(bytes.fromhex(PAYLOAD), np.uint8).view(header.dtype)
        assert payload.astype(np.float64).tolist() == [1.5, 1.0078125]
    """,
    "cuda_astype_on_the_emulator": """
        import importlib.util
        import needle.backend_ndarray as nd
        from needle.backend_ndarray import ndarray_backend_cuda as backend
        from needle.backend_ndarray._cuda import runtime
        spec = importlib.util.spec_from_file_location("emulator", EMULATOR)
        emulator = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(emulator)
        runtime._cupy, runtime._reason = emulator.FakeCupy(num_sms=2), None
        cuda = nd.BackendDevice("cuda", backend)
        t = ndl.Tensor([1.5, %r], device=cuda).astype("bfloat16")
        assert t.numpy().astype(np.float64).tolist() == [1.5, 1.0078125], t.numpy()
    """ % _ABOVE_HALF,
    "cuda_scalar_argument": """
        from needle.backend_ndarray._cuda.launch import scalar_arg
        bits = scalar_arg(%r, "bfloat16")
        assert bits.dtype == np.uint16 and int(bits) == 0x3F81, hex(int(bits))
    """ % _ABOVE_HALF,
}


def _inputs(case: str, tmp_path) -> dict:
    import ml_dtypes  # the test process itself may use it freely

    pair = np.array([1.5, _ABOVE_HALF]).astype(ml_dtypes.bfloat16)
    if case == "load_needle_file":
        path = str(tmp_path / "state.ndl")
        ndl.save({"w": pair}, path)
        return {"PATH": path}
    if case == "load_safetensors":
        path = str(tmp_path / "w.safetensors")
        ndl.save({"w": pair}, path)
        return {"PATH": path}
    if case == "cuda_astype_on_the_emulator":
        if shutil.which("g++") is None:
            pytest.skip("g++ not found: no CUDA emulator")
        return {"EMULATOR": os.path.join(ROOT, "python_tests", "backend_ndarray",
                                         "_cuda_emulator.py")}
    if case == "message_header":
        from needle.distributed import _wire

        return {"HEADER": _wire.pack_header(pair, "send").tobytes().hex(),
                "PAYLOAD": pair.tobytes().hex()}
    return {}


def _run_fresh(body: str, names: dict, loads_it: bool = True) -> subprocess.CompletedProcess:
    script = _PRELUDE + "".join(f"{k} = {v!r}\n" for k, v in names.items())
    script += textwrap.dedent(body)
    script += f'\nassert ("ml_dtypes" in sys.modules) == {loads_it}\nprint("ok")\n'
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=env, timeout=300)


def test_import_needle_leaves_ml_dtypes_unimported():
    body = """
        x = ndl.Tensor([1.0, 2.0], device=ndl.cpu()) * 2
        y = ndl.Tensor([1.0, 2.0], device=ndl.cpu_numpy(), dtype="float16") + 1
        assert x.numpy().tolist() == [2.0, 4.0] and y.dtype == "float16"
    """
    done = _run_fresh(body, {}, loads_it=False)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_first_bfloat16_of_a_process_works_through(case, tmp_path):
    done = _run_fresh(CASES[case], _inputs(case, tmp_path))
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
