"""The root of the config tree: :class:`VoiceChatConfig`, the whole model's configuration.

``VoiceChatConfig.from_dict`` reads any of the three checkpoint layouts' ``config.json``
(:mod:`mlx_voicechat.config.layouts`); ``to_dict`` writes the flat mlx-community config.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from . import layouts
from .sections import (
    MODEL_TYPE,
    NEMOTRON_NANO_9B_V2,
    SPEAKER,
    TOP_LEVEL_KEYS,
    AudioConfig,
    CodecConfig,
    ConfigError,
    TTSConfig,
    text_args,
)

# --- the whole model --------------------------------------------------------------------


@dataclass
class VoiceChatConfig:
    text_config: Dict[str, Any] = field(default_factory=lambda: dict(NEMOTRON_NANO_9B_V2))
    audio_config: AudioConfig = field(default_factory=AudioConfig)
    tts_config: TTSConfig = field(default_factory=TTSConfig)
    codec_config: CodecConfig = field(default_factory=CodecConfig)
    model_type: str = MODEL_TYPE
    bos_token_id: int = 1
    eos_token_id: int = 2
    pad_token_id: int = 12
    silence_token_id: int = 11
    rnnt_blank_id: Optional[int] = None
    input_sample_rate: int = 16000
    output_sample_rate: int = 22050
    frame_duration: float = 0.08
    function_channel_weight: float = 2.0
    speaker: str = SPEAKER
    rnnt_vocabulary: List[str] = field(default_factory=list)
    quantization: Optional[Dict[str, Any]] = None
    layout: str = "mlx-community"
    model_path: Optional[str] = None

    def __post_init__(self):
        if self.model_type != MODEL_TYPE:
            raise ConfigError(
                f"config.json describes model_type {self.model_type!r}, not {MODEL_TYPE!r}"
            )
        if self.speaker != SPEAKER:
            raise ConfigError(
                f"speaker {self.speaker!r} is not supported: the checkpoint ships only the "
                f"{SPEAKER!r} voice prompt"
            )
        if not isinstance(self.text_config, dict):
            self.text_config = dataclasses.asdict(self.text_config)

    # mlx-lm / mlx-audio call ``ModelArgs.from_dict`` / ``ModelConfig.from_dict`` with the raw
    # config.json dict; so does our own loader.
    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "VoiceChatConfig":
        """Any of the three layouts' config.json (see :mod:`mlx_voicechat.config.layouts`)."""
        return cls(**layouts.fields(cls, d))

    # --- derived values ------------------------------------------------------------------

    @property
    def text_args(self):
        return text_args(self.text_config)

    @property
    def samples_per_frame(self) -> int:
        return self.codec_config.samples_per_frame

    @property
    def input_samples_per_frame(self) -> int:
        return int(round(self.frame_duration * self.input_sample_rate))

    @property
    def blank_id(self) -> int:
        """The RNNT blank: the joint's last output (errata 15), whatever the config says."""
        return self.audio_config.joint.num_classes

    def load_rnnt_vocabulary(self, folder: Path) -> List[str]:
        """RNNT pieces from the config, else from ``rnnt_tokenizer/vocab.json`` beside it."""
        if self.rnnt_vocabulary:
            return list(self.rnnt_vocabulary)
        path = Path(folder) / "rnnt_tokenizer" / "vocab.json"
        if path.exists():
            with open(path, encoding="utf-8") as f:
                vocab = json.load(f)
            if isinstance(vocab, dict):  # {piece: id}
                vocab = [p for p, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
            self.rnnt_vocabulary = list(vocab)
        return list(self.rnnt_vocabulary)

    def to_dict(self) -> Dict[str, Any]:
        """The flat mlx-community config for this model."""
        d = {
            "model_type": self.model_type,
            "architectures": ["NemotronVoiceChatForConditionalGeneration"],
            "text_config": dict(self.text_config),
            "audio_config": self.audio_config.to_dict(),
            "tts_config": self.tts_config.to_dict(),
            "codec_config": self.codec_config.to_dict(),
        }
        d["audio_config"]["encoder"]["att_context_size"] = [
            list(self.audio_config.encoder.att_context_size)
        ]
        for k in TOP_LEVEL_KEYS:
            d[k] = getattr(self, k)
        d["rnnt_blank_id"] = self.blank_id
        if self.quantization:
            d["quantization"] = self.quantization
            d["quantization_config"] = self.quantization
        return d


# The names the two ecosystem loaders look for.
ModelArgs = VoiceChatConfig
ModelConfig = VoiceChatConfig
