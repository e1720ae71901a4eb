"""Listening path, network 1: NeMo log-mel, causal FastConformer, projection to the LLM width.

The FastConformer is :mod:`.encoder` (mlx-audio's blocks, chunked); this module adds what NeMo
does differently in the front-end (zero-padded STFT on the checkpoint's own window and
filterbank, ``floor(n / hop)`` valid length, padded frames masked) and the projection to the
LLM's audio channel.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_audio.dsp import stft

from ..config import AudioConfig, ConfigError, PreprocessorConfig
from .encoder import DEFAULT_CHUNK_FRAMES, FastConformer

# Mel frames per STFT block, so the framed signal of a long input is never whole (40.96 s).
MEL_BLOCK_FRAMES = 4096


# --- log-mel front-end ---------------------------------------------------------------------


class Featurizer(nn.Module):
    """NeMo ``FilterbankFeatures`` buffers: the mel filterbank and the analysis window."""

    def __init__(self, cfg: PreprocessorConfig):
        super().__init__()
        self.fb = mx.zeros((1, cfg.features, cfg.n_fft // 2 + 1))
        self.window = mx.zeros((cfg.win_length,))


class Preprocessor(nn.Module):
    def __init__(self, cfg: PreprocessorConfig):
        super().__init__()
        if str(cfg.normalize).upper() not in ("NA", "NONE"):
            raise ConfigError(
                f"preprocessor.normalize {cfg.normalize!r} is not supported (NA only)"
            )
        if cfg.pad_to not in (0, None):
            raise ConfigError(f"preprocessor.pad_to {cfg.pad_to!r} is not supported (0 only)")
        self.cfg = cfg
        self.featurizer = Featurizer(cfg)

    def valid_frames(self, lengths: mx.array) -> mx.array:
        # Errata 2: NeMo counts (n + 2 * (n_fft // 2) - n_fft) // hop frames, one fewer than
        # the centred STFT produces.
        pad = self.cfg.n_fft // 2
        return (lengths + 2 * pad - self.cfg.n_fft) // self.cfg.hop_length

    def __call__(self, wave: mx.array, lengths: Optional[mx.array] = None):
        cfg = self.cfg
        wave = (wave[None] if wave.ndim == 1 else wave).astype(mx.float32)
        B, N = wave.shape
        if lengths is None:
            lengths = mx.full((B,), N, dtype=mx.int32)
        lengths = lengths.astype(mx.int32)
        if cfg.preemph:
            wave = mx.concatenate([wave[:, :1], wave[:, 1:] - cfg.preemph * wave[:, :-1]], axis=1)
        wave = mx.where(mx.arange(N)[None] < lengths[:, None], wave, 0.0)

        n_fft, hop = cfg.n_fft, cfg.hop_length
        window = self.featurizer.window.astype(mx.float32)
        fb = self.featurizer.fb[0].astype(mx.float32).T  # [n_fft // 2 + 1, n_mels]
        # Errata 1: NeMo's STFT pads n_fft // 2 zeros on each side (not reflect).
        padded = mx.pad(wave, [(0, 0), (n_fft // 2, n_fft // 2)])
        n_frames = 1 + (padded.shape[1] - n_fft) // hop
        rows = []
        for b in range(B):
            blocks = []
            for f0 in range(0, n_frames, MEL_BLOCK_FRAMES):
                f1 = min(f0 + MEL_BLOCK_FRAMES, n_frames)
                seg = padded[b, f0 * hop : (f1 - 1) * hop + n_fft]
                spec = stft(seg, n_fft, hop, n_fft, window, center=False)
                power = mx.square(spec.real) + mx.square(spec.imag)
                if cfg.mag_power != 2.0:
                    power = mx.power(mx.sqrt(power), cfg.mag_power)
                blocks.append(mx.log(power @ fb + cfg.log_zero_guard_value))
            rows.append(mx.concatenate(blocks, axis=0) if len(blocks) > 1 else blocks[0])
        mel = mx.stack(rows)
        mel_len = self.valid_frames(lengths)
        keep = mx.arange(n_frames)[None, :, None] < mel_len[:, None, None]
        mel = mx.where(keep, mel, cfg.pad_value)
        return mel, mel_len


# --- perception --------------------------------------------------------------------------------


class Perception(nn.Module):
    """``stt_model.perception``: log-mel -> FastConformer -> ``proj`` (the LLM audio channel)."""

    def __init__(self, audio_config: AudioConfig, chunk_size: int = DEFAULT_CHUNK_FRAMES):
        super().__init__()
        self.preprocessor = Preprocessor(audio_config.preprocessor)
        self.encoder = FastConformer(audio_config.encoder, chunk_size)
        self.proj = nn.Linear(audio_config.encoder.d_model, audio_config.output_dim)

    @property
    def sample_rate(self) -> int:
        return self.preprocessor.cfg.sample_rate

    def log_mel(self, wave: mx.array, lengths: Optional[mx.array] = None):
        """``wave`` [B, N] or [N] at 16 kHz -> (mel [B, T, n_mels], mel_len [B])."""
        return self.preprocessor(wave, lengths)

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
