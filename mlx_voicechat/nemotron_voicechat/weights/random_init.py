"""Deterministic random values for every parameter of a VoiceChat model (MLX layout): the
same (config, seed) gives the same arrays."""

from __future__ import annotations

import math
from typing import Dict

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from ...audio.mel import slaney_mel_filters
from ...config import VoiceChatConfig
from .scales import SPECIAL_TOKENS

_TABLES = ("embed", "rvq", "mus_list", "latents")  # drawn at unit scale


def is_norm(name: str) -> bool:
    """Whether parameter ``name`` belongs to a module whose own name holds "norm"."""
    parts = name.rsplit(".", 2)
    return len(parts) > 1 and "norm" in parts[-2]


def keyed_parameters(model: nn.Module, seed: int):
    """``((name, parameter), key)`` for every parameter of ``model`` in name order, each key
    split from ``seed``."""
    params = sorted(tree_flatten(model.parameters()), key=lambda kv: kv[0])
    return zip(params, mx.random.split(mx.random.key(seed), len(params)))


def random_value(name, shape, key, *, around_one=False, small=False, tables=("embed",)):
    """One parameter's draw: 1 + 0.1 N for a scale vector (``around_one``), 0.05 N for other
    vectors and for ``small`` tensors, else N / sqrt(fan-in), the fan-in 1 for a name holding
    one of ``tables`` (drawn at unit scale)."""
    if len(shape) <= 1 and around_one:
        return 1.0 + 0.1 * mx.random.normal(shape, key=key)
    if len(shape) <= 1 or small:
        return 0.05 * mx.random.normal(shape, key=key)
    fan_in = 1 if any(t in name for t in tables) else math.prod(shape[1:])
    return mx.random.normal(shape, key=key) / math.sqrt(fan_in)


def random_weights(model: nn.Module, config: VoiceChatConfig, tokenizer, seed: int = 0):
    """Deterministic random values for every parameter of ``model`` (MLX layout)."""
    out: Dict[str, mx.array] = {}
    vocab = config.text_args.vocab_size
    codebook = config.tts_config.codebook_size
    for (name, p), k in keyed_parameters(model, seed):
        shape = p.shape
        if p.dtype in (mx.int32, mx.int64, mx.uint32):
            out[name] = _int_buffer(name, shape, config, tokenizer, vocab, codebook, k)
            continue
        if name.endswith("featurizer.fb"):
            pre = config.audio_config.preprocessor
            fb = slaney_mel_filters(pre.sample_rate, pre.n_fft, pre.features)
            out[name] = mx.array(fb.T[None])
        elif name.endswith("featurizer.window"):
            out[name] = mx.array(np.hanning(shape[0]).astype(np.float32))
        elif name.endswith("A_log"):
            out[name] = mx.log(mx.random.uniform(1.0, 16.0, shape, key=k))
        elif name.endswith("mixer.D"):
            out[name] = mx.ones(shape)
        else:
            around_one = is_norm(name) or name.endswith(".gate")
            out[name] = random_value(name, shape, k, around_one=around_one, tables=_TABLES)
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
