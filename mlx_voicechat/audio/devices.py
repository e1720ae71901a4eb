"""Audio in and out for a live conversation: a source (``sample_rate``, ``read(n)`` blocking
for ``n`` mono float32 samples, None at the end) and a sink (``sample_rate``, ``write`` that
queues without waiting), on PortAudio devices (extra ``[mic]``) or arrays. Both have
``close()`` and are context managers.
"""

from __future__ import annotations

import collections
import threading
from typing import Optional, Protocol, Union

import numpy as np

from ..errors import VoiceChatError

MIC_EXTRA = "pip install 'mlx-voicechat[mic]'"


class DeviceError(VoiceChatError, RuntimeError):
    """An audio device that cannot be used: sounddevice or PortAudio missing, no such device."""


class AudioSource(Protocol):
    sample_rate: int

    def read(self, n: int) -> Optional[np.ndarray]: ...

    def close(self) -> None: ...


class AudioSink(Protocol):
    sample_rate: int

    def write(self, samples: np.ndarray) -> None: ...

    def close(self) -> None: ...


class _Closing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


# --- arrays ----------------------------------------------------------------------------------


class ArraySource(_Closing):
    """Samples of an array, ``n`` per read; the last read may be short; then None."""

    def __init__(self, samples, sample_rate: int):
        x = np.asarray(samples, dtype=np.float32)
        if x.ndim != 1:
            raise DeviceError(f"an array source takes mono samples (1-D), got shape {x.shape}")
        self.samples = x
        self.sample_rate = int(sample_rate)
        self.position = 0

    def read(self, n: int) -> Optional[np.ndarray]:
        if self.position >= len(self.samples):
            return None
        block = self.samples[self.position : self.position + n]
        self.position += len(block)
        return block

    def close(self) -> None:
        self.position = len(self.samples)


class ArraySink(_Closing):
    """Keeps everything written; ``audio`` is all of it as one array."""

    def __init__(self, sample_rate: int):
        self.sample_rate = int(sample_rate)
        self.blocks = []
        self.closed = False

    def write(self, samples) -> None:
        if self.closed:
            raise DeviceError("write to a closed sink")
        self.blocks.append(np.asarray(samples, dtype=np.float32).reshape(-1))

    @property
    def audio(self) -> np.ndarray:
        return np.concatenate(self.blocks) if self.blocks else np.zeros(0, np.float32)

    def close(self) -> None:
        self.closed = True


# --- python-sounddevice -------------------------------------------------------------------


def _sounddevice():
    """The sounddevice module, or a DeviceError saying what is missing."""
    try:
        import sounddevice
    except ImportError:
        raise DeviceError(f"live audio needs python-sounddevice: {MIC_EXTRA}") from None
    except OSError as e:  # the module is there, the PortAudio library is not
        raise DeviceError(
            f"python-sounddevice cannot load PortAudio ({e}); install it "
            "(Debian/Ubuntu: apt install libportaudio2, macOS: brew install portaudio)"
        ) from None
    return sounddevice


def _device(sd, device: Union[int, str, None], kind: str) -> dict:
    """PortAudio's description of the chosen (or default) device of ``kind``."""
    what = "microphone (input device)" if kind == "input" else "speaker (output device)"
    try:
        info = sd.query_devices(device, kind=kind)
    except (ValueError, sd.PortAudioError) as e:
        if device is None:
            raise DeviceError(f"no {what} found: PortAudio has no default {kind} device") from None
        raise DeviceError(f"cannot use {kind} device {device!r}: {e}") from None
    channels = info.get(f"max_{kind}_channels", 0)
    if channels < 1:
        raise DeviceError(f"device {info.get('name', device)!r} has no {kind} channels")
    return info


class _Stream(_Closing):
    """A started PortAudio stream of one float32 channel, stopped and closed by ``close``."""

    def _open(self, sd, cls, name: str, device, rate: int, **kw) -> None:
        try:
            stream = cls(device=device, channels=1, dtype="float32", samplerate=rate, **kw)
        except (sd.PortAudioError, ValueError) as e:
            raise DeviceError(f"cannot open {name} at {rate} Hz: {e}") from None
        try:
            stream.start()
        except BaseException as e:  # a stream that opened and did not start is closed
            stream.close()
            if isinstance(e, (sd.PortAudioError, ValueError)):
                raise DeviceError(f"cannot start {name} at {rate} Hz: {e}") from None
            raise
        self._stream = stream

    def close(self) -> None:
        self._stream.stop()
        self._stream.close()


class Microphone(_Stream):
    """A PortAudio input stream, read in blocks. Opened at ``sample_rate`` when the device
    takes it, else at the device's own rate (``sample_rate`` then says which: the session
    resamples)."""

    def __init__(self, device: Union[int, str, None] = None, sample_rate: int = 16000):
        sd = _sounddevice()
        info = _device(sd, device, "input")
        rate = int(sample_rate)
        try:
            sd.check_input_settings(device=device, channels=1, dtype="float32", samplerate=rate)
        except (sd.PortAudioError, ValueError):
            rate = int(info["default_samplerate"])
        self.sample_rate = rate
        self.overflows = 0
        self._open(sd, sd.InputStream, f"microphone {info['name']!r}", device, rate)

    def read(self, n: int) -> Optional[np.ndarray]:
        data, overflowed = self._stream.read(n)
        self.overflows += int(bool(overflowed))
        return data[:, 0].copy()


class PlayQueue:
    """Samples waiting to be played: ``push`` from the conversation's thread, ``fill`` from
    PortAudio's callback thread; what is not there plays as silence."""

    def __init__(self):
        self._blocks = collections.deque()
        self._head = np.zeros(0, np.float32)
        self._lock = threading.Lock()
        self.underruns = 0  # callbacks that ran out of speech part-way

    def push(self, samples) -> None:
        block = np.asarray(samples, dtype=np.float32).reshape(-1)
        with self._lock:
            self._blocks.append(block)

    def fill(self, out: np.ndarray) -> None:
        """Fill the 1-D ``out`` with the next samples, zeros past the end of the queue."""
        filled, frames = 0, len(out)
        with self._lock:
            while filled < frames:
                if not self._head.size:
                    if not self._blocks:
                        break
                    self._head = self._blocks.popleft()
                take = min(frames - filled, self._head.size)
                out[filled : filled + take] = self._head[:take]
                self._head = self._head[take:]
                filled += take
        if filled < frames:
            out[filled:] = 0.0
            self.underruns += int(filled > 0)

    def __len__(self) -> int:
        with self._lock:
            return self._head.size + sum(b.size for b in self._blocks)


class Speaker(_Stream):
    """A PortAudio output stream fed from a :class:`PlayQueue` by PortAudio's callback:
    ``write`` never blocks the conversation, and an empty queue plays silence."""

    def __init__(self, device: Union[int, str, None] = None, sample_rate: int = 22050):
        sd = _sounddevice()
        info = _device(sd, device, "output")
        self.sample_rate = int(sample_rate)
        self.queue = PlayQueue()
        self._open(
            sd,
            sd.OutputStream,
            f"speaker {info['name']!r}",
            device,
            self.sample_rate,
            callback=lambda out, _frames, _time, _status: self.queue.fill(out[:, 0]),
        )

    def write(self, samples) -> None:
        self.queue.push(samples)


def open_microphone(device=None, sample_rate: int = 16000) -> Microphone:
    return Microphone(device, sample_rate)


def open_speaker(device=None, sample_rate: int = 22050) -> Speaker:
    return Speaker(device, sample_rate)


def check(input_device=None, output_device=None) -> None:
    """Raise a DeviceError now when sounddevice, PortAudio or either device is missing."""
    sd = _sounddevice()
    _device(sd, input_device, "input")
    _device(sd, output_device, "output")
