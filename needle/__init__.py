"""needle: a tensor/autograd framework (course-compatible; see NEEDLE_API.md)."""
# Integration in progress: the full course import order is restored as layers land.
from . import backend_ndarray  # noqa: F401
from . import memory  # noqa: F401  (installs the caching allocators before anything allocates)
