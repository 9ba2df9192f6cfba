"""Layer L5 neural-network modules of the course API (Module, Linear, Conv, RNN/LSTM, ...).

Example:
    >>> import numpy as np
    >>> import needle as ndl
    >>> from needle import nn
    >>> np.random.seed(0); model = nn.Sequential(nn.Linear(4, 3), nn.ReLU())
    >>> model(ndl.Tensor(np.ones((2, 4)))).shape
    (2, 3)
"""
from .nn_attention import *  # noqa: F401,F403
from .nn_basic import *  # noqa: F401,F403
from .nn_conv import *  # noqa: F401,F403
from .nn_sequence import *  # noqa: F401,F403
from .torch_layout import *  # noqa: F401,F403
