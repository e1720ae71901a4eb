"""Offline generation: the whole input through the per-frame step of :mod:`.duplex`.

Perception runs once over the input (with the trailing silence), the frames run pipelined
(``duplex.run_frames``), the codec decodes all codes at once and the RNNT decodes the whole
encoder output; the result holds the three texts, the per-frame ids and codes, and the reply.
"""

from __future__ import annotations

import functools
import numbers
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Sequence

import mlx.core as mx
import numpy as np

from ..nets.codec import replace_control_codes
from ..nets.layout import use_cpu_layout
from ..nets.rnnt import decode_pieces, greedy_decode
from ..noise import NoiseSource
from .audio import AudioError, load_audio, save_wav
from .duplex import (
    GenerationError,
    check_extra_seconds,
    check_prompt_ids,
    check_seed,
    prompt_ids,
    resolve_system_prompt,
    run_frames,
    start_session,
)
from .threads import note_mlx_thread
from .tools import calls_in, prepare_tools


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
    cfg = model.config
    drop = {cfg.pad_token_id, cfg.silence_token_id, cfg.bos_token_id, cfg.eos_token_id}
    keep = [int(i) for i in ids if int(i) not in drop]
    if not keep:
        return ""
    if model.tokenizer is None:
        raise GenerationError("decoding the reply text needs the model's tokenizer")
    return model.tokenizer.decode(keep, skip_special_tokens=False)


def listen(
    model,
    audio,
    extra_decoding_seconds: float = 0.0,
    source_rate: Optional[int] = None,
    max_frames: Optional[int] = None,
    keep_frames: Optional[int] = None,
):
    """Spec steps 1-2: samples (+ trailing silence) -> (projected [1, F, H], encoded [1, F, D], F).

    ``max_frames`` bounds the frames (audio + silence) before anything is allocated;
    ``keep_frames`` keeps only the first frames (the encoder is causal: the samples past them
    are dropped before it runs, with two frames of margin)."""
    extra_decoding_seconds = check_extra_seconds(extra_decoding_seconds)
    note_mlx_thread()
    use_cpu_layout(model)
    rate = model.config.input_sample_rate
    samples = load_audio(audio, rate, source_rate)
    pad = int(round(extra_decoding_seconds * rate))
    if keep_frames is not None:
        keep = (keep_frames + 2) * model.config.input_samples_per_frame
        samples = samples[:keep]
        pad = max(0, min(pad, keep - len(samples)))
    if max_frames is not None:
        # The encoder emits about one frame per input_samples_per_frame (one more at most).
        frames = (len(samples) + pad) // model.config.input_samples_per_frame
        limit = model.config.text_args.max_position_embeddings
        prompt_tokens = limit - max_frames
        if frames > max_frames + 1:
            raise GenerationError(
                f"the system prompt ({prompt_tokens} tokens), the audio ({len(samples) / rate:.2f}"
                f" s) and extra_decoding_seconds ({extra_decoding_seconds:g} s) need about "
                f"{prompt_tokens + frames} positions; the LLM's context is {limit}"
            )
    if pad:
        samples = np.concatenate([samples, np.zeros(pad, dtype=np.float32)])
    projected, lengths, encoded = model.stt_model.perception(mx.array(samples)[None])
    F = int(lengths[0].item())
    if F < 1:
        raise AudioError(f"the audio is too short: {len(samples)} samples give no 80 ms frame")
    if keep_frames is not None:
        F = min(F, keep_frames)
    return projected[:, :F], encoded[:, :F], F


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
    if noise is None:
        seed = check_seed(seed)
    extra_decoding_seconds = check_extra_seconds(extra_decoding_seconds)
    if max_frames is not None and (
        isinstance(max_frames, bool)
        or not isinstance(max_frames, numbers.Integral)
        or max_frames < 1
    ):
        raise GenerationError(f"max_frames must be an integer >= 1, got {max_frames!r}")
    if prompt is None:
        system_prompt = resolve_system_prompt(system_prompt)
    if isinstance(prompt, (str, bytes)):
        raise GenerationError("prompt= takes token ids; pass a text prompt as system_prompt=")
    if tools and prompt is not None:
        raise GenerationError("tools are rendered into the system prompt text: pass "
                              "system_prompt with tools, not prompt ids")
    system_prompt, _, parser = prepare_tools(model, system_prompt, tools, seed if noise is None else 0)
    if prompt is not None:
        ids = check_prompt_ids(model, prompt)
    else:
        ids = prompt_ids(model, system_prompt)
    limit = cfg.text_args.max_position_embeddings
    projected, encoded, F = listen(
        model, audio, extra_decoding_seconds, source_rate, max_frames=limit - len(ids),
        keep_frames=max_frames,
    )
    if len(ids) + F > limit:
        raise GenerationError(
            f"the system prompt ({len(ids)} tokens) and the audio ({F} frames) need "
            f"{len(ids) + F} positions; the LLM's context is {limit}"
        )
    cache = start_session(model, ids, noise=noise, seed=seed, progress=prompt_progress)
    outputs, cache = run_frames(model, cache, projected, progress)
    text_ids = [o.text_id for o in outputs]
    function_ids = [o.function_id for o in outputs]
    codes = [o.codes for o in outputs]
    speech = model.tts_model
    all_codes = mx.concatenate(codes, axis=0)[None]  # [1, F, Q]
    all_codes = replace_control_codes(all_codes, speech.control_codes, speech.codec_silence_tokens)
    wave = speech.audio_codec.decode(all_codes)[0].astype(mx.float32)
    mx.eval(wave, all_codes)
    blank = model.stt_model.rnnt_joint.blank_id
    tokens, _ = greedy_decode(
        model.stt_model.rnnt_decoder, model.stt_model.rnnt_joint, encoded, F, blank,
        cfg.audio_config.max_symbols,
    )
    transcript, _ = decode_pieces(tokens, model.rnnt_vocabulary)
    calls, call_errors = calls_in(parser, function_ids)
    return GenerationResult(
        user_transcript=transcript,
        text=reply_text(model, text_ids),
        function_text=reply_text(model, function_ids),
        text_ids=text_ids,
        function_ids=function_ids,
        codes=np.array(all_codes[0]),
        audio=np.array(wave),
        sample_rate=cfg.output_sample_rate,
        frames=F,
        seconds=F * cfg.frame_duration,
        tool_calls=calls,
        tool_errors=call_errors,
    )
