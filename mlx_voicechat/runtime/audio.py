"""Audio in and out: any readable file or array to mono float32 at a target rate; PCM16 WAV out.

Files are read with soundfile (WAV, FLAC, MP3, OGG, ...) and, failing that, with
``mlx_audio.audio_io`` (miniaudio / ffmpeg). Resampling is mlx-audio's polyphase FIR.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Optional, Union

import numpy as np

from ..errors import VoiceChatError

INPUT_SAMPLE_RATE = 16000  # Hz, the listening path's rate
MAX_CHANNELS = 8  # a 2-D array whose first axis is at most this long may be channels-first
PCM16_SCALE = 32768.0


class AudioError(VoiceChatError, ValueError):
    """Audio that cannot be used: missing, unreadable, empty or not finite."""


def _read_file(path: Path):
    if not path.exists():
        raise AudioError(f"audio file not found: {path}")
    if path.is_dir():
        raise AudioError(f"audio path is a folder, not a file: {path}")
    import soundfile as sf

    try:
        data, rate = sf.read(str(path), dtype="float32", always_2d=True)
        return data, rate
    except Exception as sf_error:  # soundfile cannot decode it; try miniaudio / ffmpeg
        reason = str(sf_error).splitlines()[0] if str(sf_error) else type(sf_error).__name__
    try:
        from mlx_audio import audio_io

        data, rate = audio_io.read(str(path), always_2d=True, dtype="float32")
        return data, rate
    except Exception:
        raise AudioError(f"cannot read audio file {path}: {reason}") from None


def _as_numpy(source) -> np.ndarray:
    if type(source).__module__.startswith("mlx"):
        import mlx.core as mx

        if mx.issubdtype(source.dtype, mx.floating):
            source = source.astype(mx.float32)  # numpy has no bfloat16
    return np.asarray(source)


def _to_float(data: np.ndarray) -> np.ndarray:
    kind = data.dtype.kind
    if kind == "f":
        return data.astype(np.float32, copy=False)
    if kind == "i":
        return (data.astype(np.float64) / float(-np.iinfo(data.dtype).min)).astype(np.float32)
    if kind == "u":
        mid = (float(np.iinfo(data.dtype).max) + 1.0) / 2.0
        return ((data.astype(np.float64) - mid) / mid).astype(np.float32)
    raise AudioError(f"audio samples must be integer or float PCM, got dtype {data.dtype}")


def _to_mono(data: np.ndarray) -> np.ndarray:
    if data.ndim == 1:
        return data
    if data.ndim != 2:
        raise AudioError(
            f"audio must be 1-D (samples) or 2-D (samples, channels), got shape {data.shape}"
        )
    if data.shape[0] <= MAX_CHANNELS < data.shape[1]:
        data = data.T  # channels-first
    return data.mean(axis=1, dtype=np.float64).astype(np.float32)


def _check(samples: np.ndarray, what: str) -> None:
    if samples.size == 0:
        raise AudioError(f"{what} is empty")
    if not np.all(np.isfinite(samples)):
        raise AudioError(f"{what} contains NaN or infinite samples")


def load_audio(
    source: Union[str, os.PathLike, np.ndarray, "mx.array"],  # noqa: F821
    sample_rate: int = INPUT_SAMPLE_RATE,
    source_rate: Optional[int] = None,
) -> np.ndarray:
    """A file path, or an array (numpy / MLX; ``source_rate`` its rate, default ``sample_rate``),
    as mono float32 samples at ``sample_rate``. Integer PCM is scaled to [-1, 1); channels are
    averaged. Raises :class:`AudioError` with a one-line message when the audio is unusable."""
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        data, rate = _read_file(path)
        what = f"audio file {path}"
        if source_rate is not None and source_rate != rate:
            raise AudioError(f"{what} is at {rate} Hz, not the {source_rate} Hz given")
    else:
        data = _as_numpy(source)
        rate = sample_rate if source_rate is None else int(source_rate)
        what = "audio"
        if data.dtype.kind not in "fiu":
            raise AudioError(f"audio samples must be integer or float PCM, got dtype {data.dtype}")
    if rate <= 0:
        raise AudioError(f"sample rate must be positive, got {rate}")
    samples = _to_mono(_to_float(data))
    _check(samples, what)
    if rate != sample_rate:
        from mlx_audio.resample import resample_audio_array

        samples = resample_audio_array(samples, rate, sample_rate)
    return np.ascontiguousarray(samples, dtype=np.float32)


def save_wav(path: Union[str, os.PathLike], samples, sample_rate: int) -> Path:
    """Write mono PCM16 WAV atomically: a temporary file in the same folder, then a rename."""
    import soundfile as sf

    path = Path(path)
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        raise AudioError(f"cannot write {path}: folder {folder} does not exist")
    samples = _as_numpy(samples).astype(np.float32, copy=False)
    if samples.ndim == 2 and 1 in samples.shape:
        samples = samples.reshape(-1)
    if samples.ndim != 1:
        raise AudioError(f"save_wav writes mono audio, got shape {samples.shape}")
    if not np.all(np.isfinite(samples)):
        raise AudioError(f"cannot write {path}: audio contains NaN or infinite samples")
    pcm = np.clip(np.round(samples * PCM16_SCALE), -PCM16_SCALE, PCM16_SCALE - 1).astype(np.int16)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=folder)
    os.close(fd)
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes the file private; a WAV should not be
        sf.write(tmp, pcm, int(sample_rate), subtype="PCM_16", format="WAV")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path
