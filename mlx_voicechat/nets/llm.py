"""The Nemotron-H LLM of VoiceChat, run on fused input embeddings.

The blocks, caches and masks are mlx-lm's (``mlx_lm.models.nemotron_h``); VoiceChat only
changes what goes in (a fused embedding row per 80 ms frame, no token lookup) and what comes
out (two heads on the ``norm_f`` output, owned by the caller).

One frame is one token through 56 layers. Where mlx-lm runs a single Mamba token through its
chunked SSD scan (everywhere but Metal, where it has a kernel), :meth:`FusedNemotronH.step`
runs it as a recurrence, without the scan's masks, cumulative sums and repeats, and each run of
Mamba / MLP layers between two attention layers as one ``mx.compile``'d function (its weights
constants of the trace, see :mod:`.compiled`; 35 -> 27 ms per token at the benchmark's medium
scale on a 2-core CPU). Every value is computed by the same operations in the same order as
mlx-lm's scan at length 1 (its decay is ``exp(0) = 1`` and its inner products have one term),
so the result is bit-identical (tested).
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache, KVCache
from mlx_lm.models.nemotron_h import ModelArgs, NemotronHBlock, NemotronHModel
from mlx_lm.models.ssm import compute_dt

from .compiled import FrozenCompile


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


class FusedNemotronH(NemotronHModel):
    """Nemotron-H layers + ``norm_f`` on precomputed input embeddings.

    The checkpoint keeps the token embedding beside the LLM (``stt_model.embed_tokens``), so
    the inner lookup is an identity and holds no parameters.
    """

    #: Run single-token calls through :meth:`step` where mlx-lm would scan (set ``False`` to
    #: use mlx-lm's path everywhere).
    use_step = True

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.embeddings = nn.Identity()
        object.__setattr__(self, "_plan", FrozenCompile(self._build_plan, lambda: [self]))

    def __call__(self, embeds: mx.array, cache: Optional[List[Any]] = None) -> mx.array:
        if self._steppable(embeds, cache):
            return self.step(embeds, cache)
        return super().__call__(embeds, cache=cache)

    def make_cache(self) -> List[Any]:
        caches = []
        for layer in self.layers:
            if layer.block_type == "M":
                caches.append(ArraysCache(size=2))
            elif layer.block_type == "*":
                caches.append(KVCache())
        return caches

    # --- one token ------------------------------------------------------------------------

    def _steppable(self, embeds: mx.array, cache) -> bool:
        if not self.use_step or cache is None or embeds.shape[1] != 1:
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
        for the current weights (see :mod:`.compiled`)."""
        return self._plan.get()

    def _build_plan(self) -> List[Tuple[str, Any, List[int]]]:
        plan, run, run_caches, ci = [], [], [], 0

        def close():
            if run:
                blocks = list(run)
                fn = mx.compile(_segment_fn(blocks))
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
        """One token ``[b, 1, hidden]`` on filled caches; same result as ``__call__``."""
        x = embeds
        for kind, what, idx in self._step_plan():
            if kind == "attn":
                x = what(x, mask=None, cache=cache[idx[0]])
                continue
            states = []
            for i in idx:
                states += [cache[i][0], cache[i][1]]
            x, *new = what(x, *states)
            for j, i in enumerate(idx):
                cache[i][0], cache[i][1] = new[2 * j], new[2 * j + 1]
        return self.norm_f(x)
