"""A WebRTC caller's audio on the RTP timeline: a lost packet holds nothing back, a gap is
heard as silence and audio after its time is dropped, each counted for the operator."""

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest

aiortc = pytest.importorskip("aiortc")
av = pytest.importorskip("av")
pytest.importorskip("prometheus_client")

from mlx_voicechat.serve.metrics import Metrics  # noqa: E402 (after the importorskip)
from mlx_voicechat.serve.webrtc_call import RtcConversation  # noqa: E402
from mlx_voicechat.serve.wire import MODEL_INPUT_RATE  # noqa: E402


def test_the_jitter_buffer_never_waits_on_a_lost_packet():
    """Each packet is decoded as it comes; a lost one holds nothing back, a late one is
    dropped (its time is heard as silence)."""
    from aiortc.rtp import RtpPacket

    from mlx_voicechat.serve.webrtc import LiveJitterBuffer

    buffer = LiveJitterBuffer()

    def packet(seq):
        p = RtpPacket(payload_type=111, sequence_number=seq % 65536, timestamp=960 * seq)
        p._data = bytes([seq % 256])
        return p

    released = [buffer.add(packet(s))[1] for s in (65534, 65535, 65537, 65538, 65536)]
    assert [f and f.timestamp for f in released[:4]] == [
        960 * s for s in (65534, 65535, 65537, 65538)
    ]
    assert released[4] is None and buffer.late == 1


def test_a_callers_gaps_are_silence_and_late_audio_is_dropped_both_counted():
    """20 ms frames (at 16 kHz: no resampler holds samples back): 100 ms of packets missing is
    filled with silence at once; a frame whose time the server's clock already filled with
    silence is dropped. The seconds of each are in ``voicechat_webrtc_audio_gap_seconds_total``."""
    from aiortc.mediastreams import MediaStreamError

    def frame(pts):
        f = av.AudioFrame.from_ndarray(np.full((1, 320), 1000, np.int16), "s16", "mono")
        f.sample_rate, f.pts = MODEL_INPUT_RATE, pts
        return f

    class Track:
        def __init__(self, conversation, steps):
            self.c, self.steps = conversation, iter(steps)

        async def recv(self):
            step = next(self.steps, None)
            if step is None:
                raise MediaStreamError
            if step[0] == "clock":  # the server's clock fills silence for a late caller
                self.c.position += int(step[1] * MODEL_INPUT_RATE)
                return await self.recv()
            return frame(step[1])

    metrics = Metrics("prometheus")
    c = RtcConversation.__new__(RtcConversation)
    heard = []

    def audio(samples, silence=False):
        heard.append((samples.size, silence))
        c.position += samples.size

    c.server, c.closing, c.position, c._audio = SimpleNamespace(metrics=metrics), None, 0, audio
    c.ws = SimpleNamespace(disconnect=lambda: heard.append("hung up"))
    # frames at 0 and 20 ms, then 100 ms missing (next at 140 ms), then 100 ms of clock
    # silence, then a frame 20 ms late (at 160 ms while 260 ms is queued)
    c.track = Track(c, [("at", 0), ("at", 320), ("at", 2240), ("clock", 0.1), ("at", 2560)])
    asyncio.run(c._listen())
    # the late frame never reaches the model
    assert heard == [(320, False), (320, False), (1600, True), (320, False), "hung up"]

    def gap(kind):
        return metrics.registry.get_sample_value(
            "voicechat_webrtc_audio_gap_seconds_total", {"kind": kind}
        )

    assert gap("missing") == pytest.approx(0.1, abs=1e-6)
    assert gap("late") == pytest.approx(0.02, abs=1e-6)
