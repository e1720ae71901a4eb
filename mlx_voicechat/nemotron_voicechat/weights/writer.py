"""Writing checkpoints in the mlx-community layout, for the factory and the converter: the flat
config (mlx-vlm's key set, plus any field a reader of that set would get wrong) and safetensors
shards streamed tensor by tensor, so writing never holds a whole shard in memory.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn

from ...config import NEMOTRON_NANO_9B_V2, TOP_LEVEL_KEYS, VoiceChatConfig, text_args
from ...config.layouts import GEMMA_KEYS, GEMMA_SIZES
from ...errors import VoiceChatError

MAX_SHARD_BYTES = 5 << 30  # 5 GiB, mlx-lm's and mlx-vlm's shard limit
INDEX_NAME = "model.safetensors.index.json"
SHARD_NAME = "model-{:05d}-of-{:05d}.safetensors"
HEADER_ALIGN = 8  # bytes; safetensors pads its JSON header to this

_ST_DTYPES = {
    mx.bool_: "BOOL",
    mx.uint8: "U8",
    mx.int8: "I8",
    mx.uint16: "U16",
    mx.int16: "I16",
    mx.uint32: "U32",
    mx.int32: "I32",
    mx.uint64: "U64",
    mx.int64: "I64",
    mx.float16: "F16",
    mx.bfloat16: "BF16",
    mx.float32: "F32",
    mx.float64: "F64",
}

# The LLM matrices mlx-community quantizes (besides the embedding and both heads).
_LLM_HEADS = ("stt_model.embed_tokens", "stt_model.lm_head", "stt_model.function_head")
# --quantize-tts: the Gemma-3 backbone and the MoG head. proj_mus stays float: the head reads
# its rows directly to gather only the drawn component.
_TTS_PREFIXES = ("tts_model.tts_model.backbone.", "tts_model.tts_model.mog_head.")
_TTS_FLOAT = ("tts_model.tts_model.mog_head.proj_mus",)


class WriteError(VoiceChatError, OSError):
    """A checkpoint file could not be written (full disk, no permission, ...)."""


# --- quantization map -------------------------------------------------------------------


def quantization_map(
    model: nn.Module,
    bits: Optional[int],
    group_size: int = 64,
    tts_bits: Optional[int] = None,
) -> Dict[str, Any]:
    """The per-module map: ``{group_size, bits, "<module>": {group_size, bits}, ...}``.

    ``bits`` quantizes mlx-community's choice (the LLM's mixer linears, the embedding and both
    heads), ``tts_bits`` the TTS backbone and MoG head; only matrices whose input width is a
    multiple of the group size qualify.
    """
    q: Dict[str, Any] = {"group_size": group_size, "bits": bits or tts_bits}
    for name, m in model.named_modules():
        if not isinstance(m, (nn.Linear, nn.Embedding)) or m.weight.shape[-1] % group_size:
            continue
        chosen = None
        if bits and (
            name in _LLM_HEADS or (name.startswith("stt_model.llm.") and ".mixer." in name)
        ):
            chosen = bits
        elif tts_bits and name.startswith(_TTS_PREFIXES) and name not in _TTS_FLOAT:
            chosen = tts_bits
        if chosen:
            q[name] = {"group_size": group_size, "bits": chosen}
    return dict(sorted(q.items(), key=lambda kv: (isinstance(kv[1], dict), kv[0])))


def listed_modules(quantization: Optional[Mapping[str, Any]]) -> List[str]:
    return sorted(k for k, v in (quantization or {}).items() if isinstance(v, dict))


def quantize_like_mlx_community(model: nn.Module, bits: int, group_size: int, scale: str):
    """Quantize ``model`` (of the named ``scale``) in place as the mlx-community checkpoints are
    (:func:`quantization_map`) and return the map; a VoiceChatError when no matrix qualifies."""
    quant_map = quantization_map(model, bits, group_size)
    quantize_listed(model, listed_modules(quant_map), bits, group_size, f"{scale} model")
    return quant_map


def quantize_listed(model: nn.Module, listed, bits: int, group_size: int, what: str) -> None:
    """Quantize the ``listed`` module paths of ``model`` in place; a VoiceChatError naming
    ``what`` (e.g. "tiny model") when the list is empty."""
    if not listed:
        raise VoiceChatError(
            f"no matrix of the {what} has an input width divisible by group size "
            f"{group_size}; pick a smaller group size"
        )
    listed = set(listed)
    nn.quantize(model, group_size=group_size, bits=bits, class_predicate=lambda p, m: p in listed)


def cast_floats(weights: Mapping[str, mx.array], dtype) -> Dict[str, mx.array]:
    """``weights`` with every floating tensor cast to ``dtype`` (integer buffers kept)."""
    return {
        k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in weights.items()
    }


# --- config -----------------------------------------------------------------------------

# mlx-vlm's text config keys: the real LLM's, head_dim moved after the pattern (the time step
# limit is written last).
_TEXT_KEYS = (*(k for k in NEMOTRON_NANO_9B_V2 if k != "head_dim"), "head_dim")
_TTS_KEYS = (
    *GEMMA_SIZES,
    "sliding_window",
    "latent_size",
    "num_quantizers",
    "codebook_size",
    "num_delay_speech_tokens",
    "exponent",
    "disable_eos_prediction",
    "use_gated_fusion_for_text_audio",
    "use_subword_flag_emb",
    "use_bos_eos_emb",
    "use_audio_prompt_frozen_projection",
    "character_encoder",
    "mog_head",
    "guidance_scale",
    "top_p",
    "noise_scale",
    "audio_prompt_duration",
)
_CHAR_KEYS = ("vocab_size", *GEMMA_KEYS, "attn_logit_softcapping", "rope_parameters")


def _text_config(text: Mapping[str, Any]) -> Dict[str, Any]:
    args = text_args(dict(text))
    base = {
        **text,
        "model_type": "nemotron_h",
        "num_hidden_layers": args.num_hidden_layers,
        "use_bias": args.use_bias,
    }
    out = {k: base[k] for k in _TEXT_KEYS if k in base}
    limit = out.pop("time_step_limit", None)
    # mlx-vlm writes no non-standard JSON (Infinity); an absent limit reads as unbounded.
    if limit is not None and all(math.isfinite(float(x)) for x in limit):
        out["time_step_limit"] = [float(x) for x in limit]
    # Extra keys only where the reduced set would be read differently (e.g. the dt floor).
    want = dataclasses.asdict(text_args(dict(text)))
    for k in sorted(text):
        got = dataclasses.asdict(text_args(out))
        if got == want:
            break
        if k not in out and k != "time_step_limit":
            trial = {**out, k: text[k]}
            if dataclasses.asdict(text_args(trial)) != got:
                out = trial
    return out


def _add_differences(out: Dict[str, Any], want, got) -> None:
    """Write the fields of dataclass ``want`` that reading ``out`` gets wrong (``got``)."""
    for f in dataclasses.fields(want):
        a, b = getattr(want, f.name), getattr(got, f.name)
        if dataclasses.is_dataclass(a):
            _add_differences(out.setdefault(f.name, {}), a, b)
        elif a != b:
            out[f.name] = list(a) if isinstance(a, tuple) else a


def audio_sections(raw: Mapping[str, Any]) -> Dict[str, Dict[str, Any]]:
    """The audio config sections of a source ``config.json`` (flat or NeMo nested) as mlx-vlm
    flattens them, keys this package does not read included (dropout, t_max, ...)."""
    if isinstance(raw.get("audio_config"), dict):
        return {k: dict(v) for k, v in raw["audio_config"].items() if isinstance(v, dict)}
    model = raw.get("model") or {}
    perception = ((model.get("stt") or {}).get("model") or {}).get("perception") or {}
    rnnt = raw.get("_rnnt_merge_info") or {}
    dec, joint = rnnt.get("decoder_config") or {}, rnnt.get("joint_config") or {}
    out = {
        "preprocessor": dict(perception.get("preprocessor") or {}),
        "encoder": dict(perception.get("encoder") or {}),
        "decoder": {
            **(dec.get("prednet") or {}),
            **{k: dec[k] for k in ("vocab_size", "blank_as_pad") if k in dec},
        },
        "joint": {
            **(joint.get("jointnet") or {}),
            **{k: joint[k] for k in ("num_classes",) if k in joint},
        },
    }
    for section in out.values():
        section.pop("_target_", None)
    return out


def flat_config(
    config: VoiceChatConfig,
    quantization: Optional[Mapping[str, Any]] = None,
    source: Optional[Mapping[str, Any]] = None,
) -> Dict[str, Any]:
    """The flat mlx-community ``config.json`` for ``config`` (mlx-vlm's key set); ``source`` is
    the raw config it came from, whose extra audio keys are kept."""
    full = config.to_dict()
    audio = full["audio_config"]
    for name, extra in (audio_sections(source) if source else {}).items():
        if isinstance(audio.get(name), dict):
            audio[name] = {
                **{k: v for k, v in extra.items() if k not in audio[name]},
                **audio[name],
            }
    tts = full["tts_config"]
    char = tts["character_encoder"]
    # Read by neither loader (the char vocabulary comes from the tokenizer); mlx-vlm's key set.
    char["vocab_size"] = char["char_vocab_size"]
    char["rope_parameters"] = {"rope_type": "default", "rope_theta": char["rope_base"]}
    tts["disable_eos_prediction"] = True  # NeMo's inference never predicts a speech eos
    tts["character_encoder"] = {k: char[k] for k in _CHAR_KEYS if k in char}
    d = {
        "model_type": full["model_type"],
        "architectures": full["architectures"],
        "text_config": _text_config(config.text_config),
        "audio_config": {**audio, "max_symbols": config.audio_config.max_symbols},
        "tts_config": {k: tts[k] for k in _TTS_KEYS if k in tts},
        "codec_config": full["codec_config"],
        **{k: full[k] for k in TOP_LEVEL_KEYS},
    }
    back = VoiceChatConfig.from_dict(json.loads(json.dumps(d)))
    for name in ("audio_config", "tts_config", "codec_config"):
        _add_differences(d[name], getattr(config, name), getattr(back, name))
    if quantization:
        d["quantization"] = dict(quantization)
        d["quantization_config"] = dict(quantization)
    return d


# --- files ------------------------------------------------------------------------------


def write_json(path: Path, obj) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")


def write_rnnt_tokenizer(
    folder: Path, vocabulary: Sequence[str], source: Optional[Path] = None
) -> None:
    """``rnnt_tokenizer/``: the source's files when it has them, else ``vocab.json`` (a JSON list,
    index = token id) and NeMo's tokenizer cfg."""
    out = Path(folder) / "rnnt_tokenizer"
    out.mkdir(exist_ok=True)
    if source is not None and (Path(source) / "rnnt_tokenizer").is_dir():
        for f in sorted((Path(source) / "rnnt_tokenizer").iterdir()):
            if f.is_file():
                shutil.copy2(f, out / f.name)
    if not (out / "vocab.json").exists():
        write_json(out / "vocab.json", list(vocabulary))
    if not (out / "tokenizer_config.json").exists():
        write_json(out / "tokenizer_config.json", {"dir": "rnnt_tokenizer", "type": "bpe"})


# --- streamed safetensors shards --------------------------------------------------------
# Not mx.save_safetensors: convert writes each tensor as soon as it is computed, so that peak
# memory stays near the largest tensor, never a whole 5 GiB shard.


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: Any  # an mx.Dtype
    shape: Tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return self.dtype.size * math.prod(self.shape)


def plan_shards(
    specs: Iterable[TensorSpec], max_shard_bytes: int = MAX_SHARD_BYTES
) -> List[List[TensorSpec]]:
    """Specs in name order, packed greedily into shards of at most ``max_shard_bytes`` (a
    tensor larger than the limit gets a shard of its own)."""
    shards: List[List[TensorSpec]] = [[]]
    size = 0
    for spec in sorted(specs, key=lambda s: s.name):
        if shards[-1] and size + spec.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += spec.nbytes
    return shards


def _header(specs: Sequence[TensorSpec], metadata: Mapping[str, str]) -> bytes:
    h: Dict[str, Any] = {"__metadata__": dict(metadata)}
    offset = 0
    for s in specs:
        if s.dtype not in _ST_DTYPES:
            raise WriteError(
                f"tensor '{s.name}' has dtype {s.dtype}, which safetensors cannot store"
            )
        h[s.name] = {
            "dtype": _ST_DTYPES[s.dtype],
            "shape": list(s.shape),
            "data_offsets": [offset, offset + s.nbytes],
        }
        offset += s.nbytes
    raw = json.dumps(h, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % HEADER_ALIGN)
    return len(raw).to_bytes(8, "little") + raw


def write_tensor(f, spec: TensorSpec, array: mx.array) -> None:
    """Append one evaluated tensor's bytes (row-major) to an open shard file."""
    if array.dtype != spec.dtype or tuple(array.shape) != spec.shape:
        raise AssertionError(
            f"{spec.name}: planned {spec.dtype}{list(spec.shape)}, got "
            f"{array.dtype}{list(array.shape)}"
        )
    array = mx.contiguous(array)
    mx.eval(array)
    f.write(memoryview(array))


def write_shards(
    folder: Path,
    specs: Iterable[TensorSpec],
    fetch: Callable[[str], mx.array],
    max_shard_bytes: int = MAX_SHARD_BYTES,
    metadata: Optional[Mapping[str, str]] = None,
    on_tensor: Optional[Callable[[TensorSpec], None]] = None,
) -> Dict[str, str]:
    """Write ``model-0000X-of-0000N.safetensors`` + the index, asking ``fetch(name)`` for one
    tensor at a time; returns the weight map."""
    folder = Path(folder)
    shards = plan_shards(specs, max_shard_bytes)
    n = len(shards)
    weight_map: Dict[str, str] = {}
    total = 0
    for i, shard in enumerate(shards):
        name = SHARD_NAME.format(i + 1, n)
        try:
            with open(folder / name, "wb") as f:
                f.write(_header(shard, metadata or {"format": "mlx"}))
                for spec in shard:
                    write_tensor(f, spec, fetch(spec.name))
                    if on_tensor is not None:
                        on_tensor(spec)
        except OSError as e:
            raise WriteError(f"cannot write {folder / name}: {e.strerror or e}") from None
        for spec in shard:
            weight_map[spec.name] = name
            total += spec.nbytes
    try:
        write_json(
            folder / INDEX_NAME, {"metadata": {"total_size": total}, "weight_map": weight_map}
        )
    except OSError as e:
        raise WriteError(f"cannot write {folder / INDEX_NAME}: {e.strerror or e}") from None
    return weight_map


def save_sharded(
    folder: Path, weights: Mapping[str, mx.array], max_shard_bytes: int = MAX_SHARD_BYTES
) -> Dict[str, str]:
    """In-memory ``weights`` written as shards + index (the factory's path)."""
    specs = [TensorSpec(k, v.dtype, tuple(v.shape)) for k, v in weights.items()]
    return write_shards(folder, specs, weights.__getitem__, max_shard_bytes)


def save_safetensors(path: Path, weights: Mapping[str, mx.array], metadata=None) -> None:
    mx.save_safetensors(str(path), dict(weights), metadata=metadata or {"format": "mlx"})
