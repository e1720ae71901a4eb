"""The Nemotron-H LLM of VoiceChat, run on fused input embeddings.

mlx-lm's blocks, caches and masks (``mlx_lm.models.nemotron_h``) with a fused embedding row per
frame in and ``norm_f`` out (the two heads are the caller's). Fast paths (:mod:`.fastpaths`):
``llm.step`` runs a Mamba mixer on one token as a recurrence (the chunked SSD scan at length 1
gives the same values) and each run of Mamba / MLP blocks between attention layers as one
compiled function; ``llm.row_attention`` attends each row over its own cache
(:class:`~.caches.RowCaches`).
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache, KVCache
from mlx_lm.models.nemotron_h import ModelArgs, NemotronHBlock, NemotronHModel
from mlx_lm.models.ssm import compute_dt

from ... import fastpaths
from ...caches import RowCaches
from ...derived import compiled, derived


def mamba_step(
    block: NemotronHBlock, x: mx.array, conv_state: mx.array, state: mx.array
) -> Tuple[mx.array, mx.array, mx.array]:
    """One token through a Mamba block (norm, mixer, residual) on a filled cache.

    ``x`` ``[b, 1, hidden]``; returns the block output and the new conv and SSM states.
    Mirrors ``NemotronHMamba2Mixer.__call__`` with ``ssm_attn`` at length 1, op for op."""
    mix = block.mixer
    b = x.shape[0]
    inner, Cd = mix.intermediate_size, mix.conv_dim
    h, dh, g, ds = mix.num_heads, mix.head_dim, mix.n_groups, mix.ssm_state_size
    r = h // g
    projected = mix.in_proj(block.norm(x))
    gate, conv_input, dt = mx.split(projected, [inner, inner + Cd], axis=-1)
    padded = mx.concatenate([conv_state, conv_input], axis=1)
    new_conv = padded[:, -(mix.conv_kernel_size - 1) :, :]
    conv = nn.silu(mix.conv1d(padded))
    xs, B, C = mx.split(conv, [inner, inner + g * ds], axis=-1)
    xs = xs.reshape(b, 1, h, dh)
    B = B.reshape(b, 1, g, ds)
    C = C.reshape(b, 1, g, ds)
    D = mix.D.astype(xs.dtype)

    dt = compute_dt(dt, mix.dt_bias, mix.time_step_limit)  # [b, 1, h]
    A = -mx.exp(mix.A_log).astype(dt.dtype)
    dtA = dt * A.reshape(1, 1, -1)
    dtx = dt.reshape(b, 1, h, 1) * xs  # [b, 1, h, dh]
    decay = mx.exp(dtA)  # exp(cumsum) over one step

    # The scan's "attention" term: (C . B) * dtx, one term per output.
    CB = mx.swapaxes(C, 1, 2) @ mx.transpose(B, (0, 2, 3, 1))  # [b, g, 1, 1]
    CB = mx.repeat(CB, r, axis=1)  # [b, h, 1, 1]
    y = mx.swapaxes(CB * dtx.swapaxes(1, 2), 1, 2)  # [b, 1, h, dh]
    # The state: dtx (x) B + exp(dtA) * state.
    Bh = mx.repeat(mx.transpose(B, (0, 2, 3, 1)), r, axis=1).swapaxes(2, 3)  # [b, h, 1, ds]
    new_state = dtx.swapaxes(1, 2).swapaxes(2, 3) * Bh
    new_state = new_state + decay[:, -1, :, None, None] * state
    y_prev = (state.reshape(b, 1, g, r, dh, ds) @ C.reshape(b, 1, g, 1, ds, 1))
    y = y + decay[..., None] * y_prev.squeeze(-1).flatten(2, 3)
    y = y.astype(xs.dtype) + xs * D.reshape(1, 1, h, 1)

    y = mix.norm(y.reshape(b, 1, inner), gate)
    return x + mix.out_proj(y), new_conv, new_state


def _segment_fn(blocks: Sequence[NemotronHBlock]) -> Callable:
    """Mamba / MLP blocks in a row as one function of ``(x, *states)``."""

    def run(x, *states):
        out, i = [], 0
        for block in blocks:
            if block.block_type == "M":
                x, conv, ssm = mamba_step(block, x, states[i], states[i + 1])
                out += [conv, ssm]
                i += 2
            else:
                x = block(x)
        return (x, *out)

    return run


def row_attention(block: NemotronHBlock, x: mx.array, cache: RowCaches) -> mx.array:
    """An attention block (``NemotronHBlock`` of type ``*``) on one position of every row,
    each row with its own KV cache: ``NemotronHAttention.__call__`` with the cache update and
    the attention done row by row."""
    attn = block.mixer
    B, L, _ = x.shape
    h = block.norm(x)
    q = attn.q_proj(h).reshape(B, L, attn.num_heads, -1).transpose(0, 2, 1, 3)
    k = attn.k_proj(h).reshape(B, L, attn.num_key_value_heads, -1).transpose(0, 2, 1, 3)
    v = attn.v_proj(h).reshape(B, L, attn.num_key_value_heads, -1).transpose(0, 2, 1, 3)
    o = cache.attend(q, k, v, attn.scale)
    return x + attn.o_proj(o.transpose(0, 2, 1, 3).reshape(B, L, -1))


class FusedNemotronH(NemotronHModel):
    """Nemotron-H layers + ``norm_f`` on precomputed input embeddings.

    The checkpoint keeps the token embedding beside the LLM (``stt_model.embed_tokens``), so
    the inner lookup is an identity and holds no parameters. Caches: :meth:`make_cache`, one
    row; a batch's are the rows' merged (Mamba states stacked, attention rows side by side).
    """

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.embeddings = nn.Identity()

    def __call__(self, embeds: mx.array, cache: Optional[List[Any]] = None) -> mx.array:
        if self._steppable(embeds, cache):
            return self.step(embeds, cache)
        if cache is not None and any(isinstance(c, RowCaches) and len(c) > 1 for c in cache):
            return self._by_layer(embeds, cache)
        return super().__call__(embeds, cache=cache)

    def _by_layer(self, embeds: mx.array, cache: List[Any]) -> mx.array:
        """mlx-lm's layers one by one on one position of several rows, attention row by row
        (where :meth:`step` does not apply: on Metal, or with ``llm.step`` off)."""
        if embeds.shape[1] != 1:
            raise ValueError("rows of a batch advance one position at a time")
        x, i = embeds, 0
        for layer in self.layers:
            if layer.block_type == "*":
                x = row_attention(layer, x, cache[i])
            elif layer.block_type == "M":
                x = layer(x, mask=None, cache=cache[i])
            else:
                x = layer(x)
            i += layer.block_type in "M*"
        return self.norm_f(x)

    def make_cache(self) -> List[Any]:
        caches = []
        for layer in self.layers:
            if layer.block_type == "M":
                caches.append(ArraysCache(size=2))
            elif layer.block_type == "*":
                caches.append(RowCaches([KVCache()]))
        return caches

    # --- one token ------------------------------------------------------------------------

    def _steppable(self, embeds: mx.array, cache) -> bool:
        if not fastpaths.enabled("llm.step") or cache is None or embeds.shape[1] != 1:
            return False
        if mx.default_device().type == mx.DeviceType.gpu and mx.metal.is_available():
            return False  # mlx-lm has a Metal kernel for this step
        return all(
            c[0] is not None and c[1] is not None and c.lengths is None and c.left_padding is None
            for c in cache
            if isinstance(c, ArraysCache)
        )

    def _step_plan(self) -> List[Tuple[str, Any, List[int]]]:
        """Segments: ``("attn", block, [cache index])`` or ``("run", fn, [cache indices])``,
        for the current weights (see :mod:`.derived`)."""
        return derived(self, "llm.step_plan", self._build_plan)

    def _build_plan(self) -> List[Tuple[str, Any, List[int]]]:
        plan, run, run_caches, ci = [], [], [], 0

        def close():
            if run:
                blocks = list(run)
                fn = compiled(_segment_fn(blocks))
                plan.append(("run", fn, list(run_caches)))
                run.clear()
                run_caches.clear()

        for block in self.layers:
            if block.block_type == "*":
                close()
                plan.append(("attn", block, [ci]))
                ci += 1
            elif block.block_type == "M":
                run.append(block)
                run_caches.append(ci)
                ci += 1
            elif block.block_type == "-":
                run.append(block)
            else:
                raise ValueError(f"no single-token step for block type {block.block_type!r}")
        close()
        return plan

    def step(self, embeds: mx.array, cache: List[Any]) -> mx.array:
        """One token ``[b, 1, hidden]`` per row on filled caches; same result as ``__call__``
        on each row alone."""
        x = embeds
        for kind, what, idx in self._step_plan():
            if kind == "attn":
                x = row_attention(what, x, cache[idx[0]])
                continue
            states = []
            for i in idx:
                states += [cache[i][0], cache[i][1]]
            x, *new = what(x, *states)
            for j, i in enumerate(idx):
                cache[i][0], cache[i][1] = new[2 * j], new[2 * j + 1]
        return self.norm_f(x)
