"""The duplex loop: one 80 ms frame of listening, thinking and speaking per step.

A session holds every piece of state (LLM caches, TTS caches, the previous code frame, the
previous text / function ids, the noise source) in a :class:`DuplexCache`; :func:`duplex_step`
advances it by one input frame. Offline generation (:func:`generate`) is a loop over that
step; a streaming session drives the same step as frames arrive.

Timeline (spec "Offline timeline loop", errata 10-12): the system prompt ``[bos] + ids + [eos]``
takes the first ``P`` timeline positions on the audio channel; audio frame ``i`` is timeline
position ``P + i``. The prompt rows and the first audio frame are prefilled in one LLM call.
The TTS speaks at every position ``t >= 1`` (prompt positions with the pad id), but only the
audio frames are returned, so output frame ``i`` lines up with input frame ``i``. Position 0 is
never spoken: without a prompt, audio frame 0 gets the codec's silence codes.
"""

from __future__ import annotations

import math
import numbers
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence, Tuple

import mlx.core as mx

from ..errors import VoiceChatError
from ..nets.heads import greedy_id, should_split
from ..nets.layout import use_cpu_layout
from ..noise import KeyNoise, NoiseSource
from .threads import note_mlx_thread


class GenerationError(VoiceChatError, ValueError):
    """Arguments of a generation run that cannot be used."""


MAX_SEED = 2**64 - 1  # MLX keys hold 64 bits


def check_seed(seed) -> int:
    """``seed`` as an int, or a GenerationError for anything MLX cannot key with."""
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or not 0 <= seed <= MAX_SEED:
        raise GenerationError(f"seed must be an integer from 0 to 2**64 - 1, got {seed!r}")
    return int(seed)


def check_extra_seconds(seconds) -> float:
    """``extra_decoding_seconds`` as a float, or a GenerationError."""
    if (
        isinstance(seconds, bool)
        or not isinstance(seconds, numbers.Real)
        or not math.isfinite(seconds)
        or seconds < 0
    ):
        raise GenerationError(
            f"extra_decoding_seconds must be a finite number >= 0, got {seconds!r}"
        )
    return float(seconds)


def check_prompt_ids(model, prompt) -> List[int]:
    """Prompt ids as ints, each a row of the embedding table (``0 <= id < vocab_size``)."""
    vocab = model.config.text_args.vocab_size
    ids = []
    for i in prompt:
        if isinstance(i, bool) or not isinstance(i, numbers.Integral) or not 0 <= i < vocab:
            raise GenerationError(
                f"prompt id {i!r} is not a token id of this model: ids are integers from 0 to "
                f"{vocab - 1} (the vocabulary has {vocab})"
            )
        ids.append(int(i))
    return ids


# --- session state ------------------------------------------------------------------------


@dataclass
class DuplexCache:
    """Everything one conversation carries from frame to frame."""

    llm: List[Any]
    tts: List[Any]
    previous_code: mx.array  # [1, Q], the TTS input code frame
    noise: NoiseSource
    prefix: Optional[mx.array]  # [1, P, H] prompt rows, consumed by the first frame's prefill
    prompt_frames: int
    prev_ids: mx.array  # [2] the last frame's [text, function] ids, on the device
    text_id: Optional[mx.array] = None  # [1] the last frame's text id alone (see think)
    position: int = 0  # timeline position of the next input frame to speak


@dataclass
class FrameOutput:
    text_id: int
    function_id: int
    codes: mx.array  # [1, Q]


def warmup_codes(model) -> mx.array:
    """The TTS warm-up code frames ``[1, T, Q]``: the codec codes of ``T + 1`` frames of silence,
    prepared per errata 4. They depend only on the weights, so they are computed once."""
    speech = model.tts_model
    codec = speech.audio_codec
    key = id(codec.prvq.mus_list[0]) if hasattr(codec.prvq, "mus_list") else id(codec)
    memo = getattr(model, "_warmup_memo", None)
    if memo is None or memo[0] != key:
        latent = speech.audio_prompt_latents[model.config.speaker]
        T = latent.shape[1]
        codes = codec.encode(mx.zeros((1, (T + 1) * codec.samples_per_frame)))
        init = speech.tts_model.prepare_init_codes(codes, model.config.tts_config.codebook_size)
        mx.eval(init)
        memo = (key, init)
        model._warmup_memo = memo
    return memo[1]


#: The prompt NVIDIA's own serving (vllm-omni) and mlx-audio use when none is given; ours too.
DEFAULT_SYSTEM_PROMPT = (
    "You are an AI voice assistant developed by NVIDIA. Your name is NVIDIA Voice Chat. "
    "Answer in a spoken, conversational style rather than a written one. Do not repeat the "
    "same sentence over and over again. Start the conversation by greeting the user."
)


def resolve_system_prompt(system_prompt: Optional[str]) -> str:
    """The prompt text to use: ``None`` is :data:`DEFAULT_SYSTEM_PROMPT`, ``""`` is none."""
    if system_prompt is None:
        return DEFAULT_SYSTEM_PROMPT
    if not isinstance(system_prompt, str):
        raise GenerationError(f"system_prompt must be a string, got {type(system_prompt).__name__}")
    return system_prompt


def prompt_ids(model, system_prompt: Optional[str]) -> List[int]:
    """``[bos] + encode(prompt) + [eos]``, or no ids for an empty prompt (spec step 3);
    ``None`` is :data:`DEFAULT_SYSTEM_PROMPT`."""
    system_prompt = resolve_system_prompt(system_prompt)
    if not system_prompt:
        return []
    if model.tokenizer is None:
        raise GenerationError(
            "a system prompt needs the model's tokenizer; load it with one (system_prompt=None "
            "is NVIDIA's default prompt; pass system_prompt='' for none)"
        )
    ids = model.tokenizer.encode(system_prompt, add_special_tokens=False)
    return [model.config.bos_token_id] + list(ids) + [model.config.eos_token_id]


def _embed(model, ids) -> mx.array:
    return model.stt_model.embed_tokens(mx.array(ids, dtype=mx.int32).reshape(1, -1))


def start_session(
    model,
    prompt: Sequence[int] = (),
    noise: Optional[NoiseSource] = None,
    seed: int = 0,
    progress: Optional[Callable[[int, int], None]] = None,
) -> DuplexCache:
    """A fresh session: LLM caches, the TTS warm-up and its steps over the prompt positions
    (``progress(done, total)`` after each of those steps)."""
    note_mlx_thread()
    use_cpu_layout(model)
    cfg = model.config
    pad = cfg.pad_token_id
    prompt = check_prompt_ids(model, prompt)
    if noise is None:
        seed = check_seed(seed)
    limit = cfg.text_args.max_position_embeddings
    if len(prompt) >= limit:
        raise GenerationError(
            f"the system prompt is {len(prompt)} tokens; the LLM's context is {limit} positions "
            "and the audio needs at least one"
        )
    noise = KeyNoise(seed) if noise is None else noise
    speech = model.tts_model
    tts = speech.tts_model
    latent = speech.audio_prompt_latents[cfg.speaker]
    previous, tts_cache = tts.warmup(latent, warmup_codes(model), tts.make_cache())
    prefix = None
    if prompt:
        w = cfg.function_channel_weight
        pad_row = _embed(model, [pad])
        # Prompt ids enter on the audio channel; the text and function channels hold pad.
        prefix = _embed(model, prompt) + pad_row + w * pad_row
        silence = speech.codec_silence_tokens
        for i in range(1, len(prompt)):  # position 0 is never spoken
            previous, tts_cache = tts.step(pad, previous, tts_cache, noise, silence)
            mx.async_eval(previous)
            if progress is not None:
                progress(i, len(prompt) - 1)
    return DuplexCache(
        llm=model.stt_model.llm.make_cache(),
        tts=tts_cache,
        previous_code=previous,
        noise=noise,
        prefix=prefix,
        prompt_frames=len(prompt),
        prev_ids=mx.array([pad, pad], dtype=mx.int32),
        position=0 if not prompt else len(prompt),
    )


def think(
    model,
    cache: DuplexCache,
    audio_frame: mx.array,
    override: Optional[Callable[[mx.array], Tuple[mx.array, Callable]]] = None,
    split_head: bool = False,
) -> mx.array:
    """The LLM half of a frame: the greedy ``[text, function]`` ids ``[2]``, left on the device.

    Advances the LLM cache. The previous frame's ids are read on the device
    (``cache.prev_ids``), so the next frame's LLM can be queued before the host has seen them.
    ``override(text)`` maps the text head's id ``[1]`` to the one this frame feeds back and
    speaks, and returns it with the same map for the function head's id (a barge-in's
    silence, a tool result's tokens), on the device.

    The text head runs before the function head on the same stream, and the frame's text id
    alone is kept in ``cache.text_id``: speech queued on it (:func:`speak` on another stream)
    starts once the text head is done, beside the function head.

    ``split_head``: on the CPU, run half of a big text head on :func:`head_stream` (the same
    id, ``nets.heads``). A live frame has nothing else to run beside its text head; offline,
    the other core is busy with the previous frame's speech, so it gains nothing there."""
    cfg = model.config
    stt = model.stt_model
    w = cfg.function_channel_weight
    audio_frame = audio_frame.reshape(1, 1, -1)
    prev = stt.embed_tokens(cache.prev_ids.reshape(1, 2))  # [1, 2, H]: text, function
    text_row = prev[:, 0:1]
    row = text_row + audio_frame.astype(text_row.dtype)
    row = row + w * prev[:, 1:2]
    if cache.prefix is not None:
        row = mx.concatenate([cache.prefix.astype(row.dtype), row], axis=1)
        cache.prefix = None
    h = stt.llm(row, cache.llm)[:, -1:]
    split = head_stream() if split_head and should_split(stt.lm_head) else None
    text = greedy_id(stt.lm_head, h, split)
    fix_function = None
    if override is not None:
        text, fix_function = override(text)
        text = text.astype(mx.int32)
    # MLX signals an array to other streams when the whole eval it belongs to is done: the
    # text id gets an eval of its own, so speech queued on it does not wait for the function
    # head (and that head runs beside the speech).
    mx.async_eval(text)
    cache.text_id = text
    function = greedy_id(stt.function_head, h)
    if fix_function is not None:
        function = fix_function(function).astype(mx.int32)
    ids = mx.concatenate([text, function])
    cache.prev_ids = ids
    return ids


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


def speak(model, cache: DuplexCache, text_id, position: int) -> mx.array:
    """The TTS half of the frame at timeline ``position``: its code frame ``[1, Q]``, queued on
    :func:`speech_stream` (call ``mx.async_eval`` / ``mx.eval`` on it).

    ``text_id`` is an int (its character embedding is memoized on the host) or a device
    array ``[1]`` (embedded on the device: the frame needs no host read before its speech)."""
    speech = model.tts_model
    silence = speech.codec_silence_tokens
    if position == 0:
        # errata 11: position 0 has no TTS step; it sounds like silence.
        return silence.reshape(1, -1).astype(mx.int32)
    with mx.stream(speech_stream()):
        codes, cache.tts = speech.tts_model.step(
            text_id, cache.previous_code, cache.tts, cache.noise, silence
        )
        mx.async_eval(codes)
    cache.previous_code = codes
    return codes


def duplex_step(model, cache: DuplexCache, audio_frame: mx.array) -> Tuple[FrameOutput, DuplexCache]:
    """Advance one input frame: ``audio_frame`` is the projected perception row ``[1, 1, H]``.

    Returns the greedy text and function ids of this frame and its code frame ``[1, Q]``.
    One host sync (the two ids: the TTS needs the text id on the host)."""
    ids = think(model, cache, audio_frame)
    text_id, function_id = ids.tolist()
    codes = speak(model, cache, text_id, cache.position)
    cache.position += 1
    return FrameOutput(text_id, function_id, codes), cache


#: How many frames the LLM is queued ahead of the host in :func:`run_frames`.
LOOKAHEAD = 2


def run_frames(
    model,
    cache: DuplexCache,
    frames: mx.array,
    progress: Optional[Callable[[int, int], None]] = None,
) -> Tuple[List[FrameOutput], DuplexCache]:
    """``duplex_step`` over every row of ``frames`` ``[1, F, H]``, pipelined.

    The LLM runs ``LOOKAHEAD`` frames ahead of the host (it reads its previous ids on the
    device), and each frame's TTS runs on :func:`speech_stream`, beside the LLM of the frames
    after it. Same operations in the same order per cache, so the same results as
    ``duplex_step`` frame by frame."""
    F = frames.shape[1]
    outputs: List[FrameOutput] = []
    pending = deque()
    for j in range(min(LOOKAHEAD, F)):
        pending.append(think(model, cache, frames[:, j : j + 1]))
        mx.async_eval(pending[-1])
    for i in range(F):
        text_id, function_id = pending.popleft().tolist()  # the frame's one host sync
        j = i + LOOKAHEAD
        if j < F:
            pending.append(think(model, cache, frames[:, j : j + 1]))
            mx.async_eval(pending[-1])
        codes = speak(model, cache, text_id, cache.position)
        cache.position += 1
        outputs.append(FrameOutput(text_id, function_id, codes))
        if progress is not None:
            progress(i + 1, F)
    return outputs, cache
