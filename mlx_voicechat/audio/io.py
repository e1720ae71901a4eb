"""Audio in and out: any readable file or array to mono float32 at a target rate; PCM16 WAV out.

Files are read with soundfile (WAV, FLAC, MP3, OGG, ...) and, failing that, with
``mlx_audio.audio_io`` (miniaudio / ffmpeg). Resampling is mlx-audio's polyphase FIR.
"""

from __future__ import annotations

import os
import stat
import struct
import warnings
from pathlib import Path
from typing import Optional, Union

import numpy as np

from ..errors import VoiceChatError
from ..files import write_file

INPUT_SAMPLE_RATE = 16000  # Hz, the listening path's rate
MAX_CHANNELS = 8  # a 2-D array whose first axis is at most this long may be channels-first
PCM16_SCALE = 32768.0


class AudioError(VoiceChatError, ValueError):
    """Audio that cannot be used: missing, unreadable, empty or not finite."""


class AudioWarning(UserWarning):
    """Audio that is used, but not all of it (a truncated file)."""


def _wav_truncation(path: Path):
    """``(declared, present)`` bytes of a RIFF/WAVE file's data chunk when the file ends before
    the chunk does, else None (streaming writers' unknown sizes 0 / 0xFFFFFFFF count as fine)."""
    try:
        with open(path, "rb") as f:
            head = f.read(12)
            if len(head) < 12 or head[:4] != b"RIFF" or head[8:12] != b"WAVE":
                return None
            size = os.fstat(f.fileno()).st_size
            while True:
                chunk = f.read(8)
                if len(chunk) < 8:
                    return None
                cid, n = chunk[:4], struct.unpack("<I", chunk[4:])[0]
                if cid == b"data":
                    present = size - f.tell()
                    if n not in (0, 0xFFFFFFFF) and n > present:
                        return n, present
                    return None
                f.seek(n + (n & 1), os.SEEK_CUR)
    except OSError:
        return None


def _reason(e: BaseException) -> str:
    """The first line of an exception's message, or its type's name when that is empty."""
    return (str(e).splitlines() or [""])[0] or type(e).__name__


def _read_file(path: Path):
    if not path.exists():
        raise AudioError(f"audio file not found: {path}")
    if path.is_dir():
        raise AudioError(f"audio path is a folder, not a file: {path}")
    try:
        with open(path, "rb"):
            pass
    except OSError as e:
        raise AudioError(f"cannot read audio file {path}: {e.strerror or e}") from None
    import soundfile as sf

    try:
        data, rate = sf.read(str(path), dtype="float32", always_2d=True)
        truncated = _wav_truncation(path)
        if truncated is not None:
            warnings.warn(
                f"audio file {path} is truncated: its header declares {truncated[0]} bytes of "
                f"samples but only {truncated[1]} are there; using the {len(data)} samples "
                "that survive",
                AudioWarning,
                stacklevel=3,
            )
        return data, rate
    except Exception as sf_error:  # soundfile cannot decode it; try miniaudio / ffmpeg
        reason = _reason(sf_error)
    try:
        from mlx_audio import audio_io

        data, rate = audio_io.read(str(path), always_2d=True, dtype="float32")
        return data, rate
    except Exception:
        raise AudioError(f"cannot read audio file {path}: {reason}") from None


def _read_object(f, what: str):
    import soundfile as sf

    try:
        return sf.read(f, dtype="float32", always_2d=True)
    except Exception as e:
        raise AudioError(f"cannot read {what}: {_reason(e)}") from None


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


def _to_mono(data: np.ndarray, channels_last: bool = False) -> np.ndarray:
    """Average the channels. A file's samples are ``[samples, channels]``; an array's layout is
    decided by shape: the axis of at most ``MAX_CHANNELS`` beside a longer one is the channel
    axis, and an array where that does not decide is refused."""
    if data.ndim == 1:
        return data
    if data.ndim != 2:
        raise AudioError(
            f"audio must be 1-D (samples) or 2-D (samples, channels), got shape {data.shape}"
        )
    a, b = data.shape
    if not channels_last:
        if (a == 1 and b > 1) or a <= MAX_CHANNELS < b:
            data = data.T  # channels-first
        elif not (b == 1 or b <= MAX_CHANNELS < a):
            raise AudioError(
                f"audio array of shape {data.shape} is ambiguous: time must be axis 0 of "
                f"(samples, channels) or axis 1 of (channels, samples), beside at most "
                f"{MAX_CHANNELS} channels; pass 1-D mono samples or one of those layouts"
            )
    return data.mean(axis=1, dtype=np.float64).astype(np.float32)


def load_audio(
    source: Union[str, os.PathLike, np.ndarray, "mx.array"],  # noqa: F821
    sample_rate: int = INPUT_SAMPLE_RATE,
    source_rate: Optional[int] = None,
) -> np.ndarray:
    """A file path, or an array (numpy / MLX; ``source_rate`` its rate, default ``sample_rate``),
    as mono float32 samples at ``sample_rate``. Integer PCM is scaled to [-1, 1); channels are
    averaged (a 2-D array is ``[samples, channels]`` or ``[channels, samples]`` with at most
    ``MAX_CHANNELS`` channels, told apart by shape). A binary file object is read like a file.
    Raises :class:`AudioError` with a one-line message when the audio is unusable; a truncated
    WAV file is used as far as it goes, with an :class:`AudioWarning` naming it."""
    if source is None:
        raise AudioError("no audio given (None): pass a file path or an array of samples")
    if isinstance(source, bytes):
        source = os.fsdecode(source)
    if isinstance(source, (str, os.PathLike)) or hasattr(source, "read"):
        if hasattr(source, "read"):
            what = f"audio file {getattr(source, 'name', 'object')}"
            data, rate = _read_object(source, what)
        else:
            path = Path(source)
            data, rate = _read_file(path)
            what = f"audio file {path}"
        if source_rate is not None and source_rate != rate:
            raise AudioError(f"{what} is at {rate} Hz, not the {source_rate} Hz given")
        samples = _to_mono(_to_float(data), channels_last=True)
    else:
        data = _as_numpy(source)
        rate = sample_rate if source_rate is None else int(source_rate)
        what = "audio"
        if data.dtype.kind not in "fiu":
            raise AudioError(
                "audio must be a file path or an array of integer or float PCM samples, got "
                + (f"dtype {data.dtype}" if data.dtype.kind != "O" else type(source).__name__)
            )
        samples = _to_mono(_to_float(data))
    if rate <= 0:
        raise AudioError(f"sample rate must be positive, got {rate}")
    if samples.size == 0:
        raise AudioError(f"{what} is empty")
    if not np.all(np.isfinite(samples)):
        raise AudioError(f"{what} contains NaN or infinite samples")
    if rate != sample_rate:
        from mlx_audio.resample import resample_audio_array

        samples = resample_audio_array(samples, rate, sample_rate)
    return np.ascontiguousarray(samples, dtype=np.float32)


def _same_file(a, b) -> bool:
    try:
        return os.path.samefile(a, b)
    except (OSError, TypeError, ValueError):
        return False


def check_output(path: Union[str, os.PathLike], inputs=()) -> Path:
    """Check, before any work, that ``path`` can take a new file without destroying anything;
    returns where the bytes will go.

    A symlink is followed (its target is written); a character device or FIFO is written
    through; a folder, another special file, a read-only file, a folder without write
    permission, or one of ``inputs`` (the files the run reads) is refused with an
    :class:`AudioError` naming ``path``."""
    path = Path(os.fsdecode(path)).expanduser()
    try:
        st = os.stat(path)  # follows symlinks
    except FileNotFoundError:
        st = None
    except OSError as e:
        raise AudioError(f"cannot write {path}: {e.strerror or e}") from None
    if st is not None:
        if stat.S_ISDIR(st.st_mode):
            raise AudioError(f"cannot write {path}: it is a folder; name a file inside it")
        if stat.S_ISCHR(st.st_mode) or stat.S_ISFIFO(st.st_mode):
            if not os.access(path, os.W_OK):
                raise AudioError(f"cannot write {path}: permission denied")
            return path  # written through, never replaced
        if not stat.S_ISREG(st.st_mode):
            raise AudioError(f"cannot write {path}: it is not a regular file")
        for source in inputs:
            if source is not None and _same_file(source, path):
                raise AudioError(f"cannot write {path}: it is the input audio file")
        if not os.access(path, os.W_OK) or not st.st_mode & 0o222:
            raise AudioError(
                f"cannot write {path}: the file is read-only (mode {stat.S_IMODE(st.st_mode):04o})"
            )
    target = Path(os.path.realpath(path)) if path.is_symlink() else path
    folder = target.parent if str(target.parent) else Path(".")
    if not folder.is_dir():
        raise AudioError(f"cannot write {path}: folder {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise AudioError(f"cannot write {path}: no permission to create files in {folder}")
    return target


def save_wav(path: Union[str, os.PathLike], samples, sample_rate: int) -> Path:
    """Write mono PCM16 WAV without destroying anything (see :func:`check_output`): a regular
    file is written as a temporary file in the same folder, then renamed over the target,
    keeping a replaced file's permissions; a symlink's target is written; a character device
    or FIFO is written through."""
    import io

    import soundfile as sf

    path = Path(os.fsdecode(path))
    target = check_output(path)
    samples = _as_numpy(samples).astype(np.float32, copy=False)
    if samples.ndim == 2 and 1 in samples.shape:
        samples = samples.reshape(-1)
    if samples.ndim != 1:
        raise AudioError(f"save_wav writes mono audio, got shape {samples.shape}")
    if not np.all(np.isfinite(samples)):
        raise AudioError(f"cannot write {path}: audio contains NaN or infinite samples")
    pcm = np.clip(np.round(samples * PCM16_SCALE), -PCM16_SCALE, PCM16_SCALE - 1).astype(np.int16)
    buf = io.BytesIO()
    try:
        sf.write(buf, pcm, int(sample_rate), subtype="PCM_16", format="WAV")
    except Exception as e:
        raise AudioError(f"cannot write {path}: {_reason(e)}") from None
    write_file(target, buf.getvalue(), AudioError, path)
    return path
