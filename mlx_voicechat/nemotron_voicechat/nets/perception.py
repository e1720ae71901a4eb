"""Listening path, network 1: NeMo log-mel (:class:`~mlx_voicechat.audio.mel.LogMel`) on the
checkpoint's window and filterbank, the causal FastConformer, and the projection to the LLM."""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
import mlx.nn as nn

from ...audio.mel import LogMel, check_preprocessor
from ...config import AudioConfig, PreprocessorConfig
from ...listen.fastconformer import DEFAULT_CHUNK_FRAMES, FastConformer

# --- log-mel front-end ---------------------------------------------------------------------


class Featurizer(nn.Module):
    """NeMo ``FilterbankFeatures`` buffers: the mel filterbank and the analysis window."""

    def __init__(self, cfg: PreprocessorConfig):
        super().__init__()
        self.fb = mx.zeros((1, cfg.features, cfg.n_fft // 2 + 1))
        self.window = mx.zeros((cfg.win_length,))


class Preprocessor(nn.Module):
    """NeMo's ``AudioToMelSpectrogramPreprocessor``: its config and the checkpoint's buffers."""

    def __init__(self, cfg: PreprocessorConfig):
        super().__init__()
        self.cfg = check_preprocessor(cfg)
        self.featurizer = Featurizer(cfg)

    @property
    def frontend(self) -> LogMel:
        """The log-mel on the window and filterbank the weights hold now."""
        f = self.featurizer
        return LogMel(self.cfg, f.window.astype(mx.float32), f.fb[0].astype(mx.float32).T)


# --- perception --------------------------------------------------------------------------------


class Perception(nn.Module):
    """``stt_model.perception``: log-mel -> FastConformer -> ``proj`` (the LLM audio channel)."""

    def __init__(self, audio_config: AudioConfig, chunk_size: int = DEFAULT_CHUNK_FRAMES):
        super().__init__()
        self.preprocessor = Preprocessor(audio_config.preprocessor)
        self.encoder = FastConformer(audio_config.encoder, chunk_size)
        self.proj = nn.Linear(audio_config.encoder.d_model, audio_config.output_dim)

    @property
    def frontend(self) -> LogMel:
        return self.preprocessor.frontend

    @property
    def sample_rate(self) -> int:
        return self.preprocessor.cfg.sample_rate

    def log_mel(self, wave: mx.array, lengths: Optional[mx.array] = None):
        """``wave`` [B, N] or [N] at 16 kHz -> (mel [B, T, n_mels], mel_len [B])."""
        return self.frontend(wave, lengths)

    def encode(self, mel: mx.array, mel_len: Optional[mx.array] = None, chunk_size=None):
        """(encoded [B, T', d_model], lengths [B]); frames at index >= lengths are padding."""
        return self.encoder(mel, mel_len, chunk_size)

    def __call__(self, audio: mx.array, lengths: Optional[mx.array] = None, chunk_size=None):
        """A waveform ([N] or [B, N]) or a mel ([B, T, n_mels], ``lengths`` = mel_len)
        -> (projected [B, T', output_dim], lengths [B], encoded [B, T', d_model])."""
        if audio.ndim == 3:
            mel, mel_len = audio, lengths
        else:
            mel, mel_len = self.log_mel(audio, lengths)
        encoded, enc_len = self.encode(mel, mel_len, chunk_size)
        return self.proj(encoded), enc_len, encoded
