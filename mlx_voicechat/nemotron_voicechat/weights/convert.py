"""``mlx-voicechat convert``: any supported checkpoint to the mlx-community layout (NeMo key
names, PyTorch layouts), from NVIDIA's raw release, mlx-community (re-quantized or re-typed;
quantized modules are dequantized first) or mlx-audio (MLX layouts turned back).

Weights stream: each output tensor is computed, written and dropped before the next, so peak
memory stays near the largest tensor; output goes to a temporary folder renamed at the end.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

from ...config import VoiceChatConfig
from ...errors import CheckpointError, VoiceChatError
from ...files import atomic_folder
from ..model import check_shapes
from . import sanitize as rules
from .loading import (
    DTYPE_NAMES,
    TOKENIZER_PATTERNS,
    check_rnnt_vocabulary,
    check_write_options,
    quantization_defaults,
    read_config,
    read_safetensors,
    resolve_path,
    tokenizer_folder,
    weight_files,
)
from .writer import (
    MAX_SHARD_BYTES,
    TensorSpec,
    WriteError,
    flat_config,
    listed_modules,
    quantization_map,
    write_json,
    write_rnnt_tokenizer,
    write_shards,
)

DTYPES = DTYPE_NAMES  # what --dtype takes
# Kept in float32 whatever --dtype says: Mamba's A = -exp(A_log) amplifies rounding (mlx-vlm
# keeps it too), and the log-mel filters and window are tiny buffers the front end is exact on.
KEEP_FLOAT32 = ("A_log", "featurizer.fb", "featurizer.window")
SEED_AUDIO_SECONDS = 1.6  # synthetic input of the --quantize-tts agreement check


class ConversionError(VoiceChatError, ValueError):
    """A source that cannot be converted, or bad conversion options."""


@dataclass
class _Unit:
    """One source tensor, or a quantized module's weight / scales / biases together."""

    keys: Tuple[str, ...]
    module: Optional[str] = None  # set when the source quantized this module
    group_size: int = 64
    bits: int = 4
    mode: str = "affine"


class _Source:
    """The source checkpoint's tensors as lazy handles (``mx.load`` reads a tensor's bytes only
    when it is evaluated)."""

    def __init__(self, folder: Path, config: VoiceChatConfig):
        self.lazy: Dict[str, Dict[str, mx.array]] = {}
        self.where: Dict[str, str] = {}
        for f in weight_files(folder):
            self.lazy[str(f)] = read_safetensors(f)
            self.where.update({k: str(f) for k in self.lazy[str(f)]})
        self.units = self._group(config.quantization or {})

    def _group(self, quantization) -> List[_Unit]:
        quantized = {k[: -len(".scales")] for k in self.where if k.endswith(".scales")}
        if quantized and not quantization:
            raise CheckpointError("the weights are quantized but config.json has no quantization")
        default = quantization_defaults(quantization)
        units, seen = [], set()
        for m in sorted(quantized):
            keys = tuple(
                k for k in (f"{m}.weight", f"{m}.scales", f"{m}.biases") if k in self.where
            )
            own = quantization.get(m)
            q = {**default, **(own if isinstance(own, dict) else {})}
            units.append(_Unit(keys, m, int(q["group_size"]), int(q["bits"]), q["mode"]))
            seen.update(keys)
        units += [_Unit((k,)) for k in sorted(self.where) if k not in seen]
        return units

    def read(self, unit: _Unit, consume: bool = False) -> Dict[str, mx.array]:
        """The unit's tensors, lazily, with a quantized module dequantized to its ``.weight``.
        ``consume`` hands the handles over, so that once evaluated and written nothing here
        keeps their bytes alive."""
        out = {}
        for k in unit.keys:
            files = self.lazy[self.where[k]]
            out[k] = files.pop(k) if consume else files[k]
        if unit.module is None:
            return out
        m = unit.module
        w = mx.dequantize(
            out[f"{m}.weight"],
            out[f"{m}.scales"],
            out.get(f"{m}.biases"),
            group_size=unit.group_size,
            bits=unit.bits,
            mode=unit.mode,
        )
        return {f"{m}.weight": w}


class _Converter:
    def __init__(self, source: _Source, model: nn.Module, dtype, quant: Dict, layout: str):
        self.source, self.dtype, self.layout = source, dtype, layout
        self.shapes = rules.expected_shapes(model)
        self.conv_t = rules.conv_transpose_keys(model)
        self.quant = {k: v for k, v in quant.items() if isinstance(v, dict)}
        self._owner: Dict[str, _Unit] = {}
        self._pending: Dict[str, mx.array] = {}

    def transform(self, unit: _Unit, consume: bool = False) -> Dict[str, mx.array]:
        """Source unit -> output tensors (NeMo names, PyTorch layouts, target dtype)."""
        tensors = self.source.read(unit, consume)
        if self.layout == "mlx-audio":  # MLX layouts and our names back to NeMo's
            tensors = rules.to_torch_layout(
                rules.sanitize(tensors, self.shapes, self.conv_t), self.conv_t
            )
        out = {}
        for k, v in tensors.items():
            if mx.issubdtype(v.dtype, mx.floating) and not any(p in k for p in KEEP_FLOAT32):
                v = v.astype(self.dtype)
            module = k[: -len(".weight")] if k.endswith(".weight") else None
            q = self.quant.get(module)
            if q is not None:
                wq, scales, biases = mx.quantize(v, group_size=q["group_size"], bits=q["bits"])
                out.update({k: wq, f"{module}.scales": scales, f"{module}.biases": biases})
            else:
                out[k] = v
        return out

    def validate(self) -> None:
        """Every model parameter present once with its shape, nothing else: checked on the
        lazy tensors before a byte is written."""
        seen: Dict[str, Tuple[int, ...]] = {}
        for unit in self.source.units:
            for k, v in rules.sanitize(self.source.read(unit), self.shapes, self.conv_t).items():
                seen[k] = tuple(v.shape)
        check_shapes(self.shapes, seen, where="source", error=ConversionError)

    def plan(self) -> List[TensorSpec]:
        specs = []
        for unit in self.source.units:
            for k, v in self.transform(unit).items():
                if k in self._owner:
                    raise ConversionError(f"two source tensors both become '{k}'")
                self._owner[k] = unit
                specs.append(TensorSpec(k, v.dtype, tuple(v.shape)))
        return specs

    def fetch(self, name: str) -> mx.array:
        """The output tensor ``name``; its unit's other outputs wait until they are written."""
        if name not in self._pending:
            self._pending.update(self.transform(self._owner[name], consume=True))
        return self._pending.pop(name)


def _copy_tokenizer(src: Path, dst: Path) -> None:
    for name in TOKENIZER_PATTERNS:
        if (src / name).exists():
            shutil.copy2(src / name, dst / name)
    cfg_path = dst / "tokenizer_config.json"
    if cfg_path.exists():
        with open(cfg_path, encoding="utf-8") as f:
            cfg = json.load(f)
        # As mlx-vlm's converter does: transformers 5 needs it for Nemotron-Nano-9B-v2's
        # pre-tokenizer regex.
        cfg["fix_mistral_regex"] = True
        write_json(cfg_path, cfg)


def convert(
    source,
    output,
    *,
    tokenizer=None,
    dtype: str = "bfloat16",
    quantize: Optional[int] = None,
    group_size: int = 64,
    quantize_tts: Optional[int] = None,
    max_shard_bytes: int = MAX_SHARD_BYTES,
    progress: bool = True,
    revision: Optional[str] = None,
) -> Path:
    """Write ``source`` (folder or hub id, any supported layout) as an mlx-community checkpoint.

    Args:
        tokenizer: folder / hub id with ``tokenizer.json`` when the source has none (NVIDIA).
        dtype: float dtype of the output (quantized modules keep scales in it).
        quantize: 4 or 8 bits for mlx-community's choice of modules (LLM, embedding, heads).
        quantize_tts: 8 to quantize the TTS backbone and MoG head as well.
        max_shard_bytes: largest shard (tests force several shards with a small value).
    """
    check_write_options(quantize, dtype, group_size, ConversionError, flag="--")
    if quantize_tts not in (None, 8):
        raise ConversionError(f"--quantize-tts must be 8, not {quantize_tts!r}")
    from ..model import VoiceChatModel

    folder = resolve_path(source, revision=revision)
    given = output
    output = Path(os.path.abspath(Path(output).expanduser()))
    if output.is_symlink():
        output = Path(os.path.realpath(output))  # the folder it names is written, not the link
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise ConversionError(f"output {given} already exists; remove it or pick another folder")
    if output.resolve() == folder.resolve():
        raise ConversionError("the output folder must differ from the source folder")
    if output.exists() and Path.cwd().resolve().is_relative_to(output.resolve()):
        raise ConversionError(
            f"output {given} is the current folder (or holds it); pick a new folder"
        )
    parent = next((p for p in output.parents if p.exists()), None)
    if parent is None or not os.access(parent, os.W_OK | os.X_OK):
        raise ConversionError(f"cannot write output {given}: no permission to write in {parent}")
    raw = read_config(folder)
    config = VoiceChatConfig.from_dict(raw)
    tok_dir = tokenizer_folder(tokenizer) if tokenizer is not None else folder
    if not (tok_dir / "tokenizer.json").exists():
        hint = (
            "NVIDIA's raw release ships no tokenizer (it is Nemotron-Nano-9B-v2's): pass "
            "--tokenizer nvidia/NVIDIA-Nemotron-Nano-9B-v2 or a folder with tokenizer.json"
            if tokenizer is None
            else "pass a folder or hub id that has tokenizer.json"
        )
        raise ConversionError(f"{tok_dir} has no tokenizer.json; {hint}")
    vocabulary = check_rnnt_vocabulary(config, folder)

    # Parameters stay unevaluated: only shapes and module types are read.
    model = VoiceChatModel(config)
    quant = {}
    if quantize or quantize_tts:
        quant = quantization_map(model, quantize, group_size, quantize_tts)
        if not listed_modules(quant):
            raise ConversionError(
                f"no matrix of this model has an input width divisible by --group-size "
                f"{group_size}; pick a smaller group size"
            )
    src = _Source(folder, config)
    conv = _Converter(src, model, getattr(mx, dtype), quant, config.layout)
    conv.validate()
    specs = conv.plan()
    out_config = flat_config(config, quant or None, source=raw)
    out_config["rnnt_vocabulary"] = vocabulary

    bar = None
    if progress:
        from tqdm import tqdm

        total = sum(s.nbytes for s in specs)
        bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="convert")
    try:
        with atomic_folder(output, replace=output.exists()) as tmp:
            write_shards(
                tmp,
                specs,
                conv.fetch,
                max_shard_bytes,
                on_tensor=(lambda s: bar.update(s.nbytes)) if bar else None,
            )
            try:
                _copy_tokenizer(tok_dir, tmp)
                write_rnnt_tokenizer(tmp, vocabulary, folder)
                write_json(tmp / "config.json", out_config)  # last: it marks a checkpoint
            except OSError as e:
                raise WriteError(f"cannot write to {tmp}: {e.strerror or e}") from None
    finally:
        if bar is not None:
            bar.close()
    return output


# --- --quantize-tts: how much the 8-bit TTS changes the speech codes ------------------------


def tts_agreement(
    output, source, model_class, *, seed: int = 0, seconds: float = SEED_AUDIO_SECONDS
) -> Tuple[float, int]:
    """Fraction of speech codes the converted model (8-bit TTS) shares with the same model whose
    TTS matrices are the source's float weights, on a fixed synthetic input and seed; returns
    (fraction, number of codes compared). ``model_class`` is the class to load (one with
    ``generate``: :class:`mlx_voicechat.Model`)."""
    import numpy as np

    from .loading import load

    quantized = load(output, model_class=model_class)
    reference = load(output, model_class=model_class)
    tts = [k for k in listed_modules(quantized.config.quantization) if k.startswith("tts_model.")]
    folder = resolve_path(source)
    src = _Source(folder, VoiceChatConfig.from_dict(read_config(folder)))
    by_module = {
        u.module or u.keys[0][: -len(".weight")]: u
        for u in src.units
        if u.module or u.keys[0].endswith(".weight")
    }
    modules = dict(reference.named_modules())
    for path in tts:
        old = modules[path]
        w = src.read(by_module[path])[f"{path}.weight"].astype(old.scales.dtype)
        lin = nn.Linear(w.shape[1], w.shape[0], bias="bias" in old)
        lin.weight = w
        if "bias" in old:
            lin.bias = old.bias
        reference.update_modules(tree_unflatten([(path, lin)]))
    rng = np.random.default_rng(seed)
    rate = quantized.config.input_sample_rate
    t = np.arange(int(seconds * rate)) / rate
    wave = (0.3 * np.sin(2 * np.pi * 220 * t) + 0.05 * rng.standard_normal(t.size)).astype(
        np.float32
    )
    a = quantized.generate(wave, system_prompt="", extra_decoding_seconds=0.0, seed=seed)
    b = reference.generate(wave, system_prompt="", extra_decoding_seconds=0.0, seed=seed)
    same = float(np.mean(a.codes == b.codes))
    return same, int(a.codes.size)
