"""Kept so that ``mlx_voicechat.factory.make_checkpoint`` (as documented) keeps working: the
random-weight checkpoint factory lives in :mod:`mlx_voicechat.weights.factory`, and every name
it exports is re-exported here."""

from .weights.factory import *  # noqa: F403
from .weights.factory import __all__  # noqa: F401
