"""Layer L5 initialisers of the course API: every draw is one NumPy global-RNG call.

Example:
    >>> import numpy as np
    >>> from needle import init
    >>> np.random.seed(0); a = init.rand(2, 3).numpy()
    >>> np.random.seed(0); np.allclose(a, np.random.rand(2, 3))
    True
"""
from .init_basic import *  # noqa: F401,F403
from .init_initializers import *  # noqa: F401,F403
