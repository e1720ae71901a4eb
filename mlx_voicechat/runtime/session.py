"""The streaming session: talk to the model as audio arrives, one 80 ms frame at a time.

``Session.feed`` turns whatever audio has arrived into the frames that are now final and runs
the same per-frame step as offline generation (``duplex.think`` / ``duplex.speak``) on each,
returning one :class:`FrameEvent` per frame: the ids, the deltas of the assistant's text, the
function channel and the user's words, the turn marks and 1764 samples of speech. For any
chunking of the input the events equal :func:`generate.generate` on the same samples (ids, codes
and transcript identical; audio equal after the codec's fixed 6-sample delay).

Latency: frame ``k`` is computed by the ``feed`` that completes sample ``1280 k + 198`` (see
``frontend``). Its RNNT tokens come out with the frame's host read (a second token of the same
frame with the next one: ``frontend.RNNTStream``), and its audio lags the offline waveform by
the codec's 6 samples (0.27 ms).

Host reads: one per frame. The TTS reads the frame's text id on the device, so a frame's LLM,
speech and codec are queued as one graph, and its read carries the two ids, the RNNT labels,
its codes and its audio. When a ``feed`` completes several frames, each frame is queued before
the previous one is read; a barge-in is therefore a device flag carried from frame to frame,
so that frames queued before the host has read the one that ends it follow it exactly.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence

import mlx.core as mx
import numpy as np

from ..errors import VoiceChatError
from ..nets.codec import replace_control_codes
from ..noise import NoiseSource
from . import duplex
from .events import FrameEvent, _fill, _output_parts, _read
from .frontend import RNNTStream, StreamingPerception
from .state import _cache_arrays, memory_per_minute, open_state
from .textstream import TextStream, TranscriptStream
from .tools import ToolError, ToolResultQueue, prepare_tools, tool_result_ids


class SessionError(VoiceChatError, ValueError):
    """A call a session cannot take: bad audio, a closed or finished session."""


# --- the session ----------------------------------------------------------------------------


class Session:
    """One conversation: see the module docstring. Use it from one thread at a time (any
    thread); two sessions of one model may run in two threads."""

    def __init__(
        self,
        model,
        system_prompt: Optional[str] = None,
        *,
        seed: int = 0,
        noise: Optional[NoiseSource] = None,
        prompt: Optional[Sequence[int]] = None,
        max_seconds: Optional[float] = None,
        tools: Optional[Sequence[Any]] = None,
    ):
        self.model = model
        cfg = model.config
        self.config = cfg
        self.seed = duplex.check_seed(seed)
        self._noise = noise
        if tools and prompt is not None:
            raise SessionError(
                "tools are rendered into the system prompt text: pass system_prompt with "
                "tools, not prompt ids"
            )
        if prompt is None:
            system_prompt = duplex.resolve_system_prompt(system_prompt)
        system_prompt, self.tools, self._parser = prepare_tools(model, system_prompt, tools, self.seed)
        if prompt is not None:
            self.prompt_ids = duplex.check_prompt_ids(model, prompt)
        else:
            self.prompt_ids = duplex.prompt_ids(model, system_prompt)
        limit = cfg.text_args.max_position_embeddings - len(self.prompt_ids)
        if limit < 1:
            raise SessionError(
                f"the system prompt is {len(self.prompt_ids)} tokens; the LLM's context is "
                f"{cfg.text_args.max_position_embeddings} positions and the audio needs at least one"
            )
        if max_seconds is not None:
            number = isinstance(max_seconds, (int, float)) and not isinstance(max_seconds, bool)
            if not number or not np.isfinite(max_seconds) or max_seconds <= 0:
                raise SessionError(f"max_seconds must be a positive number, got {max_seconds!r}")
            limit = min(limit, max(1, int(max_seconds / cfg.frame_duration)))
        self.max_frames = limit
        self.input_sample_rate = cfg.input_sample_rate
        self.output_sample_rate = cfg.output_sample_rate
        speech = model.tts_model
        self.samples_per_frame = speech.audio_codec.samples_per_frame
        self.input_samples_per_frame = cfg.input_samples_per_frame
        stt = model.stt_model
        self._frontend = StreamingPerception(stt.perception)
        self._rnnt = RNNTStream(
            stt.rnnt_decoder, stt.rnnt_joint, stt.rnnt_joint.blank_id, cfg.audio_config.max_symbols
        )
        self._resamplers = {}
        self._closed = False
        self._start()

    # -- state -----------------------------------------------------------------------------

    def _start(self) -> None:
        cfg = self.config
        self._cache = open_state(self.model, self.prompt_ids, self.seed, self._noise)
        self._frontend.reset()
        self._rnnt.reset()
        codec = self.model.tts_model.audio_codec
        codec.prepare_fast_step()  # so that no frame makes its own host sync for it
        self._codec_cache = codec.make_decode_cache()
        self._text = TextStream(self.model, cfg)
        self._function = TextStream(self.model, cfg)
        self._transcript = TranscriptStream(self.model.rnnt_vocabulary)
        self._rows: Optional[mx.array] = None  # projected rows not yet run, [1, n, H]
        self._encoded: Optional[mx.array] = None  # their encoder rows, for the RNNT, [1, n, D]
        self.frames = 0  # frames handed out
        self._queued = 0  # frames queued on the device
        self.speaking = False
        # Barge-in: a device flag carried from frame to frame (see _override), so that frames
        # queued before the host has read the one that ends it follow it exactly.
        self._quiet_flag: Optional[mx.array] = None
        self._cancels = 0
        self._forced: List[tuple] = []  # queued (text_id or None, function_id or None)
        self._results = ToolResultQueue()
        self._calls = self._parser
        if self._calls is not None:
            self._calls.reset()
        self.tool_frames = 0  # frames whose function id was a tool result's token
        self._finished = None  # why the session stopped taking input
        self._resamplers.clear()
        self.transcript_tokens: List[int] = []
        self._settle()

    def _settle(self) -> None:
        """Schedule every array the next call will read: an array left lazy belongs to the
        streams of the thread that made it, and the next call may come from another thread."""
        c = self._cache
        arrays = [c.prev_ids, c.text_id, c.previous_code, getattr(c.noise, "key", None), c.prefix]
        arrays += [self._rows, self._encoded, self._quiet_flag]
        arrays += [a for cache in c.llm + c.tts for a in _cache_arrays(cache)]
        arrays += self._frontend.arrays() + self._rnnt.arrays()
        arrays += [self._codec_cache.ola_tail, self._codec_cache.envelope_tail]
        arrays += list(self._codec_cache.conv_tails)
        mx.async_eval(*[a for a in arrays if isinstance(a, mx.array)])

    def reset(self) -> None:
        """Back to the state right after the system prompt (a new conversation)."""
        self._check_open()
        self._start()

    def close(self) -> None:
        self._closed = True
        self._rows = self._encoded = None

    def _check_open(self) -> None:
        if self._closed:
            raise SessionError("the session is closed")

    def _check_input(self) -> None:
        self._check_open()
        if self._finished is not None:
            raise SessionError(
                f"the session has ended ({self._finished}); call reset() to start a new conversation"
            )

    @property
    def pending_samples(self) -> int:
        """16 kHz samples received that are not yet part of an emitted frame."""
        return max(self._frontend.received - self.frames * self.input_samples_per_frame, 0)

    def samples_needed(self, k: int) -> int:
        """16 kHz samples that must have arrived for frame ``k`` to be computed (1280 k + 199)."""
        return self._frontend.samples_needed(k)

    @property
    def ready_before_slot_end(self) -> int:
        """How many samples before the end of its 80 ms slot a frame is computed (1081)."""
        return self.input_samples_per_frame - self._frontend.samples_needed(0)

    @property
    def finished(self) -> Optional[str]:
        return self._finished

    # -- control -----------------------------------------------------------------------------

    def cancel(self) -> None:
        """Barge-in: from the next frame the text channel is fed the silence id (so nothing is
        spoken) until the model starts a new turn (its text head gives BOS)."""
        self._check_open()
        self._quiet_flag = mx.array([True])
        self._cancels += 1

    def force(self, text_id: Optional[int] = None, function_id: Optional[int] = None) -> None:
        """Queue ids to feed back on the next frame instead of the heads' (None: the head's)."""
        self._check_open()
        vocab = self.config.text_args.vocab_size
        for v in (text_id, function_id):
            ok = isinstance(v, (int, np.integer)) and not isinstance(v, bool) and 0 <= int(v) < vocab
            if v is not None and not ok:
                raise SessionError(f"forced ids must be ints in [0, {vocab}), got {v!r}")
        self._forced.append((text_id, function_id))

    def add_tool_result(self, call_id: str, output: Any) -> int:
        """Queue a tool's result for the call ``call_id``; from the next frame on it is fed to
        the model one token per frame on the function channel (the text channel gets pad, so
        nothing is spoken meanwhile). Returns how many frames it takes."""
        self._check_open()
        if self._calls is None:
            raise ToolError("this session has no tools; open it with model.session(..., tools=[...])")
        ids = tool_result_ids(self.model.tokenizer, output)
        self._results.add(call_id, ids)
        return len(ids)

    def _next_forced(self) -> tuple:
        """(text, function, from a tool result) for the next frame; None: the head's id."""
        if self._forced:
            return self._forced.pop(0) + (False,)
        token = self._results.next_forced()
        if token is not None:
            self.tool_frames += 1
            return self.config.pad_token_id, token, True
        return None, None, False

    def _override(self, text, function) -> Optional[Callable]:
        """``duplex.think``'s override for the next frame: text id -> (the text id fed back,
        the map of the function id), so the speech waits only for the text head. During a
        barge-in the head's text id becomes the silence id unless it is BOS, which ends it."""
        cfg = self.config
        quiet = self._quiet_flag
        if quiet is None and text is None and function is None:
            return None
        forced_text = None if text is None else mx.array([text], dtype=mx.int32)
        forced_function = None if function is None else mx.array([function], dtype=mx.int32)
        bos, silence = cfg.bos_token_id, mx.array([cfg.silence_token_id], dtype=mx.int32)

        def fix_function(f):
            return f if forced_function is None else forced_function

        def run(t):
            if forced_text is not None:
                return forced_text, fix_function
            if quiet is not None:
                t = mx.where(quiet & (t != bos), silence, t)
            return t, fix_function

        return run

    # -- input ---------------------------------------------------------------------------------

    def _samples(self, samples, sample_rate) -> np.ndarray:
        if sample_rate is not None:
            if isinstance(sample_rate, bool) or not isinstance(sample_rate, (int, np.integer)) or sample_rate <= 0:
                raise SessionError(f"sample_rate must be a positive integer, got {sample_rate!r}")
        if isinstance(samples, mx.array):
            samples = np.array(samples)
        x = np.asarray(samples)
        if x.dtype == object or not (np.issubdtype(x.dtype, np.number) or x.dtype == bool):
            raise SessionError(f"audio samples must be numbers, got an array of {x.dtype}")
        if x.ndim == 2 and 1 in x.shape:
            x = x.reshape(-1)
        if x.ndim != 1:
            raise SessionError(
                f"feed takes mono samples as a 1-D array, got shape {tuple(x.shape)}"
            )
        if np.issubdtype(x.dtype, np.integer):
            info = np.iinfo(x.dtype)
            x = x.astype(np.float32) / float(max(abs(info.min), info.max))
        else:
            x = x.astype(np.float32)
            if x.size and not np.isfinite(x).all():
                raise SessionError("audio samples must be finite (got NaN or infinity)")
        rate = self.input_sample_rate
        if sample_rate is not None and int(sample_rate) != rate and x.size:
            x = self._resample(x, int(sample_rate))
        return x

    def _resample(self, x: np.ndarray, source: int) -> np.ndarray:
        try:
            import soxr
        except ImportError:  # pragma: no cover - soxr is a dependency
            raise SessionError("resampling needs python-soxr (pip install soxr)") from None
        stream = self._resamplers.get(source)
        if stream is None:
            stream = self._resamplers[source] = soxr.ResampleStream(
                source, self.input_sample_rate, 1, dtype="float32"
            )
        return stream.resample_chunk(x)

    def feed(self, samples, sample_rate: Optional[int] = None) -> List[FrameEvent]:
        """Add mono audio (int or float PCM, at 16 kHz or ``sample_rate``); returns the events of
        every frame that became final with it."""
        self._check_input()
        x = self._samples(samples, sample_rate)
        out = self._frontend.push(x)
        return self._run(out)

    def silence(self, frames: int) -> List[FrameEvent]:
        """Advance the clock by ``frames`` 80 ms frames of silent input."""
        if isinstance(frames, bool) or not isinstance(frames, (int, np.integer)) or frames < 0:
            raise SessionError(f"silence takes a number of frames >= 0, got {frames!r}")
        self._check_input()
        return self._run(self._frontend.push(np.zeros(int(frames) * self.input_samples_per_frame, np.float32)))

    def finish(self, extra_decoding_seconds: float = 3.0) -> List[FrameEvent]:
        """End of the user's input: ``extra_decoding_seconds`` of trailing silence so the reply
        can finish, the frames that the end of input makes final, and the codec's tail."""
        self._check_input()
        try:
            extra = float(extra_decoding_seconds)
        except (TypeError, ValueError):
            raise SessionError(
                f"extra_decoding_seconds must be a number, got {extra_decoding_seconds!r}"
            ) from None
        if not np.isfinite(extra) or extra < 0:
            raise SessionError(f"extra_decoding_seconds must be finite and >= 0, got {extra}")
        rate = self.input_sample_rate
        room = (self.max_frames - self.frames + 1) * self.input_samples_per_frame
        pad = min(int(round(extra * rate)), max(room, 0))
        for resampler in self._resamplers.values():  # what the resamplers still hold
            tail = resampler.resample_chunk(np.zeros(0, np.float32), last=True)
            if tail.size:
                self._frontend.push(tail)
        self._resamplers.clear()
        events = self._run(self._frontend.push(np.zeros(pad, np.float32)))
        if self._finished is None:
            final = self._run(self._frontend.finish(), last=True)
            if not final and self.frames and self._finished is None:
                final = [self._remainder()]  # the last frame went out with an earlier call
            events += final
            if self._finished is None:
                self._finished = "finished"
        return events

    def _remainder(self) -> FrameEvent:
        """The end of the stream when no frame is left to carry it (see FrameEvent.remainder)."""
        codec = self.model.tts_model.audio_codec
        tail = codec.decode_flush(self._codec_cache)[0].astype(mx.float32)
        text_id, function_id = self._last_ids
        event = FrameEvent(
            self.frames - 1, text_id, function_id, np.zeros(0, np.int32), None, remainder=True
        )
        event.audio = _read(mx.view(tail, mx.int32)).view(np.float32)
        event.speaking = self.speaking
        self._end_of_stream(event)
        return event

    def _end_of_stream(self, event: FrameEvent) -> None:
        """What the streams still hold goes on the last event: RNNT tokens, a held-back
        character, an unfinished tool call."""
        self._drain_rnnt(event)
        event.text += self._text.flush()
        event.function_text += self._function.flush()
        if self._calls is not None:
            unfinished = self._calls.close()
            if unfinished:
                event.errors.append(unfinished)

    # -- the frame loop --------------------------------------------------------------------------

    def _run(self, rows, last: bool = False) -> List[FrameEvent]:
        """Queue every frame ``rows`` completes and hand out their events: each frame's graph
        (LLM, speech, codec) is queued before the previous frame is read (``last``: the end
        of the stream, whose last frame carries the codec's tail)."""
        events: List[FrameEvent] = []
        if rows is not None:
            projected, encoded = rows
            # The encoder starts on the device while the host builds the frames' graphs.
            mx.async_eval(projected, encoded)
            if self._rows is None:
                self._rows, self._encoded = projected, encoded
            else:
                self._rows = mx.concatenate([self._rows, projected], axis=1)
                self._encoded = mx.concatenate([self._encoded, encoded], axis=1)
        held = None  # the frame queued last, not read yet
        while self._rows is not None and self._rows.shape[1] > 0 and self._finished is None:
            frame = self._queue()
            if held is not None:
                events.append(self._hand_out(held, tail=False))
            held = frame
        if held is not None:
            events.append(self._hand_out(held, tail=last or held["ends"]))
        self._settle()
        return events

    def _queue(self) -> dict:
        """Queue the next frame's LLM, speech and codec on the device; no host read."""
        model = self.model
        speech = model.tts_model
        codec = speech.audio_codec
        row = self._rows[:, :1]
        self._rows = self._rows[:, 1:]
        # The RNNT sees a frame with the frame, so a word is never reported before its frame.
        self._rnnt.push(self._encoded[:, :1])
        self._encoded = self._encoded[:, 1:]
        text_force, function_force, injected = self._next_forced()
        quiet = self._quiet_flag
        ids = duplex.think(
            model, self._cache, row, self._override(text_force, function_force), split_head=True
        )
        if quiet is not None:  # the barge-in goes on until the text id fed back is BOS
            self._quiet_flag = quiet & (self._cache.text_id != self.config.bos_token_id)
        mx.async_eval(ids)  # the LLM and the function head run while the speech is built
        # The TTS reads the text id on the device, so the frame's speech is queued before the
        # host has seen its ids.
        codes = duplex.speak(model, self._cache, self._cache.text_id, self._cache.position)
        self._cache.position += 1
        with mx.stream(duplex.speech_stream()):
            codes = replace_control_codes(codes, speech.control_codes, speech.codec_silence_tokens)
            wave, self._codec_cache = codec.decode_step(codes[None], self._codec_cache)
            audio = wave[0].astype(mx.float32)
            mx.async_eval(audio, codes)
        index = self._queued
        self._queued += 1
        ends = self._queued >= self.max_frames
        if ends:
            self._finished = "max_seconds"
        host_forced = text_force is not None or function_force is not None
        return {
            "index": index, "ids": ids, "codes": codes, "audio": audio, "quiet": quiet,
            "cancels": self._cancels, "forced": host_forced, "injected": injected, "ends": ends,
        }

    def _hand_out(self, frame: dict, tail: bool) -> FrameEvent:
        """The frame's one host read (its ids, whether a barge-in held, the RNNT labels, its
        codes and audio; with ``tail`` the codec's last samples) and its event."""
        Q = self.config.tts_config.num_quantizers
        k = frame["index"]
        # The RNNT labels read with frame k cover frames up to k (a word is never reported
        # before its frame): queued by the previous hand-out when frame k was queued by then.
        labels = self._rnnt.pending
        if labels is None:
            labels = self._rnnt.queue(upto=k + 1)
        n_labels = 0 if labels is None else labels.shape[0]
        audio = frame["audio"]
        if tail:  # no later frame has been queued: the codec's state is this frame's
            codec = self.model.tts_model.audio_codec
            audio = mx.concatenate([audio, codec.decode_flush(self._codec_cache)[0].astype(mx.float32)])
        quiet = frame["quiet"]
        parts = [frame["ids"], (mx.zeros(1, mx.int32) if quiet is None else quiet.astype(mx.int32))]
        parts += ([labels] if labels is not None else []) + _output_parts(frame["codes"], audio)
        read = _read(mx.concatenate(parts))  # the frame's one host read
        text_id, function_id, quiet = int(read[0]), int(read[1]), bool(read[2])
        tokens = self._rnnt.advance(read[3 : 3 + n_labels].tolist()) if n_labels else []
        if self._queued > k + 1:  # the next frame is queued: its labels ride on its read
            self._rnnt.queue(upto=k + 2)
        event = FrameEvent(frame["index"], text_id, function_id, None, None)
        event.forced = frame["forced"] or quiet
        _fill(event, read[3 + n_labels :], Q)
        ended = quiet and text_id == self.config.bos_token_id
        if ended and frame["cancels"] == self._cancels:
            self._quiet_flag = None  # over for every frame queued since
        self._annotate(event, tokens, quiet and not ended)
        if self._calls is not None and not frame["injected"]:
            event.tool_calls, event.errors = self._calls.feed(function_id)
            for call in event.tool_calls:
                self._results.expect(call.call_id)
        self.frames += 1
        if frame["ends"]:
            event.end = "max_seconds"
        self._last_ids = (text_id, function_id)
        if tail:
            self._end_of_stream(event)
        return event

    def _drain_rnnt(self, event: FrameEvent) -> None:
        """At the end of input: the RNNT tokens still to come go on the last event."""
        while not self._rnnt.done:
            labels = self._rnnt.queue()
            self._add_tokens(event, self._rnnt.advance(labels.tolist()))

    def _add_tokens(self, event: FrameEvent, tokens) -> None:
        for token, _frame in tokens:
            self.transcript_tokens.append(token)
            event.transcript += self._transcript.add(token)

    def _annotate(self, event: FrameEvent, tokens, quiet: bool) -> None:
        """Deltas and turn marks; ``quiet``: a barge-in holds after this frame."""
        cfg = self.config
        self._add_tokens(event, tokens)
        t = event.text_id
        event.text = self._text.add(t)
        event.function_text = self._function.add(event.function_id)
        if not self.speaking and t not in (cfg.pad_token_id, cfg.silence_token_id, cfg.eos_token_id):
            self.speaking, event.turn = True, "start"
        elif self.speaking and (t == cfg.eos_token_id or quiet):
            self.speaking, event.turn = False, "end"
        event.speaking = self.speaking or event.turn == "end"

    # -- facts ---------------------------------------------------------------------------------

    def memory_per_minute(self) -> dict:
        """Bytes a session's caches grow by per minute of conversation (see the README)."""
        return memory_per_minute(self.model)
