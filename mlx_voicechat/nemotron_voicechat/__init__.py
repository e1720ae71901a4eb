"""The module mlx-lm and mlx-audio import for ``model_type: "nemotron_voicechat"`` (through the
plugin finder in ``mlx_voicechat_boot``). :class:`Model` is the user-facing model: the parameter
tree of :mod:`.model`, the ecosystem loaders' hooks (``sanitize``, ``post_load_hook``) and the
runtime methods (``transcribe``, ``generate``, sessions)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Mapping, Optional

import mlx.core as mx

from ..config import ModelArgs, ModelConfig, VoiceChatConfig
from ..errors import CheckpointError
from ..fastpaths.layout import use_cpu_layout
from .model import VoiceChatModel, check_shapes, expected_shapes
from .weights.loading import attach_assets
from .weights.sanitize import sanitize_module

__all__ = ["Model", "ModelArgs", "ModelConfig", "VoiceChatConfig"]

# mlx-audio's module exports these too; they are loaded on first use.
_COMPAT_NAMES = {
    "VoiceChatEvent": "compat",
    "VoiceChatSession": "compat",
    "VoiceChatStreamingSession": "compat",
    "VoiceChatContextLimitError": "compat",
    "VoiceChatOutput": "compat",
    "DEFAULT_SYSTEM_PROMPT": "request",
}


def __getattr__(name):
    if name in _COMPAT_NAMES:
        import importlib

        runtime = "mlx_voicechat.nemotron_voicechat.runtime"
        module = importlib.import_module(f"{runtime}.{_COMPAT_NAMES[name]}")
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class Model(VoiceChatModel):
    """NemotronLabs VoiceChat: load with :func:`mlx_voicechat.load`, ``mlx_lm.load`` or
    ``mlx_audio.sts.load_model``; all three return this class."""

    # --- loading ----------------------------------------------------------------------

    def sanitize(self, weights: Mapping[str, mx.array]) -> Dict[str, mx.array]:
        """NeMo / PyTorch layouts to ours (safe to run twice). Remembers the keys and shapes
        provided, so that ``post_load_hook`` catches what a non-strict loader skipped."""
        out = sanitize_module(self, weights)
        self._checkpoint_keys = {k: tuple(v.shape) for k, v in out.items()}
        return out

    @staticmethod
    def post_load_hook(model: "Model", model_path) -> "Model":
        """mlx-audio loads non-strictly: verify here that every parameter was in the checkpoint
        with its shape, then attach the tokenizer and RNNT vocabulary from the checkpoint
        folder."""
        provided = model._checkpoint_keys
        if provided is None:
            raise CheckpointError(
                "the weights were loaded without Model.sanitize; cannot verify the checkpoint"
            )
        check_shapes(expected_shapes(model), provided)
        attach_assets(model, Path(model_path))
        use_cpu_layout(model)
        return model

    # --- listening ----------------------------------------------------------------------

    def transcribe(self, audio, *, source_rate: Optional[int] = None, chunk_size=None):
        """The user's words via the RNNT head: text, token ids, frame indices, language."""
        from ..listen.transcribe import transcribe
        from ..threads import note_mlx_thread

        note_mlx_thread()
        stt = self.stt_model
        return transcribe(
            stt.perception,
            stt.rnnt_decoder,
            stt.rnnt_joint,
            self.rnnt_vocabulary,
            self.config.rnnt_blank_id,
            self.config.audio_config.max_symbols,
            audio,
            source_rate=source_rate,
            chunk_size=chunk_size,
        )

    # --- the duplex loop ------------------------------------------------------------------

    def generate(
        self,
        audio,
        system_prompt=None,
        extra_decoding_seconds=3.0,
        seed=0,
        *,
        verbose=False,
        use_language_cache=True,
        **kwargs,
    ):
        """Offline speech-to-speech: see :func:`.runtime.generate.generate`. A model runs one
        call at a time, from any thread. ``system_prompt=None`` is NVIDIA's default prompt
        (``DEFAULT_SYSTEM_PROMPT``); ``""`` is none.

        mlx-audio's keywords work too: ``verbose`` prints the reply text, ``max_frames`` keeps
        the first frames, ``use_language_cache`` changes nothing, ``sample_rate`` is the rate of
        an array ``audio``; generic options that do not apply (temperature, voice, ...) are
        ignored with a one-line warning; anything else is a GenerationError."""
        from ..errors import GenerationError
        from .runtime.compat import check_generate_compat
        from .runtime.generate import generate

        check_generate_compat(verbose, use_language_cache)
        if self.tokenizer is None:
            raise GenerationError(
                "this model has no tokenizer attached: call model.setup_tokenizer(tokenizer) "
                "(mlx_lm.load returns one), or load the model with mlx_voicechat.load(path)"
            )
        kwargs = _generate_options(kwargs, GenerationError)
        result = generate(self, audio, system_prompt, extra_decoding_seconds, seed, **kwargs)
        if verbose:
            print(result.text)
        return result

    def create_session(self):
        """mlx-audio's API: an object with ``generate`` (its defaults) and
        ``create_streaming_session``; see :mod:`mlx_voicechat.nemotron_voicechat.runtime.compat`."""
        from .runtime.compat import VoiceChatSession

        return VoiceChatSession(self)

    def create_duplex_session(self, **kwargs):
        """mlx-audio's API: ``create_session().create_streaming_session(**kwargs)``, an object
        with ``push_audio`` / ``flush`` / ``cancel`` over :meth:`session`."""
        return self.create_session().create_streaming_session(**kwargs)

    def session(self, system_prompt: Optional[str] = None, **options):
        """A streaming conversation: see
        :class:`mlx_voicechat.nemotron_voicechat.runtime.session.Session` (a
        batch of one). ``options``: ``seed`` (0), ``noise``, ``prompt`` (ids instead of
        ``system_prompt``), ``max_seconds``, ``tools``."""
        from .runtime.session import Session

        return Session(self, system_prompt, **options)

    def session_batch(self, max_sessions: int = 8, join_rows=None):
        """Live conversations stepped together, one batched forward per frame: see
        :class:`mlx_voicechat.nemotron_voicechat.runtime.batch.SessionBatch` (``join_rows``: prompts
        in slices)."""
        from .runtime.batch import SessionBatch

        return SessionBatch(self, max_sessions=max_sessions, join_rows=join_rows)


GENERATE_OPTIONS = (
    "noise", "prompt", "source_rate", "progress", "prompt_progress", "tools", "max_frames"
)
# Options of mlx-audio's generic STS command line that this model has no use for: the LLM is
# greedy and the speech sampling is fixed by the checkpoint; there is one voice.
IGNORED_OPTIONS = (
    "temperature",
    "audio_temperature",
    "top_p",
    "top_k",
    "max_new_tokens",
    "no_repeat_ngram_size",
    "voice",
)


def _generate_options(kwargs: Dict[str, Any], error: type) -> Dict[str, Any]:
    """``generate``'s keyword options, with mlx-audio's generic ones mapped or dropped."""
    import warnings

    kwargs = dict(kwargs)
    if "sample_rate" in kwargs:
        rate = kwargs.pop("sample_rate")
        if kwargs.get("source_rate") not in (None, rate):
            raise error(f"sample_rate={rate} and source_rate={kwargs['source_rate']} disagree")
        kwargs["source_rate"] = rate
    ignored = sorted(k for k in kwargs if k in IGNORED_OPTIONS)
    if ignored:
        warnings.warn(
            "NemotronLabs VoiceChat ignores " + ", ".join(ignored) + " (greedy text, the "
            "checkpoint's own speech sampling, one voice)",
            stacklevel=3,
        )
    unknown = sorted(k for k in kwargs if k not in GENERATE_OPTIONS and k not in IGNORED_OPTIONS)
    if unknown:
        raise error(
            f"generate() got an option it does not know: {unknown[0]}; it takes audio, "
            "system_prompt, extra_decoding_seconds, seed, verbose, use_language_cache and "
            + ", ".join(GENERATE_OPTIONS)
        )
    return {k: v for k, v in kwargs.items() if k in GENERATE_OPTIONS}

