"""The user-facing Nemotron-3.5-ASR model: :func:`mlx_voicechat.load` returns a
:class:`Recognizer` (the network plus ``transcribe`` and ``session``) for a recognizer
checkpoint of either layout.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple, Union

from ..audio.mel import check_edge
from ..errors import VoiceChatError, is_int
from .config import AUTO
from .network import RecognizerNetwork


class RecognizerError(VoiceChatError, ValueError):
    """A call a recognizer cannot take (an unknown language, a VoiceChat-only verb)."""


class Recognizer(RecognizerNetwork):
    """Nemotron-3.5-ASR: speech in, text and its language out."""

    @property
    def vocabulary(self):
        return self.config.vocabulary

    @property
    def sample_rate(self) -> int:
        return self.config.sample_rate

    # --- the language prompt ---------------------------------------------------------------

    def resolve_prompt(
        self, language: Optional[str] = None, prompt_id: Optional[int] = None
    ) -> Tuple[int, Optional[str]]:
        """(prompt id, forced language name or None for automatic detection)."""
        p = self.config.prompt
        if not p.num_prompts:
            if language not in (None, AUTO) or prompt_id is not None:
                raise RecognizerError(
                    f"this recognizer ({self.config.model_type}) has no language prompt; "
                    "leave out language and prompt_id"
                )
            return 0, None
        if prompt_id is not None and (not is_int(prompt_id) or not 0 <= prompt_id < p.num_prompts):
            raise RecognizerError(
                f"prompt_id must be an integer in [0, {p.num_prompts}), got {prompt_id!r}"
            )
        if language is not None:
            if language not in p.prompt_dictionary:
                known = sorted(k for k in p.prompt_dictionary if "-" in k or k == AUTO)
                hint = ", ".join(known[:12]) + (", ..." if len(known) > 12 else "")
                raise RecognizerError(
                    f"unknown language {language!r}; this checkpoint knows "
                    + (hint or "no language names (use prompt_id)")
                )
            lid = p.prompt_dictionary[language]
            if prompt_id is not None and prompt_id != lid:
                raise RecognizerError(
                    f"language {language!r} is prompt {lid}, not prompt_id {prompt_id}"
                )
            prompt_id = lid
        if prompt_id is None:
            prompt_id = p.default_prompt_id
        if prompt_id == p.prompt_dictionary.get(AUTO, p.default_prompt_id):
            return prompt_id, None  # automatic detection
        return prompt_id, language if language not in (None, AUTO) else p.name_of(prompt_id)

    # --- runtime -------------------------------------------------------------------------------

    def transcribe(
        self,
        audio: Union[str, Sequence, object],
        *,
        language: Optional[str] = None,
        prompt_id: Optional[int] = None,
        source_rate: Optional[int] = None,
        edge: str = "nemo",
    ):
        """Transcribe a clip (path or array at ``source_rate``, default 16 kHz), or a list of
        clips in one batched run (then a list of results, one per clip, in order).

        ``language`` (e.g. ``"en-US"``, ``"auto"``) or ``prompt_id`` pick the language
        prompt; by default the model detects the language and the result's ``language`` is
        the ``<xx-XX>`` tag it emitted. ``edge``: ``"nemo"`` (NeMo's and Transformers' end of
        clip) or ``"mlx-audio"`` (what mlx-audio's ``generate`` computes there)."""
        from ..threads import note_mlx_thread
        from .transcribe import transcribe

        note_mlx_thread()
        check_edge(edge)
        pid, name = self.resolve_prompt(language, prompt_id)
        many = isinstance(audio, (list, tuple))
        if many and not audio:
            raise RecognizerError("transcribe() got an empty list of clips")
        results = transcribe(
            self, list(audio) if many else [audio], pid, name, source_rate=source_rate, edge=edge
        )
        return results if many else results[0]

    def session(
        self, *, language: Optional[str] = None, prompt_id: Optional[int] = None, edge: str = "nemo"
    ):
        """A live transcription session (``feed`` / ``finish``): see
        :class:`mlx_voicechat.nemotron_asr.session.TranscriptionSession`."""
        from .session import TranscriptionSession

        check_edge(edge)
        pid, name = self.resolve_prompt(language, prompt_id)
        return TranscriptionSession(self, pid, name, edge=edge)

    def generate(self, *args, **kwargs):
        """Not a recognizer's: one clear error (speech to speech needs VoiceChat)."""
        require_voicechat(self, "generate")


def require_voicechat(model, verb: str) -> None:
    """One clear error when a VoiceChat-only ``verb`` gets a recognizer."""
    if isinstance(model, Recognizer):
        raise RecognizerError(
            f"{verb} needs a NemotronLabs VoiceChat checkpoint; this one is Nemotron-3.5-ASR, "
            "a speech recognizer: use `mlx-voicechat transcribe` (or `stream` / `serve` for "
            "live transcription)"
        )
