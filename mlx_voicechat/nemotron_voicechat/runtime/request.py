"""One conversation's request, resolved once: what ``generate`` and every session start from.

:func:`resolve` checks every option in one place (prompt text or ids, tools, seed or noise,
``max_seconds``, the LLM's context) and raises :class:`~mlx_voicechat.errors.RequestError` (a
GenerationError and a SessionError) for a mistake.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence

from ...errors import RequestError, is_int, is_number
from ...noise import NoiseSource
from .tools import prepare_tools

MAX_SEED = 2**64 - 1  # MLX keys hold 64 bits

#: The prompt NVIDIA's own serving (vllm-omni) and mlx-audio use when none is given; ours too.
DEFAULT_SYSTEM_PROMPT = (
    "You are an AI voice assistant developed by NVIDIA. Your name is NVIDIA Voice Chat. "
    "Answer in a spoken, conversational style rather than a written one. Do not repeat the "
    "same sentence over and over again. Start the conversation by greeting the user."
)


@dataclass
class Request:
    """A resolved request: the prompt ids (``[bos] + ... + [eos]`` or none), the normalized
    tools and the conversation's function-channel parser (None without tools), the seed (or
    the noise source that replaces it), and how many audio frames the conversation may run."""

    prompt_ids: List[int]
    seed: int = 0
    noise: Optional[NoiseSource] = None
    tools: List[Any] = field(default_factory=list)
    max_frames: int = 1
    context: int = 1  # the LLM's context in positions
    parser: Any = None

    def check_frames(self, frames: int, what: str) -> None:
        """``frames`` audio frames must fit in the context after the prompt."""
        need = len(self.prompt_ids) + frames
        if need > self.context:
            raise RequestError(
                f"the system prompt ({len(self.prompt_ids)} tokens) and {what} need {need} "
                f"positions; the LLM's context is {self.context}"
            )


def check_seed(seed, name: str = "seed") -> int:
    """``seed`` as an int, or a RequestError for anything MLX cannot key with (``name``: what
    the caller calls it, e.g. the CLI's ``--seed``)."""
    if not is_int(seed) or not 0 <= seed <= MAX_SEED:
        raise RequestError(f"{name} must be an integer from 0 to 2**64 - 1, got {seed!r}")
    return int(seed)


def check_extra_seconds(seconds, name: str = "extra_decoding_seconds") -> float:
    """``extra_decoding_seconds`` as a float, or a RequestError (``name`` as for
    :func:`check_seed`). How much of it fits in the context is :meth:`Request.check_frames`'s
    to say, once the audio is known."""
    if not is_number(seconds) or not math.isfinite(seconds) or seconds < 0:
        raise RequestError(f"{name} must be a finite number >= 0, got {seconds!r}")
    return float(seconds)


def resolve_system_prompt(system_prompt: Optional[str]) -> str:
    """The prompt text to use: ``None`` is :data:`DEFAULT_SYSTEM_PROMPT`, ``""`` is none."""
    if system_prompt is None:
        return DEFAULT_SYSTEM_PROMPT
    if not isinstance(system_prompt, str):
        raise RequestError(f"system_prompt must be a string, got {type(system_prompt).__name__}")
    return system_prompt


def check_prompt_ids(model, prompt) -> List[int]:
    """Prompt ids as ints, each a row of the embedding table (``0 <= id < vocab_size``)."""
    if isinstance(prompt, (str, bytes)):
        raise RequestError("prompt= takes token ids; pass a text prompt as system_prompt=")
    vocab = model.config.text_args.vocab_size
    ids = []
    for i in prompt:
        if not is_int(i) or not 0 <= i < vocab:
            raise RequestError(
                f"prompt id {i!r} is not a token id of this model: ids are integers from 0 to "
                f"{vocab - 1} (the vocabulary has {vocab})"
            )
        ids.append(int(i))
    return ids


def prompt_ids(model, system_prompt: Optional[str]) -> List[int]:
    """``[bos] + encode(prompt) + [eos]``, or no ids for an empty prompt (spec step 3);
    ``None`` is :data:`DEFAULT_SYSTEM_PROMPT`."""
    system_prompt = resolve_system_prompt(system_prompt)
    if not system_prompt:
        return []
    if model.tokenizer is None:
        raise RequestError(
            "a system prompt needs the model's tokenizer; load it with one (system_prompt=None "
            "is NVIDIA's default prompt; pass system_prompt='' for none)"
        )
    ids = model.tokenizer.encode(system_prompt, add_special_tokens=False)
    return [model.config.bos_token_id] + list(ids) + [model.config.eos_token_id]


def check_max_seconds(max_seconds) -> Optional[float]:
    if max_seconds is None:
        return None
    if not is_number(max_seconds) or not math.isfinite(max_seconds) or max_seconds <= 0:
        raise RequestError(f"max_seconds must be a positive number, got {max_seconds!r}")
    return float(max_seconds)


def resolve(
    model,
    system_prompt: Optional[str] = None,
    *,
    prompt: Optional[Sequence[int]] = None,
    tools: Optional[Sequence[Any]] = None,
    seed: int = 0,
    noise: Optional[NoiseSource] = None,
    max_seconds: Optional[float] = None,
) -> Request:
    """Check a conversation's options once and resolve them into a :class:`Request`."""
    cfg = model.config
    if noise is None:
        seed = check_seed(seed)
    elif not all(callable(getattr(noise, name, None)) for name in ("gumbel", "normal")):
        raise RequestError("noise must have gumbel(shape) and normal(shape) methods")
    max_seconds = check_max_seconds(max_seconds)
    if tools and prompt is not None:
        raise RequestError(
            "tools are rendered into the system prompt text: pass system_prompt with tools, "
            "not prompt ids"
        )
    if prompt is not None:
        ids, normalized, parser = check_prompt_ids(model, prompt), [], None
    else:
        text = resolve_system_prompt(system_prompt)
        text, normalized, parser = prepare_tools(model, text, tools)
        ids = prompt_ids(model, text)
    context = cfg.text_args.max_position_embeddings
    room = context - len(ids)
    if room < 1:
        raise RequestError(
            f"the system prompt is {len(ids)} tokens; the LLM's context is {context} positions "
            "and the audio needs at least one"
        )
    if max_seconds is not None:
        room = min(room, max(1, int(max_seconds / cfg.frame_duration)))
    return Request(
        prompt_ids=ids,
        seed=seed if noise is None else 0,
        noise=noise,
        tools=normalized,
        max_frames=room,
        context=context,
        parser=parser,
    )
