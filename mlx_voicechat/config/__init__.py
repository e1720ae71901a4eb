"""Configuration of NemotronLabs VoiceChat, the dataclass tree every network is built from (the
bottom layer, above :mod:`mlx_voicechat.errors` only): :mod:`.sections` (the leaf sections and
the LLM's arguments), :mod:`.voicechat` (:class:`VoiceChatConfig`, the root) and :mod:`.layouts`
(each checkpoint layout's config.json)."""

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
