"""Parsing each checkpoint layout's ``config.json`` into :class:`VoiceChatConfig` fields.

* the flat mlx-community config (``text_config``, ``audio_config``, ``tts_config``, ...),
* NVIDIA's raw NeMo/Hydra run config (``model.stt.model``, ``model.speech_generation``,
  ``_rnnt_merge_info``), and
* mlx-audio's prepared config (the NeMo config plus an ``mlx_audio`` section).

Each parser returns the keyword arguments of ``cls`` (the ``VoiceChatConfig`` class, passed
in so that this module sits below it).
"""

from __future__ import annotations

from typing import Any, Dict

from .sections import (
    MODEL_TYPE,
    NEMOTRON_NANO_9B_V2,
    SPEAKER,
    AudioConfig,
    CodecConfig,
    ConfigError,
    TTSConfig,
    _known,
)


def fields(cls, d: Dict[str, Any]) -> Dict[str, Any]:
    """The layout of ``d`` detected from its keys, then parsed."""
    if not isinstance(d, dict):
        raise ConfigError("config.json must hold a JSON object")
    if "model" in d and isinstance(d["model"], dict) and "stt" in d["model"]:
        return nemo_fields(cls, d)
    if "text_config" in d or "audio_config" in d or "tts_config" in d:
        return flat_fields(cls, d)
    mt = d.get("model_type")
    if mt is not None and mt != MODEL_TYPE:
        raise ConfigError(f"config.json describes model_type {mt!r}, not {MODEL_TYPE!r}")
    raise ConfigError(
        "config.json is not a NemotronLabs VoiceChat config: expected the flat mlx-community "
        "keys (text_config, audio_config, tts_config, codec_config) or NVIDIA's nested NeMo "
        "config (model.stt, model.speech_generation)"
    )


def flat_fields(cls, d: Dict[str, Any]) -> Dict[str, Any]:
    """``cls`` (VoiceChatConfig) fields from the flat mlx-community config."""
    if d.get("model_type", MODEL_TYPE) != MODEL_TYPE:
        raise ConfigError(
            f"config.json describes model_type {d.get('model_type')!r}, not {MODEL_TYPE!r}"
        )
    top = _known(cls, d)
    for k in ("text_config", "audio_config", "tts_config", "codec_config", "layout"):
        top.pop(k, None)
    return dict(
        text_config=dict(d.get("text_config") or NEMOTRON_NANO_9B_V2),
        audio_config=AudioConfig.from_dict(d.get("audio_config")),
        tts_config=TTSConfig.from_dict(d.get("tts_config")),
        codec_config=CodecConfig.from_dict(d.get("codec_config")),
        layout="mlx-community",
        **top,
    )


def nemo_fields(cls, d: Dict[str, Any]) -> Dict[str, Any]:
    """``cls`` (VoiceChatConfig) fields from NVIDIA's NeMo/Hydra config (mlx-audio: plus its
    ``mlx_audio`` section)."""
    model = d["model"]
    stt = (model.get("stt") or {}).get("model") or {}
    gen_run = model.get("speech_generation") or {}
    gen = gen_run.get("model") or {}
    gen_data = gen_run.get("data") or {}
    data = d.get("data") or {}
    mlx_audio = d.get("mlx_audio") or {}
    perception = stt.get("perception") or {}
    rnnt = d.get("_rnnt_merge_info") or {}
    tts = gen.get("tts_config") or {}
    backbone = tts.get("backbone_config") or {}
    rope = backbone.get("rope_parameters") or {}
    cas = ((tts.get("cas_config") or {}).get("backbone_config") or {}).get("encoder") or {}
    codec = gen.get("codec_config") or {}

    text = d.get("text_config") or mlx_audio.get("llm_config")
    if not text:
        text = dict(NEMOTRON_NANO_9B_V2)

    audio = AudioConfig.from_dict(
        {
            "preprocessor": perception.get("preprocessor"),
            "encoder": perception.get("encoder"),
            "decoder": rnnt.get("decoder_config"),
            "joint": rnnt.get("joint_config"),
            "output_dim": perception.get("output_dim", AudioConfig.output_dim),
        }
    )
    tts_dict = {
        **{k: v for k, v in backbone.items() if k not in ("rope_parameters",)},
        **{k: v for k, v in tts.items() if not isinstance(v, dict)},
        "character_encoder": cas,
        "mog_head": tts.get("mog_head_config"),
        "guidance_scale": gen.get("inference_guidance_scale", TTSConfig.guidance_scale),
        "top_p": gen.get("inference_top_p_or_k", TTSConfig.top_p),
        "noise_scale": gen.get("inference_noise_scale", TTSConfig.noise_scale),
        "audio_prompt_duration": gen_data.get(
            "audio_prompt_duration", TTSConfig.audio_prompt_duration
        ),
    }
    if "full_attention" in rope:
        tts_dict["rope_global_base_freq"] = rope["full_attention"].get("rope_theta")
    if "sliding_attention" in rope:
        tts_dict["rope_local_base_freq"] = rope["sliding_attention"].get("rope_theta")
    codec_dict = {
        "sample_rate": data.get("target_sample_rate", gen_data.get("target_sample_rate", 22050)),
        "base_channels": codec.get("base_hidden_size", CodecConfig.base_channels),
        "channel_multipliers": codec.get("channel_mult", CodecConfig.channel_multipliers),
        "downsample_rates": codec.get("rates", CodecConfig.downsample_rates),
        "blocks_per_stage": codec.get("num_blocks", CodecConfig.blocks_per_stage),
        "block_kernel_size": codec.get("kernel_size", CodecConfig.block_kernel_size),
        "latent_dim": codec.get("latent_size", CodecConfig.latent_dim),
        "n_fft": codec.get("n_fft", CodecConfig.n_fft),
        "hop_length": codec.get("hop_length", CodecConfig.hop_length),
        "num_quantizers": codec.get("num_quantizers", CodecConfig.num_quantizers),
        "codebook_size": codec.get("codebook_size", CodecConfig.codebook_size),
    }
    vocab = (rnnt.get("joint_config") or {}).get("vocabulary") or []
    top = {
        "speaker": model.get("inference_speaker_name", SPEAKER),
        "input_sample_rate": data.get("source_sample_rate", 16000),
        "output_sample_rate": data.get("target_sample_rate", 22050),
        "frame_duration": data.get("frame_length", 0.08),
        "function_channel_weight": stt.get(
            "duplex_function_channel_weight", cls.function_channel_weight
        ),
        "rnnt_vocabulary": list(vocab),
        "quantization": d.get("quantization") or d.get("quantization_config"),
        "model_path": d.get("model_path"),
    }
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if k in text:
            top[k] = text[k]
    return dict(
        text_config=dict(text),
        audio_config=audio,
        tts_config=TTSConfig.from_dict(tts_dict),
        codec_config=CodecConfig.from_dict(codec_dict),
        layout="mlx-audio" if mlx_audio else "nvidia",
        **top,
    )
