"""Nemotron-3.5-ASR's networks on the shared blocks (``listen.fastconformer``, ``listen.rnnt``),
with mlx-audio's parameter names (``encoder.*``, ``prompt_kernel.*``, ``decoder.prediction.*``,
``joint.*``). Beyond VoiceChat's encoder it has a lookahead (chunks of ``lookahead + 1`` frames
final together), NeMo's length masks (a clip's frames never depend on its padding) and the
language prompt (a one-hot concatenated to every frame, projected back). The end of a clip:
``audio.mel.EDGES``.
"""

from __future__ import annotations

from typing import Tuple

import mlx.core as mx
import mlx.nn as nn

from .. import fastpaths
from ..audio.mel import recognizer_mel
from ..derived import compiled, derived
from ..listen.fastconformer import EncoderCache, FastConformer, LayerCache
from ..listen.rnnt import RNNTDecoder, RNNTJoint, start_state
from .config import ASRConfig


class RecognizerEncoder(FastConformer):
    """The FastConformer with NeMo's subsampling masks and xscaling; a steady chunk is
    compiled with the prompt and the joint's projection (``RecognizerNetwork.encode_chunk``)."""

    masked_input = True
    steady_path, steady_cpu_only = "asr.chunk", False


class RecognizerNetwork(nn.Module):
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
        """Frames ``frames`` of the subsampling of ``mel`` [1, T, n_mels] (from mel frame
        ``start``; with ``mel_len``, masked past it) through the layers on ``cache`` and
        :meth:`joint_frames` -> (joint frames, advanced cache); a steady chunk in one compiled
        call (``asr.chunk``), the same values."""
        enc = self.encoder
        n = frames.stop - frames.start
        if mel_len is not None or not enc.steady(n, cache):
            x = enc.subsample(mel, start, mel_len)[:, frames]
            x, cache = enc.step(x, cache)
            return self.joint_frames(x, prompt_ids), cache

        def run(mel, prompt_ids, *arrays):  # (mel, prompt ids, *positions, *cache arrays)
            x, *caches = enc.steady_layers(enc.subsample(mel)[:, frames], arrays, 0)
            return (self.joint_frames(x, prompt_ids), *caches)

        key = (frames.start, frames.stop)  # and the fast paths traced into it:
        convs = fastpaths.enabled("encoder.convs")
        fn = derived(self, "asr.chunk", lambda: compiled(run), (*key, convs))
        pos = enc.positions(enc.left_context + n, enc.pre_encode.out.weight.dtype)
        out, *arrays = fn(mel, prompt_ids, *pos, *cache.arrays())
        layers = [LayerCache(*arrays[i : i + 3]) for i in range(0, len(arrays), 3)]
        return out, EncoderCache(layers, cache.offset + n)

    def start(self, batch: int) -> Tuple[mx.array, Tuple[mx.array, mx.array]]:
        """The start symbol's prediction for ``batch`` rows (its blank embedded)."""
        return start_state(self.decoder, self.joint, batch, self.config.blank_id)

    def __call__(self, *args, **kwargs):
        raise TypeError(
            "the recognizer is driven by mlx_voicechat.nemotron_asr.transcribe, not called"
        )
