"""Random-weight VoiceChat checkpoints, in every supported layout, at named scales.

Tests, benchmarks and people trying the pipeline without the 11B weights use these. The
structural constants are the real model's (128 mels, [70, 0] attention context, conv kernel 9,
31 codebooks, 1764 samples per frame, 8 TTS iterations, ids bos 1 / eos 2 / pad 12 /
silence 11); widths, layer counts, codebook size and vocabulary shrink with the scale.
A checkpoint is a pure function of (scale, seed): the same arguments write the same bytes.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from ..config import NEMOTRON_NANO_9B_V2, VoiceChatConfig
from ..errors import VoiceChatError
from ..files import current_umask
from .loading import check_group_size
from .sanitize import conv_transpose_keys, to_torch_layout
from .writer import (
    flat_config,
    listed_modules,
    quantization_map,
    save_safetensors,
    save_sharded,
    write_json,
    write_rnnt_tokenizer,
)

LAYOUTS = ("mlx-community", "nvidia", "mlx-audio")
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"] + [f"<SPECIAL_{i}>" for i in range(3, 16)]
RNNT_SPECIALS = ["<unk>"]

_CORPUS = (
    "What is the capital of France? The capital of France is Paris. "
    "Hello, how are you today? I am fine, thank you, and you? "
    "Please tell me the weather in Santa Clara this afternoon. "
    "The quick brown fox jumps over the lazy dog while the voice assistant answers. "
    "Turn on the lights in the kitchen and set a timer for ten minutes. "
    "Sure, here is a short answer: speech goes in, speech comes out, every eighty milliseconds. "
)


def _scale_presets() -> Dict[str, Dict[str, Any]]:
    tiny_text = {
        "vocab_size": 400,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "mamba_num_heads": 8,
        "mamba_head_dim": 16,
        "ssm_state_size": 16,
        "n_groups": 2,
        "hybrid_override_pattern": "M-M*-M",
        "max_position_embeddings": 4096,
    }
    medium_pattern = NEMOTRON_NANO_9B_V2["hybrid_override_pattern"]
    return {
        "tiny": {
            "text": tiny_text,
            "encoder": {
                "n_layers": 2,
                "d_model": 48,
                "n_heads": 4,
                "subsampling_conv_channels": 32,
            },
            "rnnt": {"vocab": 40, "pred_hidden": 32, "joint_hidden": 40},
            "tts": {
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_hidden_layers": 6,
                "num_attention_heads": 4,
                "num_key_value_heads": 4,
                "head_dim": 16,
                "sliding_window": 16,
                "query_pre_attn_scalar": 64,
                "latent_size": 32,
                "codebook_size": 64,
            },
            "mog": {"intermediate_size": 128, "low_rank": 8, "num_predictions": 32},
            "codec": {"base_channels": 16, "latent_dim": 32, "codebook_size": 64},
        },
        "small": {
            "text": {
                **tiny_text,
                "vocab_size": 32768,
                "hidden_size": 256,
                "intermediate_size": 512,
                "num_attention_heads": 8,
                "num_key_value_heads": 2,
                "head_dim": 32,
                "mamba_num_heads": 16,
                "mamba_head_dim": 32,
                "ssm_state_size": 32,
                "hybrid_override_pattern": "M-M-M*-M-M-M*-M-",
            },
            "encoder": {
                "n_layers": 6,
                "d_model": 128,
                "n_heads": 4,
                "subsampling_conv_channels": 64,
            },
            "rnnt": {"vocab": 256, "pred_hidden": 128, "joint_hidden": 128},
            "tts": {
                "hidden_size": 128,
                "intermediate_size": 256,
                "num_hidden_layers": 6,
                "num_attention_heads": 4,
                "num_key_value_heads": 4,
                "head_dim": 32,
                "sliding_window": 7500,
                "query_pre_attn_scalar": 256,
                "latent_size": 64,
                "codebook_size": 1024,
            },
            "mog": {"intermediate_size": 256, "low_rank": 16, "num_predictions": 256},
            "codec": {"base_channels": 32, "latent_dim": 64, "codebook_size": 1024},
        },
        "medium": {
            "text": {
                **tiny_text,
                "vocab_size": 131072,
                "hidden_size": 256,
                "intermediate_size": 896,
                "num_attention_heads": 8,
                "num_key_value_heads": 2,
                "head_dim": 32,
                "mamba_num_heads": 8,
                "mamba_head_dim": 64,
                "ssm_state_size": 32,
                "n_groups": 8,
                "hybrid_override_pattern": medium_pattern,
                "max_position_embeddings": 131072,
            },
            "encoder": {
                "n_layers": 24,
                "d_model": 128,
                "n_heads": 8,
                "subsampling_conv_channels": 64,
            },
            "rnnt": {"vocab": 1024, "pred_hidden": 128, "joint_hidden": 128},
            "tts": {
                "hidden_size": 128,
                "intermediate_size": 512,
                "num_hidden_layers": 28,
                "num_attention_heads": 4,
                "num_key_value_heads": 4,
                "head_dim": 32,
                "sliding_window": 7500,
                "query_pre_attn_scalar": 256,
                "latent_size": 128,
                "codebook_size": 1024,
            },
            "mog": {"intermediate_size": 512, "low_rank": 16, "num_predictions": 1024},
            "codec": {"base_channels": 32, "latent_dim": 128, "codebook_size": 1024},
        },
    }


SCALES = ("tiny", "small", "medium", "full")


def scale_config(scale: str = "tiny") -> VoiceChatConfig:
    """The config of a named scale; ``full`` is the real 11B model."""
    if scale == "full":
        return VoiceChatConfig(rnnt_vocabulary=_rnnt_pieces(1024))
    presets = _scale_presets()
    if scale not in presets:
        raise VoiceChatError(f"unknown scale {scale!r}; choose one of {', '.join(SCALES)}")
    p = presets[scale]
    text = {**NEMOTRON_NANO_9B_V2, **p["text"]}
    text.pop("num_hidden_layers", None)
    text["num_hidden_layers"] = len(text["hybrid_override_pattern"])
    enc, rnnt, tts, mog, codec = p["encoder"], p["rnnt"], p["tts"], p["mog"], p["codec"]
    d = {
        "model_type": "nemotron_voicechat",
        "text_config": text,
        "audio_config": {
            "encoder": enc,
            "decoder": {
                "pred_hidden": rnnt["pred_hidden"],
                "pred_rnn_layers": 2,
                "vocab_size": rnnt["vocab"],
            },
            "joint": {
                "encoder_hidden": enc["d_model"],
                "pred_hidden": rnnt["pred_hidden"],
                "joint_hidden": rnnt["joint_hidden"],
                "num_classes": rnnt["vocab"],
            },
            "output_dim": text["hidden_size"],
        },
        "tts_config": {
            **tts,
            "character_encoder": {
                "hidden_size": tts["hidden_size"],
                "intermediate_size": tts["intermediate_size"],
                "num_attention_heads": tts["num_attention_heads"],
                "num_key_value_heads": tts["num_key_value_heads"],
                "head_dim": tts["head_dim"],
                "query_pre_attn_scalar": tts["query_pre_attn_scalar"],
            },
            "mog_head": mog,
        },
        "codec_config": {**codec, "num_quantizers": 31},
        "rnnt_vocabulary": _rnnt_pieces(rnnt["vocab"]),
    }
    return VoiceChatConfig.from_dict(d)


# --- tokenizers -------------------------------------------------------------------------


def build_tokenizer(vocab_size: int):
    """A byte-level BPE (``tokenizers``) with the special tokens at ids 0..15, then exactly
    the 256 single-character byte tokens, then merges learned from a small built-in corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    target = min(vocab_size, len(SPECIAL_TOKENS) + 256 + 1024)
    trainer = trainers.BpeTrainer(
        vocab_size=target,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    return tok


def _tokenizer_config() -> Dict[str, Any]:
    return {
        "backend": "tokenizers",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<SPECIAL_12>",
        "unk_token": "<unk>",
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 1 << 20,
    }


def _rnnt_pieces(n: int) -> List[str]:
    """A SentencePiece-like RNNT vocabulary of n pieces (index 0 = <unk>)."""
    letters = list("abcdefghijklmnopqrstuvwxyz")
    pieces = RNNT_SPECIALS + ["\u2581"] + letters + ["\u2581" + c for c in letters]
    pieces += ["'", ",", ".", "?", "<en-US>"]
    i = 0
    while len(pieces) < n:
        a, b = letters[i % 26], letters[(i // 26) % 26]
        pieces.append(("\u2581" if (i // 676) % 2 else "") + a + b + ("" if i < 1352 else str(i)))
        i += 1
    return pieces[:n]


# --- weights ----------------------------------------------------------------------------


def _is_norm(name: str) -> bool:
    leaf = name.rsplit(".", 2)
    return "norm" in name.rsplit(".", 1)[0].rsplit(".", 1)[-1] or leaf[-2].endswith("norm")


def random_weights(model: nn.Module, config: VoiceChatConfig, tokenizer, seed: int = 0):
    """Deterministic random values for every parameter of ``model`` (MLX layout)."""
    key = mx.random.key(seed)
    params = tree_flatten(model.parameters())
    out: Dict[str, mx.array] = {}
    vocab = config.text_args.vocab_size
    codebook = config.tts_config.codebook_size
    keys = mx.random.split(key, len(params))
    for i, (name, p) in enumerate(sorted(params, key=lambda kv: kv[0])):
        k = keys[i]
        shape = p.shape
        if p.dtype in (mx.int32, mx.int64, mx.uint32):
            out[name] = _int_buffer(name, shape, config, tokenizer, vocab, codebook, k)
            continue
        if name.endswith("featurizer.fb"):
            pre = config.audio_config.preprocessor
            fb = _slaney_mel(pre.sample_rate, pre.n_fft, pre.features)
            out[name] = mx.array(fb[None])
        elif name.endswith("featurizer.window"):
            out[name] = mx.array(np.hanning(shape[0]).astype(np.float32))
        elif name.endswith("A_log"):
            out[name] = mx.log(mx.random.uniform(1.0, 16.0, shape, key=k))
        elif name.endswith("mixer.D"):
            out[name] = mx.ones(shape)
        elif len(shape) <= 1 and (_is_norm(name) or name.endswith((".gate",))):
            out[name] = 1.0 + 0.1 * mx.random.normal(shape, key=k)
        elif len(shape) <= 1:
            out[name] = 0.05 * mx.random.normal(shape, key=k)
        else:
            fan_in = (
                math.prod(shape[1:])
                if "embed" not in name
                and "rvq" not in name
                and "mus_list" not in name
                and "latents" not in name
                else 1
            )
            out[name] = mx.random.normal(shape, key=k) / math.sqrt(fan_in)
        out[name] = out[name].astype(p.dtype)
    return out


def _int_buffer(name, shape, config, tokenizer, vocab, codebook, key):
    if name.endswith("codec_silence_tokens"):
        return mx.random.randint(0, codebook, shape, key=key).astype(mx.int32)
    if name.endswith("control_codes"):
        return mx.array([codebook + 2, codebook + 1, codebook], dtype=mx.int32)
    if name.endswith("bos_eos_emb.special_flags"):
        flags = np.zeros(shape, np.int32)
        flags[config.bos_token_id] = 1
        flags[config.eos_token_id] = 2
        return mx.array(flags)
    if name.endswith("subword_flag_emb.is_continuation"):
        # 1 for pieces that continue a word; 0 for specials, word starts ("Ġ...") and the pad row.
        cont = np.ones(shape, np.int32)
        cont[: len(SPECIAL_TOKENS)] = 0
        cont[-1] = 0
        for piece, i in tokenizer.get_vocab().items():
            if piece.startswith("\u0120") and i < shape[0]:
                cont[i] = 0
        return mx.array(cont)
    if name.endswith("bos_eos_emb.pad_tensor"):
        return mx.array(vocab - 1, dtype=mx.int32).reshape(shape)
    if name.endswith("subword_flag_emb.pad_tensor"):
        return mx.array(vocab, dtype=mx.int32).reshape(shape)
    return mx.zeros(shape, dtype=mx.int32)


def _slaney_mel(sr: int, n_fft: int, n_mels: int) -> np.ndarray:
    """librosa's Slaney-scale, Slaney-normalised mel filters [n_mels, n_fft // 2 + 1]."""

    def hz_to_mel(f):
        f = np.asarray(f, dtype=np.float64)
        mels = f / (200.0 / 3)
        log_t = f >= 1000.0
        return np.where(
            log_t, 15.0 + np.log(np.maximum(f, 1e-10) / 1000.0) / (np.log(6.4) / 27.0), mels
        )

    def mel_to_hz(m):
        m = np.asarray(m, dtype=np.float64)
        f = (200.0 / 3) * m
        log_t = m >= 15.0
        return np.where(log_t, 1000.0 * np.exp((np.log(6.4) / 27.0) * (m - 15.0)), f)

    fft_freqs = np.linspace(0, sr / 2, n_fft // 2 + 1)
    mel_f = mel_to_hz(np.linspace(hz_to_mel(0.0), hz_to_mel(sr / 2), n_mels + 2))
    fdiff = np.diff(mel_f)
    ramps = mel_f[:, None] - fft_freqs[None, :]
    lower = -ramps[:-2] / fdiff[:-1, None]
    upper = ramps[2:] / fdiff[1:, None]
    weights = np.maximum(0, np.minimum(lower, upper))
    weights *= (2.0 / (mel_f[2 : n_mels + 2] - mel_f[:n_mels]))[:, None]
    return weights.astype(np.float32)


# --- layouts ----------------------------------------------------------------------------


def nemo_config(config: VoiceChatConfig) -> Dict[str, Any]:
    """NVIDIA's nested NeMo/Hydra run config for ``config`` (with the text config embedded)."""
    a, t, c = config.audio_config, config.tts_config, config.codec_config
    enc = a.encoder.to_dict()
    enc["att_context_size"] = [list(a.encoder.att_context_size)]
    enc["_target_"] = "nemo.collections.asr.modules.ConformerEncoder"
    backbone = {
        "hidden_size": t.hidden_size,
        "intermediate_size": t.intermediate_size,
        "num_hidden_layers": t.num_hidden_layers,
        "num_attention_heads": t.num_attention_heads,
        "num_key_value_heads": t.num_key_value_heads,
        "head_dim": t.head_dim,
        "rms_norm_eps": t.rms_norm_eps,
        "query_pre_attn_scalar": t.query_pre_attn_scalar,
        "sliding_window": t.sliding_window,
        "sliding_window_pattern": t.sliding_window_pattern,
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": t.rope_global_base_freq},
            "sliding_attention": {"rope_type": "default", "rope_theta": t.rope_local_base_freq},
        },
    }
    ch = t.character_encoder
    cas = {
        "hidden_size": ch.hidden_size,
        "intermediate_size": ch.intermediate_size,
        "num_hidden_layers": ch.num_hidden_layers,
        "num_attention_heads": ch.num_attention_heads,
        "num_key_value_heads": ch.num_key_value_heads,
        "head_dim": ch.head_dim,
        "rms_norm_eps": ch.rms_norm_eps,
        "query_pre_attn_scalar": ch.query_pre_attn_scalar,
        "attn_logit_softcapping": ch.attn_logit_softcapping,
        "rope_parameters": {"rope_type": "default", "rope_theta": ch.rope_base},
    }
    tts_flags = {
        k: getattr(t, k)
        for k in (
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
    }
    pre = {
        "_target_": "nemo.collections.asr.modules.AudioToMelSpectrogramPreprocessor",
        **a.preprocessor.to_dict(),
    }
    vocab = list(config.rnnt_vocabulary)
    return {
        "data": {
            "source_sample_rate": config.input_sample_rate,
            "target_sample_rate": config.output_sample_rate,
            "frame_length": config.frame_duration,
        },
        "exp_manager": {},
        "model": {
            "stt": {
                "model": {
                    "pretrained_llm": "nvidia/NVIDIA-Nemotron-Nano-9B-v2",
                    "perception": {"preprocessor": pre, "encoder": enc, "output_dim": a.output_dim},
                    "use_function_head": True,
                    "duplex_function_channel_weight": config.function_channel_weight,
                }
            },
            "speech_generation": {
                "data": {
                    "target_sample_rate": config.output_sample_rate,
                    "source_sample_rate": config.input_sample_rate,
                    "frame_length": config.frame_duration,
                    "audio_prompt_duration": t.audio_prompt_duration,
                },
                "model": {
                    "inference_guidance_scale": t.guidance_scale,
                    "inference_top_p_or_k": t.top_p,
                    "inference_noise_scale": t.noise_scale,
                    "tts_config": {
                        "backbone_type": "gemma3_text",
                        "backbone_config": backbone,
                        **tts_flags,
                        "cas_config": {
                            "backbone_type": "t5gemma",
                            "backbone_config": {"encoder": cas},
                        },
                        "mog_head_config": t.mog_head.to_dict(),
                    },
                    "codec_config": {
                        "latent_size": c.latent_dim,
                        "n_fft": c.n_fft,
                        "hop_length": c.hop_length,
                        "base_hidden_size": c.base_channels,
                        "channel_mult": list(c.channel_multipliers),
                        "rates": list(c.downsample_rates),
                        "num_blocks": c.blocks_per_stage,
                        "kernel_size": c.block_kernel_size,
                        "codebook_size": c.codebook_size,
                        "num_quantizers": c.num_quantizers,
                        "wav_to_token_ratio": c.samples_per_frame,
                    },
                },
            },
            "inference_speaker_name": config.speaker,
        },
        "trainer": {},
        "_rnnt_merge_info": {
            "decoder_config": {
                "prednet": {
                    "pred_hidden": a.decoder.pred_hidden,
                    "pred_rnn_layers": a.decoder.pred_rnn_layers,
                },
                "vocab_size": a.decoder.vocab_size,
                "blank_as_pad": a.decoder.blank_as_pad,
            },
            "joint_config": {
                "jointnet": {
                    "joint_hidden": a.joint.joint_hidden,
                    "activation": a.joint.activation,
                    "encoder_hidden": a.joint.encoder_hidden,
                    "pred_hidden": a.joint.pred_hidden,
                },
                "num_classes": a.joint.num_classes,
                "vocabulary": vocab,
            },
            "rnnt_vocab_size": len(vocab),
        },
        "text_config": {k: v for k, v in config.text_config.items()},
    }


def make_checkpoint(
    out_dir,
    scale: str = "tiny",
    layout: str = "mlx-community",
    *,
    quantize: Optional[int] = None,
    group_size: int = 64,
    seed: int = 0,
    dtype: str = "float32",
    with_tokenizer: bool = True,
    max_shard_bytes: int = 5 << 30,
    force: bool = False,
) -> Path:
    """Write a random-weight checkpoint and return its folder.

    Args:
        out_dir: a new or empty folder (a symlink is followed to the folder it names).
        scale: ``tiny`` (tests), ``small`` / ``medium`` (benchmarks) or ``full`` (11B dims).
        layout: ``mlx-community``, ``nvidia`` (raw release) or ``mlx-audio``.
        quantize: 4 or 8 to quantize like the mlx-community checkpoints (not for ``nvidia``).
        group_size: 32, 64 or 128 (with ``quantize``).
        with_tokenizer: write ``tokenizer.json`` (NVIDIA's real release has none).
        force: replace an existing checkpoint folder, only one that holds nothing but what
            this function writes (a VoiceChat ``config.json``, weights, tokenizer files).
    """
    from ..model import VoiceChatModel

    if layout not in LAYOUTS:
        raise VoiceChatError(f"unknown layout {layout!r}; choose one of {', '.join(LAYOUTS)}")
    if quantize not in (None, 4, 8):
        raise VoiceChatError(f"quantize must be 4 or 8, not {quantize!r}")
    if quantize and layout == "nvidia":
        raise VoiceChatError("NVIDIA's raw layout is float32 only; quantize another layout")
    if dtype not in ("float32", "bfloat16", "float16"):
        raise VoiceChatError(f"unsupported dtype {dtype!r}")
    if quantize:
        check_group_size(group_size, "group size", VoiceChatError)
    out_dir, replace = _check_target(out_dir, force)
    config = scale_config(scale)
    tokenizer = build_tokenizer(config.text_args.vocab_size)
    model = VoiceChatModel(config)
    weights = random_weights(model, config, tokenizer, seed)
    if dtype != "float32" or layout == "nvidia":
        target = mx.float32 if layout == "nvidia" else getattr(mx, dtype)
        weights = {
            k: v.astype(target) if mx.issubdtype(v.dtype, mx.floating) else v
            for k, v in weights.items()
        }
    quant_map = None
    if quantize:
        model.load_weights(list(weights.items()), strict=True)
        quant_map = quantization_map(model, quantize, group_size)
        listed = set(listed_modules(quant_map))
        if not listed:
            raise VoiceChatError(
                f"no matrix of the {scale} model has an input width divisible by group size "
                f"{group_size}; pick a smaller group size"
            )
        nn.quantize(
            model, group_size=group_size, bits=quantize, class_predicate=lambda p, m: p in listed
        )
        weights = dict(tree_flatten(model.parameters()))

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # Written beside the target and renamed at the end: an interrupted run leaves no checkpoint.
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        tmp.chmod(0o777 & ~current_umask())  # mkdtemp's 0700 would follow through the rename
        if layout in ("mlx-community", "nvidia"):
            # NeMo key names and PyTorch layouts, with the training-only prompt projection that
            # the release carries (mlx-vlm's loader requires it, ours drops it).
            torch_w = to_torch_layout(weights, conv_transpose_keys(model))
            h = config.tts_config.hidden_size
            projection = mx.random.normal((h, h), key=mx.random.key(seed + 1))
            torch_w["tts_model.tts_model.audio_prompt_projection_W"] = projection.astype(
                weights["tts_model.tts_model.bos_emb"].dtype
            )
        if layout == "mlx-community":
            write_json(tmp / "config.json", flat_config(config, quant_map))
            save_sharded(tmp, torch_w, max_shard_bytes)
        elif layout == "nvidia":
            write_json(tmp / "config.json", nemo_config(config))
            save_safetensors(tmp / "model.safetensors", torch_w, {"format": "pt"})
        else:
            nested = nemo_config(config)
            nested["model_type"] = "nemotron_voicechat"
            nested["mlx_audio"] = {"llm_config": dict(config.text_config), "prepared_weights": True}
            if quant_map:
                nested["quantization"] = {
                    "group_size": group_size,
                    "bits": quantize,
                    "mode": "affine",
                }
            write_json(tmp / "config.json", nested)
            save_safetensors(tmp / "model.safetensors", weights)
        if with_tokenizer:
            tokenizer.save(str(tmp / "tokenizer.json"))
            write_json(tmp / "tokenizer_config.json", _tokenizer_config())
        if layout != "mlx-audio":
            write_rnnt_tokenizer(tmp, config.rnnt_vocabulary)
        _move_into_place(tmp, out_dir, replace)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


# What make_checkpoint writes into a folder; --force replaces only a folder holding nothing else.
_OWN_ENTRIES = re.compile(
    r"^(config\.json|model(-\d+-of-\d+)?\.safetensors|model\.safetensors\.index\.json|"
    r"tokenizer(_config)?\.json|special_tokens_map\.json|rnnt_tokenizer)$"
)


def _is_own_checkpoint(folder: Path) -> bool:
    """A folder this factory (or a converter) wrote: a VoiceChat config.json and nothing but
    checkpoint files beside it."""
    if not all(_OWN_ENTRIES.match(p.name) for p in folder.iterdir()):
        return False
    try:
        with open(folder / "config.json", encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, ValueError):
        return False
    if not isinstance(raw, dict):
        return False
    model = raw.get("model")
    nemo = isinstance(model, dict) and "stt" in model and "speech_generation" in model
    return raw.get("model_type") == "nemotron_voicechat" or ("model_type" not in raw and nemo)


def _check_target(out_dir, force: bool):
    """The folder to write (symlink followed) and whether an existing checkpoint is replaced;
    anything else that exists there is refused before any work."""
    given = out_dir
    out_dir = Path(os.path.abspath(Path(out_dir).expanduser()))
    if out_dir.is_symlink():
        out_dir = Path(os.path.realpath(out_dir))
    if not out_dir.exists():
        parent = next((p for p in out_dir.parents if p.exists()), None)
        if parent is None or not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
            raise VoiceChatError(f"cannot write {given}: no permission to write in {parent}")
        return out_dir, False
    if not out_dir.is_dir():
        raise VoiceChatError(f"{given} exists and is not a folder; pick a new folder")
    if not os.access(out_dir.parent, os.W_OK | os.X_OK):
        raise VoiceChatError(f"cannot write {given}: no permission to write in {out_dir.parent}")
    if not any(out_dir.iterdir()):
        return out_dir, True
    if Path.cwd().resolve().is_relative_to(out_dir.resolve()):
        raise VoiceChatError(f"{given} is the current folder (or holds it); pick a new folder")
    if not force:
        raise VoiceChatError(
            f"{given} already exists and is not empty; pick a new folder (--force replaces "
            "only a checkpoint folder this command wrote)"
        )
    if not _is_own_checkpoint(out_dir):
        raise VoiceChatError(
            f"{given} is not a checkpoint folder this command wrote (it holds other files, or "
            "no VoiceChat config.json); refusing to replace it, even with --force"
        )
    return out_dir, True


def _move_into_place(tmp: Path, out_dir: Path, replace: bool) -> None:
    """Rename the finished ``tmp`` to ``out_dir``; an old folder there is moved aside first
    and removed only once the new one is in place."""
    if not replace:
        tmp.rename(out_dir)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
    old.rmdir()
    out_dir.rename(old)
    try:
        tmp.rename(out_dir)
    except BaseException:
        old.rename(out_dir)
        raise
    shutil.rmtree(old, ignore_errors=True)
