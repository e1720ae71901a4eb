"""Nemotron-3.5-ASR's networks: cache-aware FastConformer, language prompt, RNNT.

The blocks are this package's (``nets.perception.FastConformer``, ``nets.rnnt.RNNTDecoder`` /
``RNNTJoint``), built on mlx-audio's ``nemotron_asr`` modules, so the parameter names are
mlx-audio's (``encoder.*``, ``prompt_kernel.*``, ``decoder.prediction.*``, ``joint.*``). What
this model adds to the VoiceChat encoder:

* a lookahead: attention sees ``lookahead`` frames to the right, chunk by chunk
  (``chunked_limited``, chunks of ``lookahead + 1`` frames), so a chunk's outputs become final
  together, once its last frame's input is in;
* lengths that mask: each clip's frames past its length are zeros at every subsampling stage
  and masked as attention keys (NeMo's ``MaskedConvSequential`` and pad mask), so a clip's
  frames never depend on its padding, in a batch or alone;
* the language prompt: a one-hot of the prompt id concatenated to every encoder frame and
  projected back (``prompt_kernel``: Linear, ReLU, Linear).

The end of a clip (``nets.mel.EDGES``): ``"nemo"`` is NeMo's and Transformers' (``floor(n / 160)`` mel
frames, the centred STFT's last frame is padding, stage lengths from that); ``"mlx-audio"`` is
what mlx-audio's ``generate`` computes (that last frame is real and counted, nothing masked
inside the subsampling), which differs from NeMo in the last chunk of some lengths.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import mlx.core as mx
import mlx.nn as nn

from ..config.asr import ASRConfig
from . import conv_products, fastpaths
from .mel import recognizer_mel
from .version import Memo, Versioned
from .encoder import (
    NEG_INF,
    PRE_ENCODE_CONTEXT,
    EncoderCache,
    FastConformer,
    LayerCache,
    context_mask,
)
from .rnnt import RNNTDecoder, RNNTJoint

# Encoder frames per chunk of the offline encoder (rounded up to whole lookahead chunks).
OFFLINE_CHUNK_FRAMES = 256


class RecognizerEncoder(FastConformer):
    """The FastConformer with a lookahead and length masks (see the module docstring)."""

    def stage_lengths(self, mel_len: mx.array):
        """Valid lengths after each stride-2 subsampling stage."""
        sub, out = self.pre_encode, []
        for _ in range(sub.sampling_num):
            mel_len = (mel_len + sub.pad_left + sub.pad_right - sub.kernel_size) // sub.stride + 1
            out.append(mel_len)
        return out

    def subsample(self, mel: mx.array, start: int = 0, mel_len: Optional[mx.array] = None):
        """The subsampling convs over ``mel`` [B, T, n_mels], whose first row is mel frame
        ``start`` (a multiple of the subsampling factor); with ``mel_len`` [B], positions past
        each stage's valid length are zeros (NeMo). Output frame ``j`` is encoder frame
        ``start / factor + j``; those reading before the window's start are not valid."""
        sub = self.pre_encode
        x = mel.astype(sub.out.weight.dtype)[..., None]
        lengths = None if mel_len is None else self.stage_lengths(mel_len)
        if mel_len is not None:
            keep = (start + mx.arange(x.shape[1]))[None, :] < mel_len[:, None]
            x = x * keep[:, :, None, None].astype(x.dtype)
        stage, scale = 0, 1
        for i, layer in enumerate(sub.conv):
            if i in sub._strided_idx:
                pad = (sub.pad_left, sub.pad_right)
                x = mx.pad(x, [(0, 0), pad, pad, (0, 0)])
            x = conv_products.conv(layer, x)
            if isinstance(layer, nn.ReLU) and lengths is not None:
                scale *= sub.stride
                at = start // scale + mx.arange(x.shape[1])
                keep = at[None, :] < lengths[stage][:, None]
                x = x * keep[:, :, None, None].astype(x.dtype)
                stage += 1
        b, t, f, c = x.shape
        x = sub.out(x.transpose(0, 1, 3, 2).reshape(b, t, c * f))
        # NeMo's xscaling, Transformers' scale_input: the frames times sqrt(d_model).
        return x * self.input_scale if self.cfg.xscaling else x

    @property
    def input_scale(self) -> float:
        return math.sqrt(self.cfg.d_model)

    def step(self, x: mx.array, cache: EncoderCache, lengths: Optional[mx.array] = None):
        """``FastConformer.step``; with ``lengths`` [B], keys at or past a row's length are
        masked too, so no row attends to its padding through the lookahead."""
        if lengths is None:
            return super().step(x, cache)
        left, right = self.cfg.att_context_size
        T = x.shape[1]
        ctx = cache.layers[0].context
        k0 = cache.offset - ctx
        mask = context_mask(cache.offset, T, k0, ctx + T, left, right)
        keys = (k0 + mx.arange(ctx + T))[None, :] < lengths[:, None]  # [B, K]
        mask = mx.where(keys[:, None, None, :], mask, NEG_INF).astype(x.dtype)
        valid = (cache.offset + mx.arange(T))[None, :, None] < lengths[:, None, None]
        valid = valid.astype(x.dtype)
        pos_emb = self.pos_enc.pos_emb_for(ctx + T, x.dtype)
        new = []
        for layer, c in zip(self.layers, cache.layers):
            x, c = layer(x, layer.self_attn.positions(pos_emb), mask, c, valid, self.left_context)
            new.append(c)
        return x, EncoderCache(new, cache.offset + T)

    # --- one chunk of a stream ----------------------------------------------------------------

    def steady(self, frames: int, cache: EncoderCache) -> bool:
        """A whole chunk of ``frames`` on a full left context: from one such chunk to the
        next every shape of :meth:`step` is the same and every key is visible (the mask it
        would add is all zeros), so it can run compiled (``asr.chunk``)."""
        size, left = self.cfg.att_context_size[1] + 1, self.left_context
        if not fastpaths.enabled("asr.chunk") or not left or frames != size or cache.offset % size:
            return False
        return all(c.context == left and c.conv is not None for c in cache.layers)

    def chunk_positions(self, frames: int, dtype) -> list:
        """Each layer's projected positions for a steady chunk of ``frames``."""
        pos_emb = self.pos_enc.pos_emb_for(self.left_context + frames, dtype)
        return [layer.self_attn.positions(pos_emb) for layer in self.layers]

    def chunk_layers(self, x: mx.array, pos, caches):
        """:meth:`step`'s layers on a steady chunk, on the cache arrays ``caches`` (keys,
        values, conv per layer) -> ``(x, *new cache arrays)``, without the mask."""
        out = []
        for i, layer in enumerate(self.layers):
            cache = LayerCache(*caches[3 * i : 3 * i + 3])
            x, c = layer(x, pos[i], None, cache, None, self.left_context)
            out += [c.keys, c.values, c.conv]
        return (x, *out)

    def encode(
        self, mel: mx.array, mel_len: mx.array, total: int, chunk_frames: int = OFFLINE_CHUNK_FRAMES
    ) -> mx.array:
        """Offline: ``mel`` [B, T_mel, n_mels] with ``mel_len`` [B] valid frames -> the first
        ``total`` encoder frames [B, total, D] (``total``: the longest row's count), chunk by
        chunk on a left-context cache so memory grows linearly with the input."""
        factor = 2**self.pre_encode.sampling_num
        lengths = self.output_lengths(mel_len)
        size = self.cfg.att_context_size[1] + 1
        chunk = max(math.ceil(chunk_frames / size) * size, size)
        cache, outs = self.make_cache(), []
        for k0 in range(0, total, chunk):
            k1 = min(k0 + chunk, total)
            s = max(k0 - PRE_ENCODE_CONTEXT, 0)
            # Frame k reads mel frames up to factor * k (causal subsampling).
            x = self.subsample(mel[:, s * factor : (k1 - 1) * factor + 1], s * factor, mel_len)
            x, cache = self.step(x[:, k0 - s : k1 - s], cache, lengths)
            if total > chunk:
                mx.eval(x, *cache.arrays())
            outs.append(x)
        return mx.concatenate(outs, axis=1) if len(outs) > 1 else outs[0]


class RecognizerNetwork(Versioned, nn.Module):
    """The parameter tree of Nemotron-3.5-ASR (mlx-audio's key names)."""

    def __init__(self, config: ASRConfig):
        super().__init__()
        self.config = config
        self.model_type = config.model_type
        self.frontend = recognizer_mel(config)  # not a parameter: computed, never loaded
        self.encoder = RecognizerEncoder(config.encoder)
        p = config.prompt
        if p.num_prompts:
            d = config.encoder.d_model
            self.prompt_kernel = [
                nn.Linear(d + p.num_prompts, p.prompt_hidden),
                nn.ReLU(),
                nn.Linear(p.prompt_hidden, d),
            ]
        self.decoder = RNNTDecoder(config.decoder)
        self.joint = RNNTJoint(config.joint)

    @property
    def has_prompt(self) -> bool:
        return bool(self.config.prompt.num_prompts)

    def apply_prompt(self, x: mx.array, prompt_ids: mx.array) -> mx.array:
        """Encoder frames [B, T, D] conditioned on each row's prompt id ([B] int)."""
        if not self.has_prompt:
            return x
        B, T, _ = x.shape
        n = self.config.prompt.num_prompts
        one_hot = (mx.arange(n)[None, :] == prompt_ids[:, None]).astype(x.dtype)
        x = mx.concatenate([x, mx.broadcast_to(one_hot[:, None, :], (B, T, n))], axis=-1)
        for layer in self.prompt_kernel:
            x = layer(x)
        return x

    def joint_frames(self, encoded: mx.array, prompt_ids: mx.array) -> mx.array:
        """Encoder frames -> the joint's encoder side (prompt, then ``joint.enc``)."""
        return self.joint.project_encoder(self.apply_prompt(encoded, prompt_ids))

    def encode_chunk(
        self, mel, start: int, frames: slice, cache: EncoderCache, prompt_ids, mel_len=None
    ):
        """Frames ``frames`` of the subsampling of ``mel`` [1, T, n_mels] (its first row mel
        frame ``start``; with ``mel_len``, masked past it) through the layers on ``cache``,
        then :meth:`joint_frames`: (joint frames, the advanced cache). A steady chunk
        (:meth:`RecognizerEncoder.steady`) is one compiled call (``asr.chunk``): the
        subsampling, the layers and the projections fused, the same values as op by op."""
        enc = self.encoder
        n = frames.stop - frames.start
        if mel_len is not None or not enc.steady(n, cache):
            x = enc.subsample(mel, start, mel_len)[:, frames]
            x, cache = enc.step(x, cache)
            return self.joint_frames(x, prompt_ids), cache
        memo = self.__dict__.get("_chunk_memo")
        if memo is None:
            memo = Memo(self)
            object.__setattr__(self, "_chunk_memo", memo)
        key = (frames.start, frames.stop)  # and the fast paths traced into it:
        fn = memo.get(lambda: self._chunk_fn(*key), (*key, fastpaths.enabled("encoder.convs")))
        pos = enc.chunk_positions(n, enc.pre_encode.out.weight.dtype)
        out, *arrays = fn(mel, prompt_ids, *pos, *cache.arrays())
        layers = [LayerCache(*arrays[i : i + 3]) for i in range(0, len(arrays), 3)]
        return out, EncoderCache(layers, cache.offset + n)

    def _chunk_fn(self, first: int, last: int):
        """:meth:`encode_chunk` on a steady chunk as a function of ``(mel, prompt ids,
        *positions, *cache arrays)``, compiled (the weights are constants of the trace, rebuilt
        when they change: ``nets.version``)."""
        enc, n = self.encoder, len(self.encoder.layers)

        def run(mel, prompt_ids, *arrays):
            x = enc.subsample(mel)[:, first:last]
            x, *caches = enc.chunk_layers(x, arrays[:n], arrays[n:])
            return (self.joint_frames(x, prompt_ids), *caches)

        return mx.compile(run)

    def start(self, batch: int) -> Tuple[mx.array, Tuple[mx.array, mx.array]]:
        """The prediction of the start symbol for ``batch`` rows: (projected prediction [B, J],
        LSTM state (h, c) [layers, B, H]). The start symbol is the blank, embedded, from a zero
        state, as Transformers starts its decoder: the embedding's blank row is zero in weights
        converted from NeMo (blank-as-pad, the same as a zero input), not in a model
        fine-tuned with Transformers."""
        out, (h, c) = self.decoder(mx.array([[self.config.blank_id]], dtype=mx.int32), None)
        pred = self.joint.project_prediction(out[:, -1])
        tile = lambda a, axis: mx.repeat(a, batch, axis=axis) if batch > 1 else a  # noqa: E731
        return tile(pred, 0), (tile(h, 1), tile(c, 1))

    def __call__(self, *args, **kwargs):
        raise TypeError("the recognizer is driven by mlx_voicechat.runtime.asr, not called")
