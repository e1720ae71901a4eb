"""The module mlx-lm and mlx-audio import for ``model_type: "nemotron_voicechat"``.

Reached as ``mlx_lm.models.nemotron_voicechat`` and ``mlx_audio.sts.models.nemotron_voicechat``
through the plugin finder (see ``mlx_voicechat_boot``). :class:`Model` is the user-facing model:
the parameter tree of :mod:`mlx_voicechat.model` plus the loader hooks the ecosystem loaders
call (``sanitize``, ``post_load_hook``, which reach into :mod:`mlx_voicechat.weights`) and the
runtime methods (``transcribe``, ``generate``, from :mod:`mlx_voicechat.runtime`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, Mapping, Optional

import mlx.core as mx

from .config import ModelArgs, ModelConfig, VoiceChatConfig
from .errors import CheckpointError
from .model import VoiceChatModel, check_weights
from .nets.layout import use_cpu_layout
from .weights.loading import attach_assets
from .weights.sanitize import sanitize_module

# A package-like empty search path, so that `<alias>.config` etc. reach the finder, which maps
# them onto this package's modules.
__path__ = []

__all__ = ["Model", "ModelArgs", "ModelConfig", "VoiceChatConfig"]


class Model(VoiceChatModel):
    """NemotronLabs VoiceChat: load with :func:`mlx_voicechat.load`, ``mlx_lm.load`` or
    ``mlx_audio.sts.load_model``; all three return this class."""

    # --- loading ----------------------------------------------------------------------

    def sanitize(self, weights: Mapping[str, mx.array]) -> Dict[str, mx.array]:
        """NeMo / PyTorch layouts to ours; pure in its result and safe to run twice.

        It also remembers which keys the checkpoint provided, so that ``post_load_hook`` can
        tell a non-strict loader's silently missing tensors from loaded ones.
        """
        out = sanitize_module(self, weights)
        self._checkpoint_keys = frozenset(out)
        return out

    @staticmethod
    def post_load_hook(model: "Model", model_path) -> "Model":
        """mlx-audio loads non-strictly: verify here that every parameter was in the checkpoint,
        then attach the tokenizer and RNNT vocabulary from the checkpoint folder."""
        provided = model._checkpoint_keys
        if provided is None:
            raise CheckpointError(
                "the weights were loaded without Model.sanitize; cannot verify the checkpoint"
            )
        check_weights(model, {k: None for k in provided})
        attach_assets(model, Path(model_path))
        use_cpu_layout(model)
        return model

    # --- listening ----------------------------------------------------------------------

    def transcribe(self, audio, *, source_rate: Optional[int] = None, chunk_size=None):
        """The user's words via the RNNT head: text, token ids, frame indices, language."""
        from .runtime.transcribe import transcribe

        use_cpu_layout(self)
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

    def generate(self, audio, system_prompt=None, extra_decoding_seconds=3.0, seed=0, **kwargs):
        """Offline speech-to-speech: see :func:`mlx_voicechat.runtime.duplex.generate`."""
        from .runtime.duplex import generate

        return generate(self, audio, system_prompt, extra_decoding_seconds, seed, **kwargs)

    def session(
        self,
        system_prompt: Optional[str] = None,
        *,
        seed: int = 0,
        noise=None,
        prompt=None,
        max_seconds: Optional[float] = None,
    ):
        """A streaming conversation: see :class:`mlx_voicechat.runtime.session.Session`."""
        from .runtime.session import Session

        return Session(
            self, system_prompt, seed=seed, noise=noise, prompt=prompt, max_seconds=max_seconds
        )
