"""Configuration of NemotronLabs VoiceChat: the dataclass tree every network is built from.

The bottom layer of the package (above :mod:`mlx_voicechat.errors` only):

* :mod:`.sections`: the leaf sections (preprocessor, encoder, RNNT, EAR-TTS, character
  encoder, MoG head, codec) and the LLM's Nemotron-H arguments;
* :mod:`.voicechat`: :class:`VoiceChatConfig`, the root of the tree;
* :mod:`.layouts`: parsing the config.json of each checkpoint layout (mlx-community flat,
  NVIDIA NeMo/Hydra, mlx-audio prepared).
"""

from .sections import (
    MODEL_TYPE,
    NEMOTRON_NANO_9B_V2,
    SPEAKER,
    TOP_LEVEL_KEYS,
    AudioConfig,
    CharEncoderConfig,
    CodecConfig,
    ConfigError,
    EncoderConfig,
    MoGHeadConfig,
    PreprocessorConfig,
    RNNTDecoderConfig,
    RNNTJointConfig,
    SubConfig,
    TTSConfig,
    text_args,
)
from .voicechat import ModelArgs, ModelConfig, VoiceChatConfig

__all__ = [
    "MODEL_TYPE",
    "NEMOTRON_NANO_9B_V2",
    "SPEAKER",
    "TOP_LEVEL_KEYS",
    "AudioConfig",
    "CharEncoderConfig",
    "CodecConfig",
    "ConfigError",
    "EncoderConfig",
    "MoGHeadConfig",
    "ModelArgs",
    "ModelConfig",
    "PreprocessorConfig",
    "RNNTDecoderConfig",
    "RNNTJointConfig",
    "SubConfig",
    "TTSConfig",
    "VoiceChatConfig",
    "text_args",
]
