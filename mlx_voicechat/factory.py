"""Kept so that ``mlx_voicechat.factory.make_checkpoint`` (as documented) keeps working: the
random-weight checkpoint factory lives in :mod:`mlx_voicechat.nemotron_voicechat.weights.factory`,
and every name it exports is re-exported here."""

from .nemotron_voicechat.weights.factory import *  # noqa: F403
from .nemotron_voicechat.weights.factory import __all__  # noqa: F401
