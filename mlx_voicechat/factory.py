"""Kept so that ``mlx_voicechat.factory.make_checkpoint`` (as documented) keeps working: the
random-weight checkpoint factory lives in :mod:`mlx_voicechat.weights.factory`."""

from .weights.factory import LAYOUTS, SCALES, make_checkpoint, scale_config

__all__ = ["LAYOUTS", "SCALES", "make_checkpoint", "scale_config"]
