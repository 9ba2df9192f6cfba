"""Build logic only: compile ``src/`` with CMake into ``needle/backend_ndarray`` (the C++ CPU
backend), and ``src/trusted_pair.c`` with setuptools into ``needle/memory`` (the CUDA
backend's per-buffer allocate/release pair; plain CPython C API).

Package metadata lives in ``pyproject.toml``. Works for ``pip install -e .``, ``pip install .``
(the module lands inside the built wheel) and ``python setup.py build_ext --inplace``.
Environment: ``NEEDLE_BUILD_JOBS`` (default 2) and ``NEEDLE_CMAKE_ARGS`` (extra -D flags).
"""
from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


class CMakeExtension(Extension):
    """An extension whose sources CMake compiles (setuptools only places the result)."""

    def __init__(self, name: str):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    """Configure and build with CMake, writing the module where setuptools expects it."""

    def build_extension(self, ext: Extension) -> None:
        if not isinstance(ext, CMakeExtension):
            super().build_extension(ext)  # a plain C extension: setuptools compiles it
            return
        import pybind11

        target = Path(self.get_ext_fullpath(ext.name)).resolve()
        build_dir = Path(self.build_temp).resolve() / "cmake"
        build_dir.mkdir(parents=True, exist_ok=True)
        args = [
            f"-DNEEDLE_OUTPUT_DIR={target.parent}",
            f"-DNEEDLE_EXT_SUFFIX={sysconfig.get_config_var('EXT_SUFFIX')}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            f"-DCMAKE_BUILD_TYPE={'Debug' if self.debug else 'Release'}",
        ]
        if shutil.which("ninja") and not (build_dir / "CMakeCache.txt").exists():
            args.append("-GNinja")
        args += shlex.split(os.environ.get("NEEDLE_CMAKE_ARGS", ""))
        jobs = os.environ.get("NEEDLE_BUILD_JOBS", "2")
        subprocess.run(["cmake", "-S", str(ROOT), "-B", str(build_dir), *args], check=True)
        subprocess.run(["cmake", "--build", str(build_dir), "--parallel", jobs], check=True)
        if not target.exists():
            raise RuntimeError(f"CMake did not produce the expected module {target}")


setup(
    ext_modules=[
        CMakeExtension("needle.backend_ndarray.ndarray_backend_cpu"),
        # the CUDA backend's per-buffer allocate/release pair (CPython C API, no CUDA)
        Extension("needle.memory._trusted_pair", sources=["src/trusted_pair.c"],
                  extra_compile_args=["-O2"]),
    ],
    cmdclass={"build_ext": CMakeBuild},
    zip_safe=False,
)
