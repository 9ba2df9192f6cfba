"""Layer L1: the strided NDArray and its devices (see needle/backend_ndarray/ndarray.py).

``intercept(device, handler)`` (from :mod:`.devices`) is the declared way to stand a handler
in for a device's backend module on one thread.
"""
from .devices import intercept  # noqa: F401
from .ndarray import *  # noqa: F401,F403
from .ndarray import BackendDevice, NDArray  # noqa: F401
