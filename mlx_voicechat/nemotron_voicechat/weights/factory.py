"""Random-weight VoiceChat checkpoints in every supported layout at named scales (:mod:`.scales`),
for tests, benchmarks and trying the pipeline without the 11B weights. A checkpoint is a pure
function of (scale, seed): the same arguments write the same bytes.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Optional

import mlx.core as mx
from mlx.utils import tree_flatten

from ...config.layouts import nemo_config
from ...config.sections import is_recognizer_config
from ...errors import VoiceChatError
from ...files import atomic_folder, read_json
from .loading import check_write_options
from .random_init import random_weights
from .sanitize import conv_transpose_keys, to_torch_layout
from .scales import SCALES, build_tokenizer, scale_config, tokenizer_config
from .writer import (
    cast_floats,
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
    if quantize and layout == "nvidia":
        raise VoiceChatError("NVIDIA's raw layout is float32 only; quantize another layout")
    check_write_options(quantize, dtype, group_size, VoiceChatError)
    out_dir, replace = check_target(out_dir, force)
    config = scale_config(scale)
    tokenizer = build_tokenizer(config.text_args.vocab_size)
    model = VoiceChatModel(config)
    weights = random_weights(model, config, tokenizer, seed)
    weights = cast_floats(weights, mx.float32 if layout == "nvidia" else getattr(mx, dtype))
    quant_map = None
    if quantize:
        model.load_weights(list(weights.items()), strict=True)
        quant_map = quantize_like_mlx_community(model, quantize, group_size, scale)
        weights = dict(tree_flatten(model.parameters()))

    # Written beside the target and renamed at the end: an interrupted run leaves no checkpoint.
    with atomic_folder(out_dir, replace) as tmp:
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
        raw = read_json(folder / "config.json", ValueError)
    except ValueError:  # unreadable or not JSON
        return False
    if not isinstance(raw, dict):
        return False
    model = raw.get("model")
    nemo = isinstance(model, dict) and "stt" in model and "speech_generation" in model
    if is_recognizer_config(raw):  # a recognizer this package's factory wrote
        return True
    return raw.get("model_type") == "nemotron_voicechat" or ("model_type" not in raw and nemo)


def check_target(out_dir, force: bool):
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
