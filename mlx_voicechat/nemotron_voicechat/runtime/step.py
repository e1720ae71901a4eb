"""The one frame step: a frame state advanced by one 80 ms input frame.

:func:`step` is the only code that advances a frame state: listen -> think -> speak -> decode
-> the frame's words, packed for one host read (:class:`ReadLayout`). Offline, live batches,
the server, the mlx-audio layer and transcription all drive it (docs/architecture.md). A stage
runs only when the state has its part (no encoder/RNNT state: rows heard already; no codec
state: codes left undecoded). Timeline (spec "Offline timeline loop", errata 10-12): the
prompt takes positions ``0..P-1``, audio frame ``i`` is position ``P + i``; position 0 is never
spoken. The speech runs on :func:`speech_stream`, beside the next frame's LLM.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple, Union

import mlx.core as mx
import numpy as np

from ...fastpaths.heads import greedy_id, should_split
from ...threads import note_mlx_thread
from ..nets.codec import replace_control_codes

NO_ID = -1  # a forced-id flag that forces nothing


#: What a frame hears: each row's mel window and the frame's index in its subsampled output
#: (``MelStream.window``), or its projected rows ``[B, 1, H]`` heard already (no encoder or RNNT).
Listening = Union[Sequence[Tuple[mx.array, int]], mx.array]


@dataclass
class StepOut:
    ids: Optional[mx.array] = None  # [B, 2] int32: each row's text and function id
    codes: Optional[mx.array] = None  # [B, Q] int32: each row's code frame (as the TTS gave it)
    words: Optional[mx.array] = None  # [B, width] int32: the frame's read (with a layout)
    speech: List[mx.array] = field(default_factory=list)  # what the speech stream computes


def step(
    model,
    state,
    heard: Listening,
    *,
    layout: Optional["ReadLayout"] = None,
    split_head: bool = False,
    pipelined: bool = False,
) -> StepOut:
    """Advance every row of ``state`` (a :class:`~.framestate.FrameState`) by one frame;
    nothing is read to the host. The ids fed back are the heads' unless the row's
    :class:`~.framestate.Flags` force others (forced ids; a barge-in feeds silence until BOS).
    ``layout``: pack the frame's words for its one host read into ``StepOut.words``.
    ``split_head``: on the CPU, half of a big text head on :func:`head_stream` (same id).
    ``pipelined``: the caller queues the next frame before reading this one (offline), so the
    speech (``StepOut.speech``) is left for it to schedule."""
    out, parts = StepOut(), {}
    projected, encoded = _listen(model, state, heard)
    if state.llm is not None:
        if state.prefix is not None and state.rows != 1:
            raise ValueError("only a single conversation's first frame has a prompt to prefill")
        parts["quiet"] = state.flags.quiet.astype(mx.int32)  # the flag the frame runs with
        text, out.ids = _think(model, state, projected, split_head)
        # Scheduled before the speech is queued (queuing it can take as long as it runs): the
        # function head runs beside the speech.
        mx.async_eval(out.ids)
        out.codes = _speak(model, state, text)
        parts["ids"] = out.ids
        out.speech = _decode(model, state, out.codes, parts)
        if not pipelined:
            with mx.stream(speech_stream()):
                mx.async_eval(*out.speech)
        state.position = [p + 1 for p in state.position]
    if state.rnnt is not None:  # beside the speech
        parts["labels"] = _rnnt_symbols(model, state, encoded)
        if pipelined:
            mx.async_eval(parts["labels"])
    state.frames = [f + 1 for f in state.frames]
    if layout is not None:
        out.words = layout.pack(**parts)
    return out


def prefill(model, state, rows: int) -> None:
    """Run the first ``rows`` of a fresh conversation's prompt rows through the LLM now; the
    rest enter with its first frame (a server takes a long prompt in slices between rounds, so
    the other conversations wait for a slice, not the whole prompt). Leaves it queued."""
    if state.prefix is None or state.rows != 1:
        raise ValueError("only a single conversation before its first frame has prompt rows")
    head, rest = state.prefix[:, :rows], state.prefix[:, rows:]
    model.stt_model.llm(head, state.llm)
    state.prefix = rest if rest.shape[1] else None


def _listen(model, state, heard: Listening):
    """The frame's projected rows and encoder rows: from each row's mel window on its own
    encoder context (which advances), or as heard already."""
    if isinstance(heard, mx.array):
        return heard, None
    stt = model.stt_model
    encoder = stt.perception.encoder
    dtype = encoder.pre_encode.out.weight.dtype
    xs = []
    for mel, j in heard:
        x, _ = encoder.pre_encode(mel[None].astype(dtype))
        xs.append(x[:, j : j + 1])
    x = xs[0] if len(xs) == 1 else mx.concatenate(xs, axis=0)
    encoded, state.encoder.rows = encoder.step_rows(x, state.encoder.rows)
    projected = stt.perception.proj(encoded) if state.llm is not None else None
    # The encoder starts on the device while the host builds the rest of the frame.
    mx.async_eval(encoded if projected is None else projected)
    return projected, encoded


def _rnnt_symbols(model, state, encoded: mx.array) -> mx.array:
    """The listening part's RNNT: the greedy symbols of the frame's encoder rows ``encoded``
    ``[B, 1, D]`` (``[B, steps]``, blank-padded), on the device; advances ``state.rnnt``."""
    rnnt = state.rnnt
    enc = model.stt_model.rnnt_joint.project_encoder(encoded[:, 0])
    labels, rnnt.h, rnnt.c, rnnt.pred = model.rnnt_frames(enc, rnnt.h, rnnt.c, rnnt.pred)
    return labels


def _think(model, state, rows: mx.array, split_head: bool):
    cfg = model.config
    stt = model.stt_model
    w = cfg.function_channel_weight
    B = state.rows
    flags = state.flags
    prev = stt.embed_tokens(state.last.ids)  # [B, 2, H]: text, function
    text_row = prev[:, 0:1]
    row = text_row + rows.reshape(B, 1, -1).astype(text_row.dtype)
    row = row + w * prev[:, 1:2]
    if state.prefix is not None:
        row = mx.concatenate([state.prefix.astype(row.dtype), row], axis=1)
        state.prefix = None
    h = stt.llm(row, state.llm)[:, -1:]
    split = head_stream() if split_head and should_split(stt.lm_head) else None
    text = greedy_id(stt.lm_head, h, split)
    silence = mx.array(cfg.silence_token_id, dtype=mx.int32)
    text = mx.where(flags.quiet & (text != cfg.bos_token_id), silence, text)
    text = mx.where(flags.force_text != NO_ID, flags.force_text, text)
    # MLX signals an array to other streams when the whole eval it belongs to is done: the
    # text id gets an eval of its own, so speech queued on it does not wait for the function
    # head (and that head runs beside the speech).
    mx.async_eval(text)
    function = greedy_id(stt.function_head, h)
    function = mx.where(flags.force_function != NO_ID, flags.force_function, function)
    state.last.ids = ids = mx.stack([text, function], axis=1)
    # The barge-in goes on until the text id fed back is BOS; forced ids are used once.
    flags.quiet = flags.quiet & (text != cfg.bos_token_id)
    flags.force_text = flags.force_function = mx.full((B,), NO_ID, mx.int32)
    return text, ids


def _speak(model, state, text: mx.array) -> mx.array:
    """The frame's code frames ``[B, Q]``, built on :func:`speech_stream` and left for the
    caller to schedule (on the CPU, scheduling a long chain of small ops returns only when
    most of it has run: the caller first queues what should run beside it)."""
    if state.position == [0]:
        # errata 11: position 0 has no TTS step; it sounds like silence.
        silence = model.tts_model.codec_silence_tokens
        return silence.reshape(1, -1).astype(mx.int32)
    if 0 in state.position:
        raise ValueError("a conversation's position 0 runs alone (it has no TTS step)")
    with mx.stream(speech_stream()):
        return speak(model, state, text)


def speak(model, state, text) -> mx.array:
    """The speech part of the step: one TTS step of every row on ``text`` (ids ``[B]``, or an
    int for one conversation: a prompt position's pad id), from and into ``state.last.code``."""
    speech = model.tts_model
    codes, state.tts = speech.tts_model.step(
        text, state.last.code, state.tts, state.noise, speech.codec_silence_tokens
    )
    state.last.code = codes
    return codes


def _decode(model, state, codes: mx.array, parts: dict) -> List[mx.array]:
    """The codec's frame of speech (when the state decodes per frame), into ``parts``; returns
    what the speech stream computes."""
    if state.codec is None:
        return [codes]
    speech = model.tts_model
    codec = speech.audio_codec
    with mx.stream(speech_stream()):
        codes = replace_control_codes(codes, speech.control_codes, speech.codec_silence_tokens)
        wave, state.codec = codec.decode_step(codes[:, None], state.codec)
        parts["audio"] = wave.astype(mx.float32)
        parts["tail"] = codec.decode_flush(state.codec).astype(mx.float32)
    parts["codes"] = codes
    return [parts["audio"], codes]


# --- the frame's one host read ------------------------------------------------------------


@dataclass
class FrameRead:
    """One row's share of a frame's host read (None: a part the layout leaves out)."""

    text_id: Optional[int] = None
    function_id: Optional[int] = None
    quiet: bool = False  # a barge-in held when the frame ran
    labels: List[int] = field(default_factory=list)  # the RNNT's tokens of the frame
    codes: Optional[np.ndarray] = None  # [Q] int32, after control-code replacement
    audio: Optional[np.ndarray] = None  # [samples_per_frame] float32
    tail: Optional[np.ndarray] = None  # [stream_delay] float32: the codec's last samples


class ReadLayout:
    """The int32 words of a row of a frame's read, part by part (float32 audio as its bits):
    ``think`` the ids and the barge-in flag, ``listen`` the RNNT's labels, ``speak`` the
    codes, the audio and the codec's tail (a state that decodes per frame)."""

    def __init__(self, model, *, listen: bool = True, think: bool = True, speak: bool = True):
        codec = model.tts_model.audio_codec
        self.blank = model.stt_model.rnnt_joint.blank_id
        parts = (
            ("ids", 2, think),
            ("quiet", 1, think),
            ("labels", model.rnnt_frames.steps, listen),
            ("codes", model.config.tts_config.num_quantizers, speak),
            ("audio", codec.samples_per_frame, speak),
            ("tail", codec.stream_delay, speak),
        )
        self.parts = tuple((name, n) for name, n, on in parts if on)
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
        return words[0] if len(words) == 1 else mx.concatenate(words, axis=1)

    def unpack(self, row: np.ndarray) -> FrameRead:
        at, out = 0, {}
        for name, n in self.parts:
            out[name], at = row[at : at + n], at + n
        read = FrameRead()
        if "ids" in out:
            read.text_id, read.function_id = int(out["ids"][0]), int(out["ids"][1])
            read.quiet = bool(out["quiet"][0])
        if "labels" in out:
            read.labels = [int(k) for k in out["labels"] if k != self.blank]
        if "codes" in out:
            read.codes = out["codes"].astype(np.int32)
            read.audio, read.tail = out["audio"].view(np.float32), out["tail"].view(np.float32)
        return read


def read(words: mx.array) -> np.ndarray:
    """The one host read of a frame's words."""
    return np.array(words.tolist(), dtype=np.int32)


# --- streams ------------------------------------------------------------------------------


def _thread_stream(registry: threading.local) -> mx.Stream:
    """The calling thread's stream of ``registry`` on the default device, made on first use:
    MLX streams belong to the thread that made them."""
    device = mx.default_device()
    key = str(device)
    streams = vars(registry).setdefault("by_device", {})  # the calling thread's own
    stream = streams.get(key)
    if stream is None:
        note_mlx_thread()
        stream = streams[key] = mx.new_stream(device)
    return stream


_SPEECH_STREAMS = threading.local()
_HEAD_STREAMS = threading.local()


def speech_stream() -> mx.Stream:
    """The stream the TTS half of every frame runs on, beside the next frame's LLM: a second
    stream on the default device, one per thread (MLX streams belong to their thread)."""
    return _thread_stream(_SPEECH_STREAMS)


def head_stream() -> mx.Stream:
    """The stream the second half of a split text head runs on (``fastpaths.heads``): a third
    stream, one per thread and device, so the half does not queue behind the speech."""
    return _thread_stream(_HEAD_STREAMS)
