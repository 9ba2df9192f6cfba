"""Concrete datasets: MNIST (gzip IDX), CIFAR-10 (pickles), in-memory arrays, Penn Treebank."""
from .cifar10_dataset import *  # noqa: F401,F403
from .mnist_dataset import *  # noqa: F401,F403
from .ndarray_dataset import *  # noqa: F401,F403
from .ptb_dataset import *  # noqa: F401,F403
