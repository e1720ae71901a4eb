"""Loading a VoiceChat checkpoint in any supported layout (mlx-community, NVIDIA's raw release,
mlx-audio prepared), detected from what is on disk (``VoiceChatConfig.from_dict``). Loading is
strict and never touches the network for a local path.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

import mlx.core as mx
import mlx.nn as nn

from ...config import VoiceChatConfig
from ...errors import CheckpointError
from ...fastpaths.layout import use_cpu_layout
from ...files import read_json
from .sanitize import sanitize_module

WEIGHT_PATTERNS = ["*.json", "*.safetensors", "rnnt_tokenizer/*", "tokenizer*"]
TOKENIZER_PATTERNS = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


# --- where the files are --------------------------------------------------------------------


def resolve_path(
    path_or_id: Union[str, Path],
    revision: Optional[str] = None,
    patterns=WEIGHT_PATTERNS,
    what: str = "checkpoint folder",
) -> Path:
    """A local folder as it is; a hub id through ``huggingface_hub.snapshot_download``
    (only the files matching ``patterns``). ``what`` names the folder in errors."""
    path = Path(path_or_id).expanduser()
    if path.exists():
        if not path.is_dir():
            raise CheckpointError(f"{path} is a file; a checkpoint is a folder with config.json")
        return path
    text = str(path_or_id)
    if not _HUB_ID.match(text) or text.startswith((".", "/", "~")):
        raise CheckpointError(f"{what} {text} does not exist")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(text, revision=revision, allow_patterns=list(patterns)))
    except Exception as e:  # offline, unknown repo, gated repo: all one message
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(
            f"{text} is not a local folder and could not be downloaded from the Hugging Face "
            f"hub ({reason}); check the id and your network, or pass a local path"
        ) from None


def read_config(folder: Path) -> Dict[str, Any]:
    path = folder / "config.json"
    if not path.exists():
        raise CheckpointError(
            f"{folder} has no config.json: it is not a VoiceChat or Nemotron-3.5-ASR checkpoint "
            "folder"
        )
    raw = read_json(path, CheckpointError)
    if not isinstance(raw, dict):
        raise CheckpointError(
            f"{path} holds a JSON {type(raw).__name__}; a checkpoint config is a JSON object"
        )
    return raw


def weight_files(folder: Path) -> List[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        raw = read_json(index, CheckpointError)
        weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
        names = list(weight_map.values()) if isinstance(weight_map, dict) else []
        plain = all(isinstance(n, str) and n != ".." and Path(n).name == n for n in names)
        if not names or not plain:  # a plain file name in the folder, never a path out of it
            raise CheckpointError(
                f'{index} is not a valid safetensors index: it needs a non-empty "weight_map" '
                "object from tensor names to weight file names in its folder"
            )
        files = [folder / n for n in sorted(set(names))]
        for f in files:
            if not f.exists():
                raise CheckpointError(f"{index} lists {f.name}, which is missing from {folder}")
        return files
    files = sorted(folder.glob("model*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder} has no model*.safetensors weight files")
    return files


def read_safetensors(path: Path) -> Dict[str, mx.array]:
    """One weight file's tensors, lazily (``mx.load`` reads a tensor when it is evaluated)."""
    try:
        return mx.load(str(path))
    except Exception as e:
        raise CheckpointError(
            f"{path} is not a readable safetensors file (corrupt or truncated?): {e}"
        ) from None


def read_weights(files: List[Path]) -> Dict[str, mx.array]:
    return {k: v for f in files for k, v in read_safetensors(f).items()}


# --- quantization -----------------------------------------------------------------------

GROUP_SIZES = (32, 64, 128)  # what MLX's affine quantization supports
QUANTIZE_BITS = (2, 3, 4, 5, 6, 8)
DTYPE_NAMES = ("bfloat16", "float16", "float32")  # what the writers take
_QUANTIZATION_DEFAULTS = {"group_size": 64, "bits": 4, "mode": "affine"}


def quantization_defaults(quantization: Dict[str, Any]) -> Dict[str, Any]:
    """A quantization map's global entries, with mlx-lm's defaults for the missing ones."""
    return {k: quantization.get(k, d) for k, d in _QUANTIZATION_DEFAULTS.items()}


def check_group_size(group_size, what: str = "group size", error: type = CheckpointError) -> int:
    """``group_size`` if MLX can quantize with it, else one clear ``error``."""
    if isinstance(group_size, bool) or group_size not in GROUP_SIZES:
        raise error(f"{what} must be 32, 64 or 128, not {group_size!r}")
    return int(group_size)


def check_write_options(quantize, dtype, group_size, error: type, flag: str = "") -> None:
    """One clear ``error`` for a ``quantize`` other than 4 or 8, a ``dtype`` other than
    :data:`DTYPE_NAMES` or (when quantizing, or always for the CLI's ``flag`` ``--``) a group
    size MLX cannot use."""
    if quantize not in (None, 4, 8):
        raise error(f"{flag}quantize must be 4 or 8, not {quantize!r}")
    if dtype not in DTYPE_NAMES:
        raise error(f"unsupported dtype {dtype!r}; choose one of {', '.join(DTYPE_NAMES)}")
    if quantize or flag:
        check_group_size(group_size, "--group-size" if flag else "group size", error)


def quantize_model(model: nn.Module, quantization: Optional[Dict[str, Any]], weights) -> List[str]:
    """Quantize what the checkpoint quantized; returns the quantized module paths.

    A per-module map (mlx-community) names every quantized module and is followed exactly; a
    global-only entry (mlx-audio) quantizes the modules whose ``.scales`` are in the weights.
    """
    if not quantization:
        if any(k.endswith(".scales") for k in weights):
            raise CheckpointError("the weights are quantized but config.json has no quantization")
        return []
    if not isinstance(quantization, dict):
        raise CheckpointError(
            f"config.json quantization must be a JSON object, not {quantization!r}"
        )
    per_module = {k: v for k, v in quantization.items() if isinstance(v, dict)}
    default = quantization_defaults(quantization)
    for where, q in [("", default)] + [(f" for '{k}'", v) for k, v in per_module.items()]:
        q = {**default, **q}
        if q["mode"] == "affine":
            check_group_size(q["group_size"], f"config.json quantization group_size{where}")
            if q["bits"] not in QUANTIZE_BITS:
                raise CheckpointError(
                    f"config.json quantization bits{where} must be one of "
                    f"{', '.join(map(str, QUANTIZE_BITS))}, not {q['bits']!r}"
                )
    chosen: List[str] = []

    def predicate(path, module):
        if per_module:
            q = per_module.get(path)
        else:
            q = {} if f"{path}.scales" in weights else None
        if q is None or not hasattr(module, "to_quantized"):
            return False
        chosen.append(path)
        return {**default, **q}

    try:
        nn.quantize(
            model,
            group_size=default["group_size"],
            bits=default["bits"],
            mode=default["mode"],
            class_predicate=predicate,
        )
    except ValueError as e:
        raise CheckpointError(f"config.json quantization cannot be applied: {e}") from None
    missing = sorted(set(per_module) - set(chosen))
    if missing:
        raise CheckpointError(
            f"the quantization map names '{missing[0]}', which is not a quantizable module of "
            "this model"
        )
    stray = sorted(k[: -len(".scales")] for k in weights if k.endswith(".scales"))
    stray = [k for k in stray if k not in chosen]
    if stray:
        raise CheckpointError(
            f"tensor '{stray[0]}.scales' is quantized in the checkpoint but '{stray[0]}' is not "
            "in the config's quantization map"
        )
    return chosen


# --- tokenizer and vocabularies ---------------------------------------------------------


def tokenizer_folder(source: Union[str, Path]) -> Path:
    """A local folder as it is (a file: its folder); a hub id fetched for its tokenizer files
    only (the LLM repo also holds 18 GB of weights)."""
    folder = Path(source).expanduser()
    if not folder.exists():
        folder = resolve_path(str(source), patterns=TOKENIZER_PATTERNS, what="tokenizer folder")
    return folder.parent if folder.is_file() else folder


def load_tokenizer(source: Union[str, Path, Any]):
    """A ``transformers`` tokenizer from a folder with ``tokenizer.json`` (or a hub id)."""
    if source is None:
        return None
    if not isinstance(source, (str, Path)):
        return source  # already a tokenizer object
    folder = tokenizer_folder(source)
    if not (folder / "tokenizer.json").exists():
        raise CheckpointError(f"{folder} has no tokenizer.json")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from transformers import PreTrainedTokenizerFast

    # Built from the files directly: AutoTokenizer would read config.json, which describes
    # the speech model rather than a tokenizer.
    cfg_path = folder / "tokenizer_config.json"
    cfg = read_json(cfg_path, CheckpointError) if cfg_path.exists() else {}
    special = ("bos_token", "eos_token", "pad_token", "unk_token")
    kwargs = {k: cfg[k] for k in special if isinstance(cfg.get(k), str)}
    try:
        return PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), **kwargs)
    except Exception as e:
        raise CheckpointError(f"{folder / 'tokenizer.json'} cannot be read: {e}") from None


def check_rnnt_vocabulary(config: VoiceChatConfig, folder: Path) -> List[str]:
    """The RNNT pieces, one per joint class but the blank; a missing or short vocabulary
    would make every transcript empty, so it is an error here."""
    try:
        vocabulary = config.load_rnnt_vocabulary(folder)
    except (OSError, ValueError) as e:
        raise CheckpointError(
            f"{Path(folder) / 'rnnt_tokenizer' / 'vocab.json'} cannot be read: {e}"
        ) from None
    classes = config.audio_config.joint.num_classes
    if not vocabulary:
        raise CheckpointError(
            f"{folder} has no RNNT vocabulary (config.json rnnt_vocabulary, "
            "_rnnt_merge_info.joint_config.vocabulary or rnnt_tokenizer/vocab.json); the "
            f"transcript head needs its {classes} pieces"
        )
    if not all(isinstance(p, str) for p in vocabulary):
        raise CheckpointError(f"the RNNT vocabulary of {folder} must be a list of strings")
    if len(vocabulary) < classes:
        raise CheckpointError(
            f"the RNNT vocabulary of {folder} has {len(vocabulary)} pieces but the transcript "
            f"head has {classes} classes (plus the blank); the vocabulary does not belong to "
            "this checkpoint"
        )
    return vocabulary


def attach_assets(model, folder: Path, tokenizer=None) -> None:
    """Give a loaded model its tokenizer, RNNT vocabulary and per-token tables."""
    config: VoiceChatConfig = model.config
    if tokenizer is None:
        if not (folder / "tokenizer.json").exists():
            hint = (
                "NVIDIA's raw release ships no tokenizer (it is Nemotron-Nano-9B-v2's): pass "
                "tokenizer=<folder or hub id> (CLI: --tokenizer) or copy tokenizer.json into "
                if config.layout == "nvidia"
                else "copy the model's tokenizer.json into "
            )
            raise CheckpointError(f"{folder} has no tokenizer.json; {hint}{folder}")
        tokenizer = folder
    model.tokenizer = load_tokenizer(tokenizer)
    model.rnnt_vocabulary = check_rnnt_vocabulary(config, folder)
    setup = getattr(model, "setup_tokenizer", None)
    if setup is not None:
        setup(model.tokenizer)


# --- the loader -------------------------------------------------------------------------


def load(
    path_or_hub_id: Union[str, Path],
    *,
    tokenizer=None,
    lazy: bool = False,
    revision: Optional[str] = None,
    model_class: Optional[type] = None,
):
    """Load a VoiceChat checkpoint from a local folder or a Hugging Face hub id.

    Args:
        path_or_hub_id: checkpoint folder (any supported layout) or hub repo id.
        tokenizer: a folder / hub id with ``tokenizer.json`` or a tokenizer object; needed for
            NVIDIA's raw release, which ships none.
        lazy: leave the weights unevaluated (they load on first use).
        model_class: the class to build (default: the parameter tree, ``VoiceChatModel``;
            :func:`mlx_voicechat.load` passes the user-facing ``Model``).
    """
    if model_class is None:
        from ..model import VoiceChatModel as model_class

    folder = resolve_path(path_or_hub_id, revision=revision)
    raw = read_config(folder)
    raw["model_path"] = str(folder)
    config = VoiceChatConfig.from_dict(raw)
    files = weight_files(folder)
    model = model_class(config)
    weights = sanitize_module(model, read_weights(files))
    quantize_model(model, config.quantization, weights)
    model.load_weights(list(weights.items()), strict=True)
    del weights
    model.eval()
    if not lazy:
        mx.eval(model.parameters())
        use_cpu_layout(model)  # once, at load (a lazy model keeps the checkpoint's layout)
    attach_assets(model, folder, tokenizer)
    return model
