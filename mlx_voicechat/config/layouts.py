"""Each checkpoint layout's ``config.json`` (flat mlx-community; NVIDIA's nested NeMo/Hydra run
config; mlx-audio's, the NeMo one plus an ``mlx_audio`` section) to :class:`VoiceChatConfig`
fields. ``cls`` is passed in so that this module sits below that class."""

from __future__ import annotations

from typing import Any, Dict

from .sections import (
    MODEL_TYPE,
    NEMOTRON_NANO_9B_V2,
    AudioConfig,
    CodecConfig,
    ConfigError,
    TTSConfig,
    _known,
    read_fields,
    write_fields,
)

GEMMA_SIZES = (  # named alike by both TTS stacks and the flat config
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
)
GEMMA_KEYS = (*GEMMA_SIZES, "rms_norm_eps", "query_pre_attn_scalar")
_TTS_FLAGS = (
    "latent_size",
    "num_quantizers",
    "codebook_size",
    "exponent",
    "num_delay_speech_tokens",
    "use_subword_flag_emb",
    "use_bos_eos_emb",
    "use_gated_fusion_for_text_audio",
    "use_audio_prompt_frozen_projection",
)


def fields(cls, d: Dict[str, Any]) -> Dict[str, Any]:
    """The layout of ``d`` detected from its keys, then parsed."""
    if not isinstance(d, dict):
        raise ConfigError("config.json must hold a JSON object")
    if "model" in d and isinstance(d["model"], dict) and "stt" in d["model"]:
        return nemo_fields(cls, d)
    flat = "text_config" in d or "audio_config" in d or "tts_config" in d
    mt = d.get("model_type", MODEL_TYPE)
    if mt != MODEL_TYPE and (flat or mt is not None):
        raise ConfigError(f"config.json describes model_type {mt!r}, not {MODEL_TYPE!r}")
    if flat:
        return flat_fields(cls, d)
    raise ConfigError(
        "config.json is not a NemotronLabs VoiceChat config: expected the flat mlx-community "
        "keys (text_config, audio_config, tts_config, codec_config) or NVIDIA's nested NeMo "
        "config (model.stt, model.speech_generation)"
    )


def _scalars(cls, d: Dict[str, Any]) -> Dict[str, Any]:
    """``cls``'s fields in ``d`` but the sections and the layout (which is detected)."""
    sections = ("text_config", "audio_config", "tts_config", "codec_config", "layout")
    return {k: v for k, v in _known(cls, d).items() if k not in sections}


def flat_fields(cls, d: Dict[str, Any]) -> Dict[str, Any]:
    """``cls`` (VoiceChatConfig) fields from the flat mlx-community config."""
    top = _scalars(cls, d)
    return dict(
        text_config=dict(d.get("text_config") or NEMOTRON_NANO_9B_V2),
        audio_config=AudioConfig.from_dict(d.get("audio_config")),
        tts_config=TTSConfig.from_dict(d.get("tts_config")),
        codec_config=CodecConfig.from_dict(d.get("codec_config")),
        layout="mlx-community",
        **top,
    )


_TTS = "tts_config"
_CHAR = "tts_config.character_encoder"
_DECODER, _JOINT = "audio_config.decoder", "audio_config.joint"
_DEFAULT_ROPE = {"rope_type": "default"}
_NEMO_ASR = "nemo.collections.asr.modules"

# NVIDIA's nested NeMo/Hydra run config (the text config embedded), field by field.
NEMO = {
    "data": {
        "source_sample_rate": "@input_sample_rate",
        "target_sample_rate": "@output_sample_rate|codec_config.sample_rate",
        "frame_length": "@frame_duration",
    },
    "exp_manager": {},
    "model": {
        "stt": {
            "model": {
                "pretrained_llm": "nvidia/NVIDIA-Nemotron-Nano-9B-v2",
                "perception": {
                    "preprocessor": {
                        "_target_": f"{_NEMO_ASR}.AudioToMelSpectrogramPreprocessor",
                        "*": "@audio_config.preprocessor",
                    },
                    "encoder": {
                        "*": "@audio_config.encoder",
                        "_target_": f"{_NEMO_ASR}.ConformerEncoder",
                    },
                    "output_dim": "@audio_config.output_dim",
                },
                "use_function_head": True,
                "duplex_function_channel_weight": "@function_channel_weight",
            }
        },
        "speech_generation": {
            "data": {
                "target_sample_rate": "@codec_config.sample_rate",
                "source_sample_rate": "=input_sample_rate",
                "frame_length": "=frame_duration",
                "audio_prompt_duration": f"@{_TTS}.audio_prompt_duration",
            },
            "model": {
                "inference_guidance_scale": f"@{_TTS}.guidance_scale",
                "inference_top_p_or_k": f"@{_TTS}.top_p",
                "inference_noise_scale": f"@{_TTS}.noise_scale",
                "tts_config": {
                    "backbone_type": "gemma3_text",
                    "backbone_config": {
                        **{k: f"@{_TTS}.{k}" for k in GEMMA_KEYS},
                        "sliding_window": f"@{_TTS}.sliding_window",
                        "sliding_window_pattern": f"@{_TTS}.sliding_window_pattern",
                        "rope_parameters": {
                            "full_attention": {
                                **_DEFAULT_ROPE,
                                "rope_theta": f"@{_TTS}.rope_global_base_freq",
                            },
                            "sliding_attention": {
                                **_DEFAULT_ROPE,
                                "rope_theta": f"@{_TTS}.rope_local_base_freq",
                            },
                        },
                    },
                    **{k: f"@{_TTS}.{k}" for k in _TTS_FLAGS},
                    "cas_config": {
                        "backbone_type": "t5gemma",
                        "backbone_config": {
                            "encoder": {
                                **{k: f"@{_CHAR}.{k}" for k in GEMMA_KEYS},
                                "attn_logit_softcapping": f"@{_CHAR}.attn_logit_softcapping",
                                "rope_parameters": {
                                    **_DEFAULT_ROPE,
                                    "rope_theta": f"@{_CHAR}.rope_base",
                                },
                            }
                        },
                    },
                    "mog_head_config": f"@{_TTS}.mog_head",
                },
                "codec_config": {
                    "latent_size": "@codec_config.latent_dim",
                    "n_fft": "@codec_config.n_fft",
                    "hop_length": "@codec_config.hop_length",
                    "base_hidden_size": "@codec_config.base_channels",
                    "channel_mult": "@codec_config.channel_multipliers",
                    "rates": "@codec_config.downsample_rates",
                    "num_blocks": "@codec_config.blocks_per_stage",
                    "kernel_size": "@codec_config.block_kernel_size",
                    "codebook_size": "@codec_config.codebook_size",
                    "num_quantizers": "@codec_config.num_quantizers",
                    "wav_to_token_ratio": "=codec_config.samples_per_frame",
                },
            },
        },
        "inference_speaker_name": "@speaker",
    },
    "trainer": {},
    "_rnnt_merge_info": {
        "decoder_config": {
            "prednet": {k: f"@{_DECODER}.{k}" for k in ("pred_hidden", "pred_rnn_layers")},
            "vocab_size": f"@{_DECODER}.vocab_size",
            "blank_as_pad": f"@{_DECODER}.blank_as_pad",
        },
        "joint_config": {
            "jointnet": {
                k: f"@{_JOINT}.{k}"
                for k in ("joint_hidden", "activation", "encoder_hidden", "pred_hidden")
            },
            "num_classes": f"@{_JOINT}.num_classes",
            "vocabulary": "@rnnt_vocabulary",
        },
        "rnnt_vocab_size": None,  # len(vocabulary)
    },
    "text_config": "@text_config",
}


def nemo_fields(cls, d: Dict[str, Any]) -> Dict[str, Any]:
    """``cls`` (VoiceChatConfig) fields from NVIDIA's NeMo/Hydra config (mlx-audio: plus its
    ``mlx_audio`` section)."""
    f = read_fields(NEMO, d)
    mlx_audio = d.get("mlx_audio") or {}
    text = d.get("text_config") or mlx_audio.get("llm_config") or dict(NEMOTRON_NANO_9B_V2)
    top = _scalars(cls, f)
    top["rnnt_vocabulary"] = list(top.get("rnnt_vocabulary") or [])
    top.update({k: text[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in text})
    return dict(
        text_config=dict(text),
        audio_config=AudioConfig.from_dict(f.get("audio_config")),
        tts_config=TTSConfig.from_dict(f.get("tts_config")),
        codec_config=CodecConfig.from_dict(f.get("codec_config")),
        layout="mlx-audio" if mlx_audio else "nvidia",
        quantization=d.get("quantization") or d.get("quantization_config"),
        model_path=d.get("model_path"),
        **top,
    )


def nemo_config(config) -> Dict[str, Any]:
    """NVIDIA's nested NeMo/Hydra run config for ``config`` (a VoiceChatConfig)."""
    out = write_fields(NEMO, config)
    encoder = out["model"]["stt"]["model"]["perception"]["encoder"]
    encoder["att_context_size"] = [list(config.audio_config.encoder.att_context_size)]
    out["_rnnt_merge_info"]["rnnt_vocab_size"] = len(config.rnnt_vocabulary)
    return out
