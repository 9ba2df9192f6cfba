"""Layer L5 data pipeline: datasets, the DataLoader, samplers and image transforms.

Example:
    >>> import numpy as np
    >>> from needle.data import NDArrayDataset
    >>> len(NDArrayDataset(np.zeros((5, 2)), np.arange(5)))
    5
"""
from .data_basic import *  # noqa: F401,F403
from .data_transforms import *  # noqa: F401,F403
from .datasets import *  # noqa: F401,F403
from .samplers import *  # noqa: F401,F403
