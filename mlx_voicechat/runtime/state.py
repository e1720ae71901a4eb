"""A session's state across sessions: the post-prompt snapshot a new session starts from,
and how much a session's caches grow per minute."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, List, Optional, Sequence

import mlx.core as mx
from mlx.utils import tree_flatten

from ..noise import KeyNoise, NoiseSource
from . import duplex

_SNAPSHOTS_MAX = 4
_snapshot_lock = threading.Lock()


def _copy_cache(caches: List[Any]) -> List[Any]:
    """New cache objects over the same (immutable) arrays: mlx-lm caches update their arrays
    by slice assignment, which rebinds the array object it is called on, so each copy gets
    array objects of its own and a snapshot is never written through."""
    out = []
    for c in caches:
        new = c.__class__.__new__(c.__class__)
        new.__dict__.update(c.__dict__)
        for name in ("keys", "values"):
            a = getattr(c, name, None)
            if isinstance(a, mx.array):
                setattr(new, name, mx.array(a))
        out.append(new)
    return out


def _cache_arrays(cache) -> List[Any]:
    """Every array of an mlx-lm cache's ``state``, nested ones included (``ArraysCache``, the
    Mamba layers' cache, keeps its conv and SSM states in a list)."""
    try:
        state = cache.state
    except Exception:  # an empty cache has no state yet
        return []
    return [a for _, a in tree_flatten(state) if isinstance(a, mx.array)]


def _weights(model) -> tuple:
    """The weight arrays a snapshot is keyed on (held by the entry, so their ids stay theirs)."""
    speech = model.tts_model
    return (speech.tts_model.rvq_embs, speech.audio_prompt_latents[model.config.speaker])


def open_state(model, prompt: Sequence[int], seed: int, noise: Optional[NoiseSource]):
    """``duplex.start_session`` for a new session. With the default noise the TTS state after
    the warm-up and the prompt positions depends only on (weights, prompt, seed): it is kept
    and each later session starts from a copy of it."""
    if noise is not None:
        return duplex.start_session(model, prompt, noise=noise, seed=seed)
    memo = getattr(model, "_session_snapshots", None)
    if memo is None:
        memo = OrderedDict()
        object.__setattr__(model, "_session_snapshots", memo)
    weights = _weights(model)
    key = (tuple(id(w) for w in weights), tuple(int(i) for i in prompt), int(seed))
    with _snapshot_lock:
        entry = memo.get(key)
        snap = entry[1] if entry is not None else None
        if snap is not None:
            memo.move_to_end(key)
    if snap is None:
        cache = duplex.start_session(model, prompt, seed=seed)
        mx.eval(
            cache.previous_code, cache.noise.key, *[s for c in cache.tts for s in c.state],
            *([cache.prefix] if cache.prefix is not None else []),
        )
        snap = cache
        with _snapshot_lock:
            memo[key] = (weights, snap)
            while len(memo) > _SNAPSHOTS_MAX:
                memo.popitem(last=False)
    noise_copy = KeyNoise.__new__(KeyNoise)
    noise_copy.key = snap.noise.key
    return duplex.DuplexCache(
        llm=model.stt_model.llm.make_cache(),
        tts=_copy_cache(snap.tts),
        previous_code=snap.previous_code,
        noise=noise_copy,
        prefix=snap.prefix,
        prompt_frames=snap.prompt_frames,
        prev_ids=snap.prev_ids,
        position=snap.position,
    )



def memory_per_minute(model) -> dict:
    cfg = model.config
    args = cfg.text_args
    frames = int(round(60.0 / cfg.frame_duration))
    llm_dtype = model.stt_model.lm_head.weight.dtype
    if llm_dtype not in (mx.float32, mx.float16, mx.bfloat16):
        llm_dtype = mx.bfloat16
    pattern = getattr(args, "hybrid_override_pattern", "") or ""
    n_attn = sum(1 for c in pattern if c == "*")
    llm = n_attn * 2 * args.num_key_value_heads * args.head_dim * llm_dtype.size * frames
    tts = cfg.tts_config
    tts_dtype = model.tts_model.tts_model.embed_code.weight.dtype
    if tts_dtype not in (mx.float32, mx.float16, mx.bfloat16):
        tts_dtype = mx.bfloat16
    per_layer = 2 * 2 * tts.num_key_value_heads * tts.head_dim * tts_dtype.size  # cond + uncond
    n_global = sum(1 for i in range(tts.num_hidden_layers) if tts.is_global_layer(i))
    n_local = tts.num_hidden_layers - n_global
    window_minutes = tts.sliding_window * cfg.frame_duration / 60.0
    return {
        "llm_kv": llm,
        "tts_global_kv": n_global * per_layer * frames,
        "tts_window_kv": n_local * per_layer * frames,
        "tts_window_minutes": window_minutes,
        "total_after_window": llm + n_global * per_layer * frames,
    }
