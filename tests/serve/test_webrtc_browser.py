"""The web page over WebRTC in headless Chromium (a WAV file as its microphone), served by the
real server on the tiny random-weight checkpoint: the page's default transport converses
(the model's words and speech come back, the round-trip time is shown), and with the server's
WebRTC off the page falls back to the WebSocket by itself."""

import json
import time
import urllib.request

import pytest

pytest.importorskip("aiortc")
pytest.importorskip("selenium")

from browser_harness import (  # noqa: E402, F401  (the browser tests' fixtures and helpers)
    API_KEY,
    CHROMIUM,
    chromium,
    open_page,
    page_state,
    server,
    wait_for,
    write_microphone_wav,
)

pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="no Chromium (apt-get install chromium chromium-driver)"
)


def wait_free(server, timeout=20.0):  # noqa: F811
    deadline = time.monotonic() + timeout
    while True:
        with urllib.request.urlopen(server.url + "/health", timeout=5) as r:
            if json.loads(r.read())["sessions"] == 0:
                return
        assert time.monotonic() < deadline, "the server's session was not freed"
        time.sleep(0.1)


def test_page_talks_over_webrtc_and_falls_back_to_the_websocket(server, tmp_path, monkeypatch):  # noqa: F811
    wav = write_microphone_wav(tmp_path / "mic.wav")
    driver = chromium(tmp_path / "profile", wav)
    try:
        open_page(driver, server.url, API_KEY, transport="webrtc")
        driver.find_element("id", "start").click()
        state = wait_for(
            driver,
            lambda s: (
                s["transport"] == "webrtc"
                and s["state"] == "connected"
                and s["framesReceived"] >= 8
                and s["userText"].strip()
                and s["assistantText"].strip()
                and s["rttMs"] is not None
            ),
            60,
            "a WebRTC conversation (speech received, both transcripts, the round-trip time)",
        )
        assert state["lastError"] is None and state["webrtcError"] is None, state
        assert state["framesSent"] > 0 and state["latencyMs"] is not None, state
        assert driver.find_element("id", "transport-info").text.startswith("WebRTC, RTT ")
        driver.find_element("id", "stop").click()
        wait_for(driver, lambda s: s["state"] == "closed", 5, "the stopped state", ended=("error",))
        wait_free(server)

        # The server without WebRTC: the page says why and goes on over the WebSocket.
        from mlx_voicechat.serve import webrtc

        monkeypatch.setattr(webrtc, "available", lambda: "WebRTC needs aiortc (test: off)")
        open_page(driver, server.url, API_KEY, transport="webrtc")
        driver.find_element("id", "start").click()
        state = wait_for(
            driver,
            lambda s: s["transport"] == "websocket" and s["framesReceived"] >= 8,
            60,
            "the WebSocket after WebRTC was refused",
        )
        assert "aiortc" in state["webrtcError"], state
        assert driver.find_element("id", "transport-info").text == "WebSocket"
        driver.find_element("id", "stop").click()
        wait_for(driver, lambda s: s["state"] == "closed", 5, "the stopped state", ended=("error",))
    finally:
        driver.quit()
    wait_free(server)
