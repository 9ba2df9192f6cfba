"""Internals of the CUDA backend (``ndarray_backend_cuda`` is its public face).

``launch`` is pure Python (grids, scalar casts, argument checks) and is tested without a GPU;
``runtime`` holds everything that touches CuPy. The package is named ``_cuda`` rather than
``cuda`` so that importing it never shadows the ``cuda()`` device function of
``needle.backend_ndarray``.
"""
