"""EAR-TTS text conditioning: the character-aware subword encoder (``embed_subword.*``).

Each subword id is spelled in a dense character vocabulary (single-character tokens by id, then
one padding index: errata 8), embedded, scaled by sqrt(hidden), run through one T5Gemma encoder
layer with soft-capped logits (errata 7), mean-pooled and projected; continuation and BOS/EOS
flag embeddings are added. Host-side ids are memoized; device ids gather a character table.
"""

from __future__ import annotations

import math
from typing import Dict, Mapping, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models import gemma3_text

from ...config import CharEncoderConfig
from ...derived import derived, reset_derived


class OffsetRMSNorm(gemma3_text.RMSNorm):
    """Gemma's RMSNorm with weight + 1."""

    def __call__(self, x: mx.array) -> mx.array:
        # NeMo / transformers normalise in float32 and add 1 to the float32 weight before
        # casting back; mlx-lm's bf16 `1 + weight` would round the offset.
        w = 1.0 + self.weight.astype(mx.float32)
        return mx.fast.rms_norm(x.astype(mx.float32), w, self.eps).astype(x.dtype)


# --- the character vocabulary -------------------------------------------------------------


def tokenizer_vocab(tokenizer) -> Optional[Dict[str, int]]:
    """``{piece: id}`` including added tokens, from a transformers / tokenizers object or a dict
    (None for an object without ``get_vocab``)."""
    if isinstance(tokenizer, Mapping):
        return dict(tokenizer)
    if not hasattr(tokenizer, "get_vocab"):
        return None
    try:
        return dict(tokenizer.get_vocab(with_added_tokens=True))  # tokenizers.Tokenizer
    except TypeError:
        return dict(tokenizer.get_vocab())  # transformers tokenizers include added tokens


def build_char_table(
    tokenizer, vocab_size: int, char_vocab_size: int
) -> Tuple[np.ndarray, np.ndarray]:
    """Character ids of every subword id below ``vocab_size``, padded with the last index.

    Returns ``(char_ids [vocab_size, max_len] int32, lengths [vocab_size] int32)``. Pieces are
    spelled by their literal characters (``<s>`` is ``<``, ``s``, ``>``); characters outside the
    vocabulary are skipped, and ids the tokenizer does not know have length 0.
    """
    vocab = tokenizer_vocab(tokenizer)
    if vocab is None:
        raise TypeError(f"need a tokenizer with get_vocab() or a {{piece: id}} dict: {tokenizer!r}")
    singles = sorted((i, piece) for piece, i in vocab.items() if len(piece) == 1)
    n_chars = char_vocab_size - 1
    if len(singles) != n_chars:
        raise ValueError(
            f"the tokenizer has {len(singles)} single-character tokens; the EAR-TTS character "
            f"encoder expects exactly {n_chars} (char_vocab_size {char_vocab_size} = {n_chars} "
            "characters + padding)"
        )
    char_index = {piece: k for k, (_, piece) in enumerate(singles)}
    spelled = {}
    for piece, i in vocab.items():
        if 0 <= i < vocab_size:
            chars = [char_index[c] for c in piece if c in char_index]
            if chars:
                spelled[i] = chars
    max_len = max((len(c) for c in spelled.values()), default=1)
    pad = char_vocab_size - 1
    char_ids = np.full((vocab_size, max_len), pad, dtype=np.int32)
    lengths = np.zeros((vocab_size,), dtype=np.int32)
    for i, chars in spelled.items():
        char_ids[i, : len(chars)] = chars
        lengths[i] = len(chars)
    return char_ids, lengths


# --- one T5Gemma encoder layer --------------------------------------------------------------


class CharAttention(nn.Module):
    def __init__(self, cfg: CharEncoderConfig):
        super().__init__()
        dim, hd = cfg.hidden_size, cfg.head_dim
        self.n_heads, self.n_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = hd
        self.scale = cfg.query_pre_attn_scalar**-0.5
        self.softcap = cfg.attn_logit_softcapping
        self.q_proj = nn.Linear(dim, self.n_heads * hd, bias=False)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.n_heads * hd, dim, bias=False)
        self.rope = nn.RoPE(hd, traditional=False, base=cfg.rope_base)

    def __call__(self, x: mx.array, key_mask: mx.array) -> mx.array:
        N, L, _ = x.shape
        q = self.rope(self.q_proj(x).reshape(N, L, self.n_heads, -1).transpose(0, 2, 1, 3))
        k = self.rope(self.k_proj(x).reshape(N, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3))
        v = self.v_proj(x).reshape(N, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        if self.n_kv_heads != self.n_heads:
            rep = self.n_heads // self.n_kv_heads
            k, v = mx.repeat(k, rep, axis=1), mx.repeat(v, rep, axis=1)
        scores = (q @ k.swapaxes(-1, -2)) * self.scale
        if self.softcap:
            # Eager T5Gemma soft-caps before the mask (errata 7); fused SDPA cannot.
            scores = mx.tanh(scores / self.softcap) * self.softcap
        # A finite floor, as transformers uses, keeps a token with no characters NaN-free.
        scores = mx.where(key_mask[:, None, None, :], scores, mx.finfo(scores.dtype).min)
        weights = mx.softmax(scores.astype(mx.float32), axis=-1).astype(v.dtype)
        out = (weights @ v).transpose(0, 2, 1, 3).reshape(N, L, -1)
        return self.o_proj(out)


class CharEncoderLayer(nn.Module):
    def __init__(self, cfg: CharEncoderConfig):
        super().__init__()
        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = CharAttention(cfg)
        self.mlp = gemma3_text.MLP(H, cfg.intermediate_size)
        self.pre_self_attn_layernorm = OffsetRMSNorm(H, eps)
        self.post_self_attn_layernorm = OffsetRMSNorm(H, eps)
        self.pre_feedforward_layernorm = OffsetRMSNorm(H, eps)
        self.post_feedforward_layernorm = OffsetRMSNorm(H, eps)

    def __call__(self, x: mx.array, key_mask: mx.array) -> mx.array:
        r = self.self_attn(self.pre_self_attn_layernorm(x), key_mask)
        h = x + self.post_self_attn_layernorm(r)
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class CharEncoder(nn.Module):
    def __init__(self, cfg: CharEncoderConfig):
        super().__init__()
        self.layers = [CharEncoderLayer(cfg) for _ in range(cfg.num_hidden_layers)]
        self.norm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CharBackbone(nn.Module):
    """Holds the encoder under ``backbone.encoder`` as NeMo's T5Gemma wrapper names it."""

    def __init__(self, cfg: CharEncoderConfig):
        super().__init__()
        self.encoder = CharEncoder(cfg)


# --- flag embeddings ------------------------------------------------------------------------


class SubwordFlagEmbedding(nn.Module):
    def __init__(self, hidden_size: int, vocab_size: int):
        super().__init__()
        self.cont_emb = nn.Embedding(2, hidden_size)
        self.is_continuation = mx.zeros((vocab_size + 1,), dtype=mx.int32)
        self.pad_tensor = mx.array(vocab_size, dtype=mx.int32)

    def __call__(self, ids: mx.array) -> mx.array:
        # Ids past the table read the pad entry, as NeMo's clamp does.
        safe = mx.where(ids >= self.is_continuation.shape[0] - 1, self.pad_tensor, ids)
        return self.cont_emb(self.is_continuation[safe])


class BOSEOSEmbedding(nn.Module):
    def __init__(self, hidden_size: int, vocab_size: int):
        super().__init__()
        self.special_emb = nn.Embedding(3, hidden_size)
        self.special_flags = mx.zeros((vocab_size,), dtype=mx.int32)
        # NeMo's pad here is the tokenizer's largest id, so that id itself reads flag 0.
        self.pad_tensor = mx.array(vocab_size - 1, dtype=mx.int32)

    def __call__(self, ids: mx.array) -> mx.array:
        safe = mx.where(ids >= self.pad_tensor, self.pad_tensor, ids)
        return self.special_emb(self.special_flags[safe])


# --- the encoder ------------------------------------------------------------------------------


class CharAwareSubwordEncoder(nn.Module):
    """``embed_subword``: subword ids [B, T] (+ mask) -> conditioning embeddings [B, T, hidden].

    Call :meth:`set_vocabulary` with the LLM tokenizer once before use.
    """

    def __init__(
        self,
        char_cfg: CharEncoderConfig,
        hidden_size: int,
        vocab_size: int,
        use_subword_flag_emb: bool = True,
        use_bos_eos_emb: bool = True,
    ):
        super().__init__()
        H = char_cfg.hidden_size
        self.char_cfg = char_cfg
        self.vocab_size = vocab_size
        self.embed_tokens = nn.Embedding(char_cfg.char_vocab_size, H)
        self.backbone = CharBackbone(char_cfg)
        self.proj_embedding = nn.Linear(H, hidden_size, bias=False)
        if use_subword_flag_emb:
            self.subword_flag_emb = SubwordFlagEmbedding(H, vocab_size)
        if use_bos_eos_emb:
            self.bos_eos_emb = BOSEOSEmbedding(H, vocab_size)
        self._char_ids: Optional[mx.array] = None
        self._char_lens: Optional[mx.array] = None

    # -- vocabulary ------------------------------------------------------------------------

    def set_vocabulary(self, tokenizer) -> None:
        """Build the padded character table for every subword id (tokenizer, or ``{piece: id}``)."""
        ids, lens = build_char_table(tokenizer, self.vocab_size, self.char_cfg.char_vocab_size)
        # int16 holds any character id (char_vocab_size is 257) at half the memory.
        self._char_ids, self._char_lens = mx.array(ids.astype(np.int16)), mx.array(lens)
        reset_derived(self)

    def spell(self, ids: mx.array) -> Tuple[mx.array, mx.array]:
        """Character ids ``[..., max_len]`` and lengths ``[...]`` of subword ids, on the device."""
        if self._char_ids is None:
            raise RuntimeError("CharAwareSubwordEncoder: call set_vocabulary(tokenizer) first")
        ids = mx.clip(ids, 0, self.vocab_size - 1)
        return self._char_ids[ids].astype(mx.int32), self._char_lens[ids]

    # -- forward pieces --------------------------------------------------------------------

    def encode_chars(self, char_ids: mx.array, lengths: mx.array) -> mx.array:
        """Pooled, projected embeddings ``[N, hidden]`` of ``N`` padded character sequences."""
        L = char_ids.shape[-1]
        mask = mx.arange(L)[None, :] < lengths[:, None]
        h = self.embed_tokens(char_ids)
        h = h * mx.array(math.sqrt(self.char_cfg.hidden_size), dtype=h.dtype)
        for layer in self.backbone.encoder.layers:
            h = layer(h, mask)
        h = self.backbone.encoder.norm(h)
        pooled = (h * mask[..., None].astype(h.dtype)).sum(axis=1)
        pooled = pooled / mx.maximum(lengths, 1)[:, None].astype(h.dtype)
        return self.proj_embedding(pooled)

    def flags(self, ids: mx.array) -> Optional[mx.array]:
        out = None
        if "subword_flag_emb" in self:
            out = self.subword_flag_emb(ids)
        if "bos_eos_emb" in self:
            e = self.bos_eos_emb(ids)
            out = e if out is None else out + e
        return out

    def __call__(self, ids: mx.array, mask: Optional[mx.array] = None) -> mx.array:
        """Embeddings ``[B, T, hidden]``; masked-out positions get only the flag embeddings."""
        ids = ids.astype(mx.int32)
        char_ids, lengths = self.spell(ids.reshape(-1))
        emb = self.encode_chars(char_ids, lengths).reshape(*ids.shape, -1)
        if mask is not None:
            emb = mx.where(mask[..., None], emb, mx.zeros_like(emb))
        f = self.flags(ids)
        return emb if f is None else emb + f.astype(emb.dtype)

    # -- memo for ids known on the host ---------------------------------------------------

    @property
    def _memo(self) -> Dict[int, mx.array]:
        """The embeddings computed so far for the current weights, by id."""
        return derived(self, "char.embeddings", dict)

    def embed_ids(self, ids: Sequence[int]) -> mx.array:
        """Unmasked embeddings ``[len(ids), hidden]`` of host-side ids, each computed once."""
        memo = self._memo
        todo = sorted({int(i) for i in ids} - memo.keys())
        if todo:
            rows = self(mx.array(todo, dtype=mx.int32)[None])[0]
            for k, i in enumerate(todo):
                memo[i] = rows[k]
        return mx.stack([memo[int(i)] for i in ids])
