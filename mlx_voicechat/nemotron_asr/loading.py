"""Loading Nemotron-3.5-ASR from mlx-audio's or NVIDIA's Transformers layout (detected from
``config.json``), strictly: a missing, unexpected or misshaped tensor is one error naming it.
Float32, half precision or quantized weights; nothing is fetched for a local folder.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Dict, Mapping, Optional

import mlx.core as mx
from mlx.utils import tree_flatten

from ..errors import CheckpointError
from ..fastpaths.layout import use_cpu_layout
from ..files import read_json
from ..nemotron_voicechat.model import check_shapes
from ..nemotron_voicechat.weights.loading import quantize_model, read_weights, weight_files
from ..nemotron_voicechat.weights.sanitize import expected_shapes
from .config import ASRConfig, is_recognizer_config
from .layout import sanitize_recognizer

__all__ = ["is_recognizer_config", "load_recognizer", "read_recognizer_config"]


def read_recognizer_config(folder: Path, raw: Mapping[str, Any]) -> ASRConfig:
    """The config of a recognizer folder whose ``config.json`` is ``raw``."""
    raw = dict(raw)
    raw.setdefault("model_path", str(folder))
    if raw.get("model_type") == "nemotron_asr":
        return ASRConfig.from_dict(raw)
    tok_path = folder / "tokenizer.json"
    if not tok_path.exists():
        raise CheckpointError(
            f"{folder} has no tokenizer.json; the Transformers layout keeps the recognizer's "
            "vocabulary there"
        )
    tokenizer = read_json(tok_path, CheckpointError)
    proc_path = folder / "processor_config.json"
    processor = read_json(proc_path, CheckpointError) if proc_path.exists() else {}
    if not isinstance(processor, dict):
        raise CheckpointError(f"{proc_path} must hold a JSON object")
    return ASRConfig.from_dict(raw, tokenizer=tokenizer, processor=processor)


_BIAS_GROUPS = {
    "attention": re.compile(
        r"^encoder\.layers\.\d+\.(self_attn\.linear_\w+|feed_forward\d\.linear\d)\.bias$"
    ),
    "convolution": re.compile(r"^encoder\.layers\.\d+\.conv\.\w+_conv\d?\.bias$"),
}


def zero_biases(model, config: ASRConfig, weights: Mapping[str, mx.array]) -> Dict[str, mx.array]:
    """Zeros for the encoder biases of the groups ``config.zero_biases`` names that
    ``weights`` does not hold: Transformers builds that group without a bias, and a zero bias
    is the same function (the network has one bias switch for both groups)."""
    out = {}
    for group in config.zero_biases:
        pattern = _BIAS_GROUPS[group]
        for k, v in tree_flatten(model.parameters()):
            if pattern.match(k) and k not in weights:
                out[k] = mx.zeros(v.shape, v.dtype)
    return out


def load_recognizer(
    folder: Path,
    raw: Optional[Dict[str, Any]] = None,
    *,
    lazy: bool = False,
    model_class: Optional[type] = None,
):
    """The recognizer in ``folder`` (a local checkpoint folder of either layout), built as
    ``model_class`` (default: the parameter tree, ``nemotron_asr.network.RecognizerNetwork``;
    :func:`mlx_voicechat.load` passes the user-facing ``Recognizer``)."""
    if model_class is None:
        from .network import RecognizerNetwork as model_class
    folder = Path(folder)
    if raw is None:
        from ..nemotron_voicechat.weights.loading import read_config

        raw = read_config(folder)
    if not is_recognizer_config(raw):
        raise CheckpointError(f"{folder}/config.json does not describe a Nemotron-3.5-ASR model")
    config = read_recognizer_config(folder, raw)
    model = model_class(config)
    weights = sanitize_recognizer(model, read_weights(weight_files(folder)))
    weights.update(zero_biases(model, config, weights))
    quantize_model(model, config.quantization, weights)
    found = {k: tuple(weights[k].shape) for k in sorted(weights)}
    check_shapes(expected_shapes(model), found, folder, model="a Nemotron-3.5-ASR recognizer")
    model.load_weights(list(weights.items()), strict=True)
    del weights
    model.eval()
    if not lazy:
        mx.eval(model.parameters())
        use_cpu_layout(model)
    return model
