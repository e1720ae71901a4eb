"""EAR-TTS's backbone (``tts_model.tts_model.backbone.*``): Gemma-3 layers on injected embeddings.

mlx-lm's ``gemma3_text`` blocks with offset RMSNorms and no input scaling, embedding or head.
Rows come in guidance pairs (row ``2 b`` conditioned on the text, ``2 b + 1`` on ``null_emb``);
each conversation keeps its own two-row caches in a :class:`~.caches.RowCaches`. The
``tts.backbone_step`` fast path compiles everything between two layers' caches as one function,
with RoPE offsets as an array (one trace for every position) and the attention outside.
"""

from __future__ import annotations

from typing import Callable, List, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import gemma3_text
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache, RotatingKVCache
from mlx_lm.models.gemma3_text import clip_residual

from ... import fastpaths
from ...caches import RowCaches
from ...config import TTSConfig
from ...derived import compiled, derived
from .char_encoder import OffsetRMSNorm


def _gemma_args(cfg: TTSConfig) -> gemma3_text.ModelArgs:
    fixed = {"model_type": "gemma3_text", "vocab_size": 1}
    return gemma3_text.ModelArgs.from_dict(
        {**vars(cfg), "rope_theta": cfg.rope_global_base_freq, **fixed}
    )


class BackboneBlock(gemma3_text.TransformerBlock):
    def __init__(self, args: gemma3_text.ModelArgs, layer_idx: int):
        super().__init__(args, layer_idx)
        # transformers' Gemma3RMSNorm adds 1 to the float32 weight; mlx-lm rounds it in bf16.
        H, hd, eps = args.hidden_size, args.head_dim, args.rms_norm_eps
        self.input_layernorm = OffsetRMSNorm(H, eps)
        self.post_attention_layernorm = OffsetRMSNorm(H, eps)
        self.pre_feedforward_layernorm = OffsetRMSNorm(H, eps)
        self.post_feedforward_layernorm = OffsetRMSNorm(H, eps)
        self.self_attn.q_norm = OffsetRMSNorm(hd, eps)
        self.self_attn.k_norm = OffsetRMSNorm(hd, eps)


def _start(layer, h, offset):
    attn = layer.self_attn
    B, L, _ = h.shape
    x = layer.input_layernorm(h)
    q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
    q = attn.q_norm(q.reshape(B, L, attn.n_heads, -1).transpose(0, 2, 1, 3))
    k = attn.k_norm(k.reshape(B, L, attn.n_kv_heads, -1).transpose(0, 2, 1, 3))
    v = v.reshape(B, L, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
    return attn.rope(q, offset=offset), attn.rope(k, offset=offset), v


def _end(layer, h, o):
    B, L, _ = h.shape
    r = layer.self_attn.o_proj(o.transpose(0, 2, 1, 3).reshape(B, L, -1))
    h = clip_residual(h, layer.post_attention_layernorm(r))
    r = layer.mlp(layer.pre_feedforward_layernorm(h))
    return clip_residual(h, layer.post_feedforward_layernorm(r))


class Backbone(nn.Module):
    """Gemma-3 layers + final norm on injected embeddings (``backbone.*``)."""

    def __init__(self, cfg: TTSConfig):
        super().__init__()
        self.cfg = cfg
        args = _gemma_args(cfg)
        self.layers = [BackboneBlock(args, i) for i in range(cfg.num_hidden_layers)]
        self.norm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def make_cache(self) -> list:
        """One conversation's caches (two rows: conditioned and unconditioned)."""
        cfg = self.cfg
        return [
            RowCaches([KVCache() if cfg.is_global_layer(i) else RotatingKVCache(cfg.sliding_window)])
            for i in range(cfg.num_hidden_layers)
        ]

    def __call__(self, h: mx.array, cache: Optional[list] = None) -> mx.array:
        """``h`` ``[2 B, L, H]`` on ``cache`` (``B`` conversations; several positions only for
        one conversation)."""
        if cache is not None and h.shape[1] == 1 and not any(c.empty() for c in cache):
            if fastpaths.enabled("tts.backbone_step"):
                return self.step(h, cache)
            rows = len(cache[0])
            if rows > 1:  # the anchor, one conversation at a time
                outs = [self._layers(h[2 * b : 2 * b + 2], [c.extract(b) for c in cache]) for b in range(rows)]
                return mx.concatenate(outs, axis=0)
        return self._layers(h, cache)

    def _layers(self, h: mx.array, cache: Optional[list]) -> mx.array:
        """mlx-lm's blocks one after the other (one conversation)."""
        cfg = self.cfg
        if cache is None:
            cache = [None] * len(self.layers)
        # Masks come from the caches before any layer advances them. mlx-lm's sliding mask
        # lets query i see keys i - window < j <= i, as transformers' Gemma-3 does.
        masks = {}
        for i, c in enumerate(cache):
            is_global = cfg.is_global_layer(i)
            if is_global not in masks:
                window = None if is_global else cfg.sliding_window
                masks[is_global] = create_attention_mask(h, c, window_size=window)
        for i, (layer, c) in enumerate(zip(self.layers, cache)):
            h = layer(h, masks[cfg.is_global_layer(i)], c)
        return self.norm(h)

    # --- one position -------------------------------------------------------------------

    def step(self, h: mx.array, cache: List[RowCaches]) -> mx.array:
        """One position ``[2 B, 1, H]`` on filled caches; the same bits as the layers one by
        one, conversation by conversation. A single position needs no mask (mlx-lm's, and a
        sliding cache holds only the window)."""
        segments = derived(self, "tts.backbone_segments", self._build_segments)
        # Every layer of a conversation has seen as many positions: one offset per row pair.
        offsets = mx.array([c.offset for c in cache[0].rows for _ in (0, 1)], dtype=mx.int32)
        q, k, v = segments[0](h, offsets)
        n = len(self.layers)
        for i, (layer, c) in enumerate(zip(self.layers, cache)):
            o = c.attend(q, k, v, layer.self_attn.scale)
            if i + 1 < n:
                h, q, k, v = segments[i + 1](h, o, offsets)
            else:
                h = segments[n](h, o)
        return h

    def _build_segments(self) -> List[Callable]:
        layers = self.layers

        def first(h, offset):
            return _start(layers[0], h, offset)

        def between(i):
            def run(h, o, offset):
                h = _end(layers[i], h, o)
                return (h, *_start(layers[i + 1], h, offset))

            return run

        def last(h, o):
            return self.norm(_end(layers[-1], h, o))

        return [compiled(first)] + [compiled(between(i)) for i in range(len(layers) - 1)] + [
            compiled(last)
        ]

