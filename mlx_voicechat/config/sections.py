"""The leaf sections of the config tree: listening (preprocessor, encoder, RNNT), speaking
(EAR-TTS, character encoder, MoG head, codec) and the LLM's Nemotron-H arguments.

Defaults are the real 11B model's values and are written once, as dataclass field defaults.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Tuple

from ..errors import CheckpointError

MODEL_TYPE = "nemotron_voicechat"
SPEAKER = "Aria"
# The recognizer's model types (mlx-audio's, then Transformers'): the factory and load() tell
# the two models apart by them.
MLX_AUDIO_TYPE = "nemotron_asr"
TRANSFORMERS_TYPES = ("nemotron3_5_asr", "nemotron_asr_streaming")
RECOGNIZER_TYPES = (MLX_AUDIO_TYPE,) + TRANSFORMERS_TYPES


def is_recognizer_config(raw: Any) -> bool:
    """Whether a ``config.json`` object describes Nemotron-3.5-ASR (either layout)."""
    return isinstance(raw, dict) and raw.get("model_type") in RECOGNIZER_TYPES


class ConfigError(CheckpointError):
    """A checkpoint's config.json cannot describe a VoiceChat model."""


def _known(cls, d: Dict[str, Any]) -> Dict[str, Any]:
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in d.items() if k in names}


@dataclass
class SubConfig:
    """Base for the leaf configs: ``from_dict`` keeps only the keys the class declares and
    reads a section (a SubConfig field) with that section's own ``from_dict``."""

    @classmethod
    def from_dict(cls, d: Optional[Dict[str, Any]]):
        d = _known(cls, d or {})
        for f in dataclasses.fields(cls):
            if isinstance(f.default_factory, type) and issubclass(f.default_factory, SubConfig):
                d[f.name] = f.default_factory.from_dict(d.get(f.name))
        return cls(**d)

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


# --- rename tables -------------------------------------------------------------------------
# A layout's config.json as a template: a leaf "@a.b" is the field ``a.b`` of our config tree,
# read and written ("@a.b|c.d" is read into both, written from the first), "=a.b" is only
# written, a key "*" splices in a whole section, anything else is a constant that is written.


def read_fields(template: Mapping[str, Any], d: Any, out: Optional[dict] = None) -> dict:
    """The fields ``d`` holds, nested as our config tree: ``{"audio_config": {...}, ...}``."""
    out = {} if out is None else out
    for key, spec in template.items():
        if key == "*":
            value = d
        elif isinstance(d, Mapping) and key in d:
            value = d[key]
        else:
            continue
        if isinstance(spec, Mapping):
            read_fields(spec, value, out)
        elif isinstance(spec, str) and spec.startswith("@"):
            for path in spec[1:].split("|"):
                *parents, leaf = path.split(".")
                node = out
                for name in parents:
                    node = node.setdefault(name, {})
                # the first place in the template wins; a section is copied, never shared
                node.setdefault(leaf, dict(value) if isinstance(value, Mapping) else value)
    return out


def write_fields(template: Mapping[str, Any], config: Any) -> Dict[str, Any]:
    """``template`` filled from ``config`` (a dataclass tree)."""
    out: Dict[str, Any] = {}
    for key, spec in template.items():
        if isinstance(spec, Mapping):
            out[key] = write_fields(spec, config)
            continue
        if isinstance(spec, str) and spec[:1] in ("@", "="):
            value = config
            for name in spec[1:].split("|")[0].split("."):
                value = getattr(value, name)
            if dataclasses.is_dataclass(value):
                value = value.to_dict()
            spec = list(value) if isinstance(value, tuple) else value
        if key == "*":
            out.update(spec)
        else:
            out[key] = dict(spec) if isinstance(spec, dict) else spec
    return out


# --- listening path ---------------------------------------------------------------------


@dataclass
class PreprocessorConfig(SubConfig):
    sample_rate: int = 16000
    features: int = 128
    n_fft: int = 512
    window_size: float = 0.025  # seconds (400 samples)
    window_stride: float = 0.01  # seconds (160 samples)
    window: str = "hann"
    preemph: float = 0.97
    log_zero_guard_value: float = 2.0**-24
    mag_power: float = 2.0
    normalize: str = "NA"
    pad_to: int = 0
    pad_value: float = 0.0
    dither: float = 1e-5  # training only, never applied here

    @property
    def win_length(self) -> int:
        return int(round(self.window_size * self.sample_rate))

    @property
    def hop_length(self) -> int:
        return int(round(self.window_stride * self.sample_rate))


@dataclass
class EncoderConfig(SubConfig):
    feat_in: int = 128
    n_layers: int = 24
    d_model: int = 1024
    n_heads: int = 8
    ff_expansion_factor: int = 4
    subsampling_factor: int = 8
    subsampling_conv_channels: int = 256
    conv_kernel_size: int = 9
    causal_downsampling: bool = True
    conv_norm_type: str = "layer_norm"
    self_attention_model: str = "rel_pos"
    att_context_style: str = "chunked_limited"
    att_context_size: Tuple[int, int] = (70, 0)
    pos_emb_max_len: int = 5000
    use_bias: bool = False
    xscaling: bool = False
    untie_biases: bool = True

    def __post_init__(self):
        ctx = self.att_context_size
        if isinstance(ctx, (list, tuple)) and len(ctx) and isinstance(ctx[0], (list, tuple)):
            ctx = ctx[0]
        if not (isinstance(ctx, (list, tuple)) and len(ctx) == 2):
            raise ConfigError(
                "att_context_size must be [left, right] or [[left, right]], got "
                f"{self.att_context_size!r}"
            )
        self.att_context_size = (int(ctx[0]), int(ctx[1]))


@dataclass
class RNNTDecoderConfig(SubConfig):
    pred_hidden: int = 640
    pred_rnn_layers: int = 2
    vocab_size: int = 1024
    blank_as_pad: bool = True


@dataclass
class RNNTJointConfig(SubConfig):
    encoder_hidden: int = 1024
    pred_hidden: int = 640
    joint_hidden: int = 640
    num_classes: int = 1024
    activation: str = "relu"


@dataclass
class AudioConfig(SubConfig):
    preprocessor: PreprocessorConfig = field(default_factory=PreprocessorConfig)
    encoder: EncoderConfig = field(default_factory=EncoderConfig)
    decoder: RNNTDecoderConfig = field(default_factory=RNNTDecoderConfig)
    joint: RNNTJointConfig = field(default_factory=RNNTJointConfig)
    output_dim: int = 4480
    max_symbols: int = 10

    @classmethod
    def from_dict(cls, d):
        d = dict(d or {})
        # NeMo's RNNT sections, their ``prednet`` / ``jointnet`` keys lifted up
        for name, inner in (("decoder", "prednet"), ("joint", "jointnet")):
            d[name] = dict(d.get(name) or {})
            d[name].update(d[name].pop(inner, None) or {})
        return super().from_dict(d)


# --- speaking path ----------------------------------------------------------------------


@dataclass
class CharEncoderConfig(SubConfig):
    hidden_size: int = 1152
    intermediate_size: int = 4608
    num_hidden_layers: int = 1
    num_attention_heads: int = 16
    num_key_value_heads: int = 16
    head_dim: int = 72
    rms_norm_eps: float = 1e-6
    query_pre_attn_scalar: float = 256
    attn_logit_softcapping: Optional[float] = 50.0
    rope_base: float = 10000.0
    char_vocab_size: int = 257  # 256 single characters + the padding index (the last one)

    @classmethod
    def from_dict(cls, d):
        d = dict(d or {})
        for rope in (d.get("rope_parameters") or {}, d):  # rope_base wins, then the nested theta
            if "rope_theta" in rope:
                d.setdefault("rope_base", rope["rope_theta"])
        return super().from_dict(d)


@dataclass
class MoGHeadConfig(SubConfig):
    intermediate_size: int = 4608
    num_layers: int = 3
    low_rank: int = 64
    min_log_std: float = -4.0
    eps: float = 1e-6
    num_predictions: int = 1024


@dataclass
class TTSConfig(SubConfig):
    hidden_size: int = 1152
    intermediate_size: int = 4608
    num_hidden_layers: int = 28
    num_attention_heads: int = 16
    num_key_value_heads: int = 16
    head_dim: int = 72
    sliding_window: int = 7500
    sliding_window_pattern: int = 6
    rms_norm_eps: float = 1e-6
    query_pre_attn_scalar: float = 256
    rope_global_base_freq: float = 1_000_000.0
    rope_local_base_freq: float = 10_000.0
    latent_size: int = 512
    num_quantizers: int = 31
    codebook_size: int = 1024
    num_delay_speech_tokens: int = 2
    num_iterations: int = 8
    guidance_scale: float = 0.2
    top_p: float = 0.95
    noise_scale: float = 0.001
    exponent: float = 3.0
    use_gated_fusion_for_text_audio: bool = True
    use_subword_flag_emb: bool = True
    use_bos_eos_emb: bool = True
    use_audio_prompt_frozen_projection: bool = True
    audio_prompt_duration: float = 3.0
    character_encoder: CharEncoderConfig = field(default_factory=CharEncoderConfig)
    mog_head: MoGHeadConfig = field(default_factory=MoGHeadConfig)

    @classmethod
    def from_dict(cls, d):
        d = dict(d or {})
        char = CharEncoderConfig.from_dict(d.get("character_encoder"))
        # Flat configs written by mlx-vlm omit the backbone's query_pre_attn_scalar; NeMo builds
        # both Gemma stacks from one recipe, so the character encoder's value is the right one.
        d.setdefault("query_pre_attn_scalar", char.query_pre_attn_scalar)
        d.setdefault("rms_norm_eps", char.rms_norm_eps)
        return super().from_dict(d)

    def is_global_layer(self, i: int) -> bool:
        return (i + 1) % self.sliding_window_pattern == 0

    def mask_schedule(self) -> List[int]:
        """Codebooks filled by each of the ``num_iterations`` MoG iterations (zeros included)."""
        n, q = self.num_iterations, self.num_quantizers
        masked = [
            math.ceil((1 - (i / n) ** self.exponent) ** (1 / self.exponent) * q) for i in range(n)
        ]
        masked.append(0)
        return [masked[i] - masked[i + 1] for i in range(n)]


@dataclass
class CodecConfig(SubConfig):
    sample_rate: int = 22050
    base_channels: int = 384
    channel_multipliers: Tuple[int, ...] = (1, 2, 4)
    downsample_rates: Tuple[int, ...] = (7, 7, 9)
    blocks_per_stage: int = 3
    block_kernel_size: int = 7
    latent_dim: int = 512
    n_fft: int = 16
    hop_length: int = 4
    num_quantizers: int = 31
    codebook_size: int = 1024

    def __post_init__(self):
        self.channel_multipliers = tuple(self.channel_multipliers)
        self.downsample_rates = tuple(self.downsample_rates)

    @property
    def samples_per_frame(self) -> int:
        return self.hop_length * math.prod(self.downsample_rates)

    @property
    def stft_channels(self) -> int:
        return 2 * (self.n_fft // 2 + 1)

    @property
    def num_layers(self) -> int:
        """Layers of the encoder (and of the decoder): one conv, then per stage blocks + a
        resampler."""
        return 1 + len(self.downsample_rates) * (self.blocks_per_stage + 1)


# --- the LLM ----------------------------------------------------------------------------

# Nemotron-Nano-9B-v2, the LLM of the real model. NVIDIA's raw release names it by hub id
# instead of embedding its config, so the loader falls back to these values.
NEMOTRON_NANO_9B_V2 = {
    "model_type": "nemotron_h",
    "vocab_size": 131072,
    "hidden_size": 4480,
    "intermediate_size": 15680,
    "num_hidden_layers": 56,
    "max_position_embeddings": 131072,
    "num_attention_heads": 40,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "attention_bias": False,
    "mamba_num_heads": 128,
    "mamba_head_dim": 80,
    "mamba_proj_bias": False,
    "ssm_state_size": 128,
    "conv_kernel": 4,
    "n_groups": 8,
    "mlp_bias": False,
    "layer_norm_epsilon": 1e-5,
    "use_bias": False,
    "use_conv_bias": True,
    "hybrid_override_pattern": "M-M-M-MM-M-M-M*-M-M-M*-M-M-M-M*-M-M-M-M*-M-MM-M-M-M-M-M-",
    "time_step_limit": [0.0, float("inf")],
}

# What a text config that leaves these out means (the real LLM's values).
_TEXT_DEFAULTS = {
    k: NEMOTRON_NANO_9B_V2[k]
    for k in (
        "attention_bias",
        "mamba_proj_bias",
        "mlp_bias",
        "use_bias",
        "use_conv_bias",
        "layer_norm_epsilon",
        "max_position_embeddings",
    )
}


def text_args(text_config: Dict[str, Any]):
    """mlx-lm's Nemotron-H ``ModelArgs`` for a text config (a HF ``nemotron_h`` dict)."""
    from mlx_lm.models.nemotron_h import ModelArgs as NemotronHArgs

    d = {**_TEXT_DEFAULTS, **text_config, "model_type": "nemotron_h"}
    pattern = d.get("hybrid_override_pattern")
    if isinstance(pattern, str):
        d["hybrid_override_pattern"] = list(pattern)
    # transformers' Nemotron-H, which NeMo runs, floors dt at time_step_min (1e-3 unless the
    # config says otherwise) on top of time_step_limit; mlx-lm clips to time_step_limit only.
    low, high = d.get("time_step_limit") or (0.0, float("inf"))
    d["time_step_limit"] = (max(float(low), float(d.get("time_step_min") or 1e-3)), float(high))
    return NemotronHArgs.from_dict(d)


# The flat config's scalar entries, in the order mlx-vlm's converter writes them.
TOP_LEVEL_KEYS = (
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "silence_token_id",
    "rnnt_blank_id",
    "input_sample_rate",
    "output_sample_rate",
    "frame_duration",
    "function_channel_weight",
    "speaker",
    "rnnt_vocabulary",
)
