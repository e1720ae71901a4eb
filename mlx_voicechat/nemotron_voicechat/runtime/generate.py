"""Offline generation: a loop over the one frame step of :mod:`.step` (:func:`run_frames`).

Two fast paths do part of the loop once for the whole input: ``offline.encoder`` (the encoder
over all the input, the RNNT's symbols after the loop) and ``offline.codec`` (the codec over
all codes after the loop); off, each frame listens and decodes in the step, as a session does.
"""

from __future__ import annotations

import functools
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Sequence, Tuple, Union

import mlx.core as mx
import numpy as np

from ... import fastpaths
from ...audio.io import AudioError, load_audio, save_wav
from ...audio.mel import MelStream
from ...errors import GenerationError, is_int
from ...listen.greedy import greedy_decode
from ...listen.rnnt import decode_pieces
from ...listen.textstream import dropped_ids
from ...noise import NoiseSource
from ...threads import note_mlx_thread
from ..nets.codec import replace_control_codes
from .framestate import FrameState, open_live, open_state
from .request import check_extra_seconds, resolve
from .step import FrameRead, Listening, ReadLayout, read, step
from .tools import calls_in


@dataclass
class GenerationResult:
    user_transcript: str
    text: str
    function_text: str
    text_ids: List[int]
    function_ids: List[int]
    codes: np.ndarray  # [frames, Q] int32, after control-code replacement
    audio: np.ndarray  # [frames * samples_per_frame] float32
    sample_rate: int
    frames: int = 0
    seconds: float = 0.0
    timings: dict = field(default_factory=dict)
    tool_calls: list = field(default_factory=list)  # ToolCall(call_id, name, arguments)
    tool_errors: list = field(default_factory=list)  # malformed calls, as messages

    def save(self, path) -> Any:
        """Write the reply as mono PCM16 WAV at ``sample_rate``."""
        return save_wav(path, self.audio, self.sample_rate)

    # mlx-audio's names for the same results (its VoiceChatOutput), as mx.array int32; each is
    # converted from the stored field once, on first access.
    @functools.cached_property
    def text_tokens(self) -> mx.array:
        """``text_ids`` as an ``mx.array`` [frames] int32."""
        return mx.array(self.text_ids, dtype=mx.int32)

    @functools.cached_property
    def function_tokens(self) -> mx.array:
        """``function_ids`` as an ``mx.array`` [frames] int32."""
        return mx.array(self.function_ids, dtype=mx.int32)

    @functools.cached_property
    def audio_tokens(self) -> mx.array:
        """``codes`` as an ``mx.array`` [frames, Q] int32."""
        return mx.array(self.codes.astype(np.int32, copy=False))

    @property
    def audio_codes(self) -> mx.array:
        """The same array as ``audio_tokens``."""
        return self.audio_tokens


def reply_text(model, ids: Sequence[int]) -> str:
    """Decode ids with pad, silence, bos and eos removed (spec step 7)."""
    drop = dropped_ids(model.config)
    keep = [int(i) for i in ids if int(i) not in drop]
    if not keep:
        return ""
    if model.tokenizer is None:
        raise GenerationError("decoding the reply text needs the model's tokenizer")
    return model.tokenizer.decode(keep, skip_special_tokens=False)


def _samples(model, audio, extra_decoding_seconds, source_rate, request, keep_frames):
    """The input samples with the trailing silence (the first frames only, with
    ``keep_frames``: the encoder is causal, so the samples past them are dropped with two
    frames of margin), and how to name them in a refusal. Audio that cannot fit in the LLM's
    context after ``request``'s prompt is refused before anything is allocated."""
    extra_decoding_seconds = check_extra_seconds(extra_decoding_seconds)
    note_mlx_thread()
    rate = model.config.input_sample_rate
    samples = load_audio(audio, rate, source_rate)
    pad = int(round(extra_decoding_seconds * rate))
    if keep_frames is not None:
        keep = (keep_frames + 2) * model.config.input_samples_per_frame
        samples = samples[:keep]
        pad = max(0, min(pad, keep - len(samples)))
    what = (
        f"the audio ({len(samples) / rate:.2f} s) and extra_decoding_seconds "
        f"({extra_decoding_seconds:g} s)"
    )
    if request is not None:
        # The encoder emits about one frame per input_samples_per_frame (one more at most).
        request.check_frames((len(samples) + pad) // model.config.input_samples_per_frame - 1, what)
    if pad:
        samples = np.concatenate([samples, np.zeros(pad, dtype=np.float32)])
    return samples, what


def _frames(model, samples, F: int, keep_frames, request, what) -> int:
    """The number of frames to run: ``F`` encoder frames, refused when none, at most
    ``keep_frames``, checked against the request's room once known."""
    if F < 1:
        raise AudioError(f"the audio is too short: {len(samples)} samples give no 80 ms frame")
    if keep_frames is not None:
        F = min(F, keep_frames)
    if request is not None:
        request.check_frames(F, what)
    return F


def listen(
    model,
    audio,
    extra_decoding_seconds: float = 0.0,
    source_rate: Optional[int] = None,
    request=None,
    keep_frames: Optional[int] = None,
):
    """The whole input through the encoder at once (the ``offline.encoder`` fast path): samples
    (+ trailing silence) -> (projected [1, F, H], encoded [1, F, D], F).

    With ``request``, audio that cannot fit in the LLM's context after its prompt is refused
    before anything is allocated, and again exactly once the frames are known;
    ``keep_frames`` keeps only the first frames."""
    args = (extra_decoding_seconds, source_rate, request, keep_frames)
    samples, what = _samples(model, audio, *args)
    projected, lengths, encoded = model.stt_model.perception(mx.array(samples)[None])
    F = _frames(model, samples, int(lengths[0].item()), keep_frames, request, what)
    return projected[:, :F], encoded[:, :F], F


def rnnt_tokens(model, encoded: mx.array, F: int):
    """The RNNT's greedy tokens of the encoder output ``encoded`` ``[1, F, D]``, on the host,
    and the frame of each."""
    stt = model.stt_model
    joint, max_symbols = stt.rnnt_joint, model.config.audio_config.max_symbols
    return greedy_decode(stt.rnnt_decoder, joint, encoded, F, joint.blank_id, max_symbols)


def _heard(model, audio, extra_decoding_seconds, source_rate, request, keep_frames):
    """Each frame's listening for the offline loop: the projected rows of the whole-input pass
    (``offline.encoder``) and its encoder output, or each frame's mel window and None (the
    step listens)."""
    args = (extra_decoding_seconds, source_rate, request, keep_frames)
    if fastpaths.enabled("offline.encoder"):
        projected, encoded, F = listen(model, audio, *args)
        return [projected[:, i : i + 1] for i in range(F)], encoded
    samples, what = _samples(model, audio, *args)
    mel = MelStream(model.stt_model.perception)
    mel.push(samples)
    mel.finish()
    F = _frames(model, samples, mel.ready, keep_frames, request, what)
    return [[mel.window()] for _ in range(F)], None


#: How many frames are queued ahead of the host in :func:`run_frames`.
LOOKAHEAD = 2


def run_frames(
    model,
    state: FrameState,
    frames: Union[mx.array, Sequence[Listening]],
    progress: Optional[Callable[[int, int], None]] = None,
) -> Tuple[List[Tuple[int, int]], List[mx.array], List[FrameRead]]:
    """The frame step over every frame of ``frames`` (each frame's listening, or projected
    rows ``[1, F, H]``), each read ``LOOKAHEAD`` frames after it is queued, its speech
    scheduled beside the next frame's LLM. Returns the ``(text, function)`` ids, the code
    frame ``[1, Q]`` and the read of each frame."""
    if isinstance(frames, mx.array):
        frames = [frames[:, i : i + 1] for i in range(frames.shape[1])]
    layout = ReadLayout(model, listen=state.rnnt is not None, speak=state.codec is not None)
    F = len(frames)
    reads: List[FrameRead] = []
    codes: List[mx.array] = []
    pending: deque = deque()
    speech: List[mx.array] = []
    for i, heard in enumerate(frames):
        out = step(model, state, heard, layout=layout, pipelined=True)
        if speech:
            mx.async_eval(*speech)  # the previous frame's speech, beside this frame's LLM
        speech = out.speech
        pending.append(out.words)
        codes.append(out.codes)
        if len(pending) > LOOKAHEAD:
            reads.append(layout.unpack(read(pending.popleft())[0]))  # a frame's one host read
        if progress is not None:
            progress(i + 1, F)
    if speech:
        mx.async_eval(*speech)
    while pending:
        reads.append(layout.unpack(read(pending.popleft())[0]))
    return [(r.text_id, r.function_id) for r in reads], codes, reads


def generate(
    model,
    audio,
    system_prompt: Optional[str] = None,
    extra_decoding_seconds: float = 3.0,
    seed: int = 0,
    noise: Optional[NoiseSource] = None,
    prompt: Optional[Sequence[int]] = None,
    source_rate: Optional[int] = None,
    progress: Optional[Callable[[int, int], None]] = None,
    prompt_progress: Optional[Callable[[int, int], None]] = None,
    tools: Optional[Sequence[Any]] = None,
    max_frames: Optional[int] = None,
) -> GenerationResult:
    """The offline timeline: ``audio`` (path or array) -> text, function text, codes, reply audio.

    ``prompt`` gives the system prompt as ids directly (``[bos] + ... + [eos]``) instead of
    ``system_prompt``; ``noise`` replaces the seeded noise source; ``progress(done, total)`` is
    called after every frame, ``prompt_progress(done, total)`` after every TTS step over the
    system prompt's positions; ``max_frames`` keeps only the first frames of the audio (and
    its trailing silence). ``system_prompt=None`` is :data:`DEFAULT_SYSTEM_PROMPT`, ``""`` none.
    A model runs one call at a time, from any thread."""
    cfg = model.config
    extra_decoding_seconds = check_extra_seconds(extra_decoding_seconds)
    if max_frames is not None and (not is_int(max_frames) or max_frames < 1):
        raise GenerationError(f"max_frames must be an integer >= 1, got {max_frames!r}")
    request = resolve(model, system_prompt, prompt=prompt, tools=tools, seed=seed, noise=noise)
    frames, encoded = _heard(model, audio, extra_decoding_seconds, source_rate, request, max_frames)
    one_shot = fastpaths.enabled("offline.codec")
    state = open_state(model, request, progress=prompt_progress)
    # Without the whole-input pass, each frame listens in the step; without one_shot, it decodes.
    open_live(model, state, listen=encoded is None, decode=not one_shot)
    speech = model.tts_model
    codec = speech.audio_codec
    ids, codes, reads = run_frames(model, state, frames, progress)
    F = len(reads)
    text_ids = [t for t, _ in ids]
    function_ids = [f for _, f in ids]
    if one_shot:
        all_codes = mx.concatenate(codes, axis=0)[None]  # [1, F, Q]
        silence = speech.codec_silence_tokens
        all_codes = replace_control_codes(all_codes, speech.control_codes, silence)
        wave = codec.decode(all_codes)[0].astype(mx.float32)
        mx.eval(wave, all_codes)
        all_codes, wave = np.array(all_codes[0]), np.array(wave)
    else:
        all_codes = np.stack([r.codes for r in reads])
        wave = np.concatenate([r.audio for r in reads] + [reads[-1].tail])[codec.stream_delay :]
    if state.rnnt is None:  # offline.encoder: the whole output's symbols, by the host
        tokens, _ = rnnt_tokens(model, encoded, F)
    else:
        tokens = [k for r in reads for k in r.labels]
    transcript, _ = decode_pieces(tokens, model.rnnt_vocabulary)
    calls, call_errors = calls_in(request.parser, function_ids)
    return GenerationResult(
        user_transcript=transcript,
        text=reply_text(model, text_ids),
        function_text=reply_text(model, function_ids),
        text_ids=text_ids,
        function_ids=function_ids,
        codes=all_codes,
        audio=wave,
        sample_rate=cfg.output_sample_rate,
        frames=F,
        seconds=F * cfg.frame_duration,
        tool_calls=calls,
        tool_errors=call_errors,
    )
