"""The module mlx-lm and mlx-audio import for ``model_type: "nemotron_voicechat"``.

Reached as ``mlx_lm.models.nemotron_voicechat`` and ``mlx_audio.sts.models.nemotron_voicechat``
through the plugin finder (see ``mlx_voicechat_boot``).
"""

from .config import ModelArgs, ModelConfig, VoiceChatConfig
from .model import Model

# A package-like empty search path, so that `<alias>.config` etc. reach the finder, which maps
# them onto this package's modules.
__path__ = []

__all__ = ["Model", "ModelArgs", "ModelConfig", "VoiceChatConfig"]
