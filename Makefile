PY ?= .venv/bin/python

.PHONY: venv install build test test-fast lint bench clean

venv:
	test -x $(PY) || python3 -m venv .venv

install: venv
	$(PY) -m pip install -e ".[test]"

build:
	$(PY) setup.py build_ext --inplace

test: install
	$(PY) -m pytest python_tests -q

test-fast:
	$(PY) -m pytest python_tests -q -m "not slow and not mpi"

lint:
	$(PY) -m ruff check needle apps bench python_tests

bench:
	$(PY) bench/bench_ndarray.py
	$(PY) bench/bench_autograd.py

clean:
	rm -rf build *.egg-info needle/backend_ndarray/*.so needle/memory/*.so
