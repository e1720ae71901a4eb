"""Kept as an import path of the package's first layout: this module is
:mod:`mlx_voicechat.nemotron_asr.session`."""

import sys

from ..nemotron_asr import session as _module

sys.modules[__name__] = _module
