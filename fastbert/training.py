"""Deprecated alias of fastbert.train, where fastbert.training's names now live; kept for one release, then removed."""

import warnings

from fastbert.train import *  # noqa: F403
from fastbert.train import __all__  # noqa: F401

warnings.warn("fastbert.training is deprecated: import from fastbert.train", DeprecationWarning, stacklevel=2)
