"""The one frame step: every row of a frame state advanced by one 80 ms input frame.

:func:`step` is what offline generation pipelines, what a live session (a batch of one or
more conversations) queues, and what the tests call; nothing else advances a frame state's
position. It takes the perception rows of the frame (projected encoder frames) and returns the
frame's ``[text, function]`` ids and code frame per row, left on the device.

Timeline (spec "Offline timeline loop", errata 10-12): the system prompt ``[bos] + ids + [eos]``
takes the first ``P`` timeline positions on the audio channel; audio frame ``i`` is timeline
position ``P + i``. A fresh conversation's prompt rows and its first audio frame are prefilled
in one LLM call. The TTS speaks at every position ``t >= 1`` (prompt positions with the pad
id, see :func:`~.framestate.start_state`); position 0 is never spoken: without a prompt, audio
frame 0 gets the codec's silence codes.

Within a frame the LLM and its heads run on the default stream and the speech on
:func:`speech_stream`, reading the text id on the device: the frame needs no host read before
its speech, and its speech runs beside the next frame's LLM. The step schedules the ids (the
text id first); the codes are left to the caller to schedule, after whatever should run beside
them has been queued (offline: the next frame's LLM).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import mlx.core as mx

from ..nets.heads import greedy_id, should_split
from .framestate import NO_ID, FrameState
from .threads import note_mlx_thread


@dataclass
class StepOut:
    ids: mx.array  # [B, 2] int32: each row's text and function id
    codes: mx.array  # [B, Q] int32: each row's code frame


def step(model, state: FrameState, rows: mx.array, *, split_head: bool = False) -> StepOut:
    """Advance every row of ``state`` by one frame; ``rows`` ``[B, 1, H]`` (each row's
    projected perception frame). Nothing is read to the host.

    The ids fed back are the heads' unless the row's flags force others: a forced id
    (:meth:`FrameState.flags`, a tool result's token, ``Session.force``), or, during a
    barge-in, the silence id instead of the text head's id until that id is BOS (which ends
    it). ``split_head``: on the CPU, run half of a big text head on :func:`head_stream` (the
    same id, ``nets.heads``): a live frame has nothing else to run beside its text head."""
    B = state.rows
    if state.prefix is not None and B != 1:
        raise ValueError("only a single conversation's first frame has a prompt to prefill")
    text, ids = _think(model, state, rows, split_head)
    # Scheduled before the speech is queued (queuing it can take as long as it runs): the
    # function head runs beside the speech.
    mx.async_eval(ids)
    codes = _speak(model, state, text)
    state.position = [p + 1 for p in state.position]
    state.frames = [f + 1 for f in state.frames]
    return StepOut(ids, codes)


def prefill(model, state: FrameState, rows: int) -> None:
    """Run the first ``rows`` of a fresh conversation's prompt rows through the LLM now; the
    rest enter with its first frame (a server takes a long prompt in slices between rounds, so
    the other conversations wait for a slice, not the whole prompt). Leaves it queued."""
    if state.prefix is None or state.rows != 1:
        raise ValueError("only a single conversation before its first frame has prompt rows")
    head, rest = state.prefix[:, :rows], state.prefix[:, rows:]
    model.stt_model.llm(head, state.llm)
    state.prefix = rest if rest.shape[1] else None


def _think(model, state: FrameState, rows: mx.array, split_head: bool):
    cfg = model.config
    stt = model.stt_model
    w = cfg.function_channel_weight
    B = state.rows
    prev_ids, _, previous_code = state.ids.cache
    quiet, forced_text, forced_function = state.flags.cache
    prev = stt.embed_tokens(prev_ids)  # [B, 2, H]: text, function
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
    text = mx.where(quiet & (text != cfg.bos_token_id), silence, text)
    text = mx.where(forced_text != NO_ID, forced_text, text)
    # MLX signals an array to other streams when the whole eval it belongs to is done: the
    # text id gets an eval of its own, so speech queued on it does not wait for the function
    # head (and that head runs beside the speech).
    mx.async_eval(text)
    function = greedy_id(stt.function_head, h)
    function = mx.where(forced_function != NO_ID, forced_function, function)
    ids = mx.stack([text, function], axis=1)
    state.ids.cache[0], state.ids.cache[1] = ids, text
    # The barge-in goes on until the text id fed back is BOS; forced ids are used once.
    state.flags.cache = [quiet & (text != cfg.bos_token_id), _none(B), _none(B)]
    return text, ids


def _none(B: int) -> mx.array:
    return mx.full((B,), NO_ID, mx.int32)


def _speak(model, state: FrameState, text: mx.array) -> mx.array:
    """The frame's code frames ``[B, Q]``, built on :func:`speech_stream` and left for the
    caller to schedule (on the CPU, scheduling a long chain of small ops returns only when
    most of it has run: the caller first queues what should run beside it)."""
    speech = model.tts_model
    silence = speech.codec_silence_tokens
    if state.position == [0]:
        # errata 11: position 0 has no TTS step; it sounds like silence.
        return silence.reshape(1, -1).astype(mx.int32)
    if 0 in state.position:
        raise ValueError("a conversation's position 0 runs alone (it has no TTS step)")
    with mx.stream(speech_stream()):
        codes, state.tts = speech.tts_model.step(
            text, state.ids.cache[2], state.tts, state.noise, silence
        )
    state.ids.cache[2] = codes
    return codes


def _thread_stream(registry: threading.local) -> mx.Stream:
    """The calling thread's stream of ``registry`` on the default device, made on first use:
    MLX streams belong to the thread that made them."""
    device = mx.default_device()
    key = str(device)
    streams = getattr(registry, "by_device", None)
    if streams is None:
        streams = registry.by_device = {}
    stream = streams.get(key)
    if stream is None:
        note_mlx_thread()
        stream = streams[key] = mx.new_stream(device)
    return stream


_SPEECH_STREAMS = threading.local()
_HEAD_STREAMS = threading.local()


def speech_stream() -> mx.Stream:
    """The stream the TTS half of every frame runs on: a second stream on the default device,
    one per thread and device, so that a frame's speech runs beside the next frame's LLM (on
    the CPU, a second core). MLX streams belong to the thread that made them, so each thread
    that generates gets its own."""
    return _thread_stream(_SPEECH_STREAMS)


def head_stream() -> mx.Stream:
    """The stream the second half of a split text head runs on (``nets.heads``): a third
    stream, one per thread and device, so the half does not queue behind the speech."""
    return _thread_stream(_HEAD_STREAMS)
