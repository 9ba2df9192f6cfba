"""Layer L1: the strided NDArray and its devices (see needle/backend_ndarray/ndarray.py)."""
from .ndarray import *  # noqa: F401,F403
from .ndarray import BackendDevice, NDArray  # noqa: F401
