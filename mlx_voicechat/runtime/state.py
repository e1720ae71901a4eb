"""How much a conversation's caches grow per minute (what ``Session.memory_per_minute`` and
the README's figures come from)."""

from __future__ import annotations

import mlx.core as mx


def memory_per_minute(model) -> dict:
    """Bytes per minute of conversation: the LLM's attention keys / values, the TTS's global
    layers' and its windowed layers' (until their window is full), by dtype of the weights."""
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
