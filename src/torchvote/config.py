"""Moved to :mod:`torchvote.training.config` (kept for the imports of other packages)."""

from torchvote.training.config import *  # noqa: F403
from torchvote.training.config import __all__  # noqa: F401
