"""Kept as an import path of the package's first layout: this module is
:mod:`mlx_voicechat.nemotron_voicechat.runtime.session`."""

import sys

from ..nemotron_voicechat.runtime import session as _module

sys.modules[__name__] = _module
