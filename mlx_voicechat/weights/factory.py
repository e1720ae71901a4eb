"""Random-weight VoiceChat checkpoints, in every supported layout, at named scales.

Tests, benchmarks and people trying the pipeline without the 11B weights use these. The scales
are in :mod:`.scales`, the random values in :mod:`.random_init`; this module writes them in
each layout (mlx-community flat, NVIDIA NeMo/Hydra, mlx-audio prepared). A checkpoint is a pure
function of (scale, seed): the same arguments write the same bytes.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, Dict, Optional

import mlx.core as mx
from mlx.utils import tree_flatten

from ..config import VoiceChatConfig
from ..config.asr import is_recognizer_config
from ..errors import VoiceChatError
from ..files import current_umask
from .loading import check_group_size
from .random_init import random_weights
from .sanitize import conv_transpose_keys, to_torch_layout
from .scales import SCALES, build_tokenizer, scale_config, tokenizer_config
from .writer import (
    flat_config,
    quantize_like_mlx_community,
    save_safetensors,
    save_sharded,
    write_json,
    write_rnnt_tokenizer,
)

__all__ = [
    "LAYOUTS",
    "SCALES",
    "build_tokenizer",
    "make_checkpoint",
    "nemo_config",
    "random_weights",
    "scale_config",
]

LAYOUTS = ("mlx-community", "nvidia", "mlx-audio")


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
        quant_map = quantize_like_mlx_community(model, quantize, group_size, scale)
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
            write_json(tmp / "tokenizer_config.json", tokenizer_config())
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
    r"tokenizer(_config)?\.json|special_tokens_map\.json|rnnt_tokenizer|processor_config\.json)$"
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
    if is_recognizer_config(raw):  # a recognizer this package's factory wrote
        return True
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
