"""Kept as an import path of the package's first layout: this module is
:mod:`mlx_voicechat.audio.devices`."""

import sys

from ..audio import devices as _module

sys.modules[__name__] = _module
