"""A live frame of one or more conversations: listening, the frame step, the codec, one read.

:func:`queue_frame` queues, for every row of a frame state, the frame's encoder layers (each
row on its own encoder context; rows whose context is full run together), the RNNT's greedy
symbols of the frame on the device (``nets.rnnt.frame_greedy``), the one frame step (LLM,
heads, speech: :func:`~.step.step`) and one code frame of the codec, and packs what the host
needs into one int32 array: the frame's single host read. :class:`ReadLayout` names its
parts; nothing is read until the caller reads that array.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence, Tuple

import mlx.core as mx
import numpy as np

from ..nets.codec import replace_control_codes
from .framestate import FrameState
from .step import speech_stream, step


@dataclass
class FrameRead:
    """One row's share of a frame's host read."""

    text_id: int
    function_id: int
    quiet: bool  # a barge-in held when the frame ran
    labels: List[int]  # the RNNT's tokens of the frame
    codes: np.ndarray  # [Q] int32, after control-code replacement
    audio: np.ndarray  # [samples_per_frame] float32
    tail: np.ndarray  # [stream_delay] float32: the codec's last samples, were the stream to end


class ReadLayout:
    """The int32 words of a row of a frame's read, part by part (float32 audio as its bits)."""

    def __init__(self, model):
        codec = model.tts_model.audio_codec
        self.blank = model.stt_model.rnnt_joint.blank_id
        self.parts = (
            ("ids", 2),
            ("quiet", 1),
            ("labels", model.rnnt_frames.steps),
            ("codes", model.config.tts_config.num_quantizers),
            ("audio", codec.samples_per_frame),
            ("tail", codec.stream_delay),
        )
        self.width = sum(n for _, n in self.parts)

    def pack(self, **parts: mx.array) -> mx.array:
        """``[B, width]`` int32 from each part ``[B, n]`` (floats viewed as int32)."""
        words = []
        for name, n in self.parts:
            a = parts[name]
            B = a.shape[0]
            if a.dtype == mx.float32:
                a = mx.view(a, mx.int32)
            words.append(a.reshape(B, n).astype(mx.int32))
        return mx.concatenate(words, axis=1)

    def unpack(self, row: np.ndarray) -> FrameRead:
        at, out = 0, {}
        for name, n in self.parts:
            out[name], at = row[at : at + n], at + n
        labels = [int(k) for k in out["labels"] if k != self.blank]
        return FrameRead(
            text_id=int(out["ids"][0]),
            function_id=int(out["ids"][1]),
            quiet=bool(out["quiet"][0]),
            labels=labels,
            codes=out["codes"].astype(np.int32),
            audio=out["audio"].view(np.float32),
            tail=out["tail"].view(np.float32),
        )


def read(words: mx.array) -> np.ndarray:
    """The one host read of a frame's words."""
    return np.array(words.tolist(), dtype=np.int32)


def queue_frame(
    model, state: FrameState, windows: Sequence[Tuple[mx.array, int]], layout: ReadLayout
) -> mx.array:
    """Queue one frame of every row of ``state`` (``windows``: each row's mel window and the
    frame's index in its subsampled output, from ``MelStream.window``); returns the packed
    words ``[B, width]`` of the frame's read, not yet read."""
    stt = model.stt_model
    encoder = stt.perception.encoder
    dtype = encoder.pre_encode.out.weight.dtype
    xs = []
    for mel, j in windows:
        x, _ = encoder.pre_encode(mel[None].astype(dtype))
        xs.append(x[:, j : j + 1])
    x = xs[0] if len(xs) == 1 else mx.concatenate(xs, axis=0)
    encoded, state.encoder.rows = encoder.step_rows(x, state.encoder.rows)
    projected = stt.perception.proj(encoded)
    # The encoder starts on the device while the host builds the rest of the frame.
    mx.async_eval(projected)
    quiet = state.flags.cache[0]  # the barge-in flag the frame runs with
    out = step(model, state, projected, split_head=True)
    speech = model.tts_model
    codec = speech.audio_codec
    with mx.stream(speech_stream()):
        codes = replace_control_codes(out.codes, speech.control_codes, speech.codec_silence_tokens)
        wave, state.codec = codec.decode_step(codes[:, None], state.codec)
        audio = wave.astype(mx.float32)
        tail = codec.decode_flush(state.codec).astype(mx.float32)
        mx.async_eval(audio, codes)
    # The RNNT's symbols of the frame, beside the speech.
    h, c, pred = state.rnnt.cache
    enc = stt.rnnt_joint.project_encoder(encoded[:, 0])
    labels, h, c, pred = model.rnnt_frames(enc, h.swapaxes(0, 1), c.swapaxes(0, 1), pred)
    state.rnnt.cache = [h.swapaxes(0, 1), c.swapaxes(0, 1), pred]
    return layout.pack(
        ids=out.ids, quiet=quiet.astype(mx.int32), labels=labels, codes=codes, audio=audio, tail=tail
    )
