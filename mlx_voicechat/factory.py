"""The documented path of :mod:`mlx_voicechat.nemotron_voicechat.weights.factory` (every name
it exports)."""

from .nemotron_voicechat.weights.factory import *  # noqa: F403
from .nemotron_voicechat.weights.factory import __all__  # noqa: F401
