"""``input_audio_buffer.speech_started`` / ``speech_stopped``: the speech detector
(:mod:`mlx_voicechat.audio.vad`) on the 16 kHz input as it arrives, before it waits for the
model. It only reports: the duplex model decides itself whether to stop talking, so
``turn_detection`` says ``server_vad`` with ``create_response`` and ``interrupt_response`` false.
"""

from __future__ import annotations

import numpy as np

from ..audio.vad import SpeechDetector
from .wire import MODEL_INPUT_RATE, Event


class SpeechEvents:
    """The speech events of a :class:`~.protocol.Realtime` connection's input; sets the
    protocol's ``turn_detection`` to what is in effect."""

    def __init__(self, protocol, detector: SpeechDetector | None = None):
        self.protocol = protocol
        self.detector = detector or SpeechDetector(MODEL_INPUT_RATE)
        self._item: str | None = None  # the user item of the speech in progress
        protocol.turn_detection = turn_detection(self.detector)

    def push(self, samples: np.ndarray, position: int) -> list[Event]:
        """Events for ``samples`` (16 kHz, in the session's timeline: ``position`` is the index
        of their first sample there, counting client audio and the server's silence)."""
        shift = position - self.detector.samples_seen
        out: list[Event] = []
        p = self.protocol
        for edge in self.detector.push(samples):
            ms = max(0, (edge.sample + shift) * 1000 // MODEL_INPUT_RATE)
            if edge.kind == "started":
                out += p.responses.open_user_item()  # the item the user's words will go into
                self._item = p.responses.user_item
                out.append(
                    p._event(
                        "input_audio_buffer.speech_started", audio_start_ms=ms, item_id=self._item
                    )
                )
            else:
                out.append(
                    p._event(
                        "input_audio_buffer.speech_stopped", audio_end_ms=ms, item_id=self._item
                    )
                )
        return out


def turn_detection(detector: SpeechDetector) -> dict:
    """The ``turn_detection`` object of ``session.updated`` for ``detector``."""
    return {
        "type": "server_vad",  # an energy detector (no `threshold`: its thresholds are levels)
        "prefix_padding_ms": 0,
        "silence_duration_ms": detector.hangover_ms,
        "create_response": False,  # the model decides when to speak
        "interrupt_response": False,  # and whether to stop when the user barges in
    }
