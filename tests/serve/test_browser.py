"""The web page in real browsers, served by the real server on a tiny random-weight checkpoint.

Chromium (Selenium + Debian's ``chromium-driver``) plays a WAV file as its microphone; the test
is skipped only when no Chromium is installed. Firefox ESR is driven over WebDriver BiDi, which
Firefox speaks itself (Debian has no geckodriver), with its fake microphone (a tone) and a
PulseAudio null sink as its speaker (without an audio device Firefox never starts an
AudioContext); skipped without ``firefox-esr`` or ``pulseaudio``. Everything else is real: the
page's worklets capture and resample the microphone, the server feeds the session, the page plays
what comes back.
"""

import os
import subprocess
import time
from pathlib import Path

import pytest
from browser_harness import (  # noqa: F401, F811  (server: the page's server, a module fixture)
    API_KEY,
    CHROMIUM,
    DEADLINE_S,
    FIREFOX,
    FIREFOX_PREFS,
    MIN_PLAYED_FRAMES,
    MIN_SERVER_FRAMES,
    PLAYER_CHECK,
    PULSEAUDIO,
    Bidi,
    check_player,
    check_resampler,
    chromium,
    chromium_player_check,
    client_secret,
    console_errors,
    free_port,
    open_page,
    page_state,
    screenshots,
    server,
    stop_process,
    wait_for,
    write_microphone_wav,
)


@pytest.mark.skipif(
    CHROMIUM is None, reason="no Chromium (apt-get install chromium chromium-driver)"
)
def test_page_talks_to_the_model_in_chromium(server, tmp_path):
    started = time.monotonic()
    wav = write_microphone_wav(tmp_path / "mic.wav")
    driver = chromium(tmp_path / "profile", wav)
    try:
        open_page(driver, server.url, API_KEY)  # the key travels as a WebSocket subprotocol
        check_resampler(driver)
        check_player(chromium_player_check(driver))
        driver.find_element("id", "instructions").send_keys("You are a helpful assistant.")
        server.model.frames = 0  # the warm-up is not the page's
        driver.find_element("id", "start").click()

        state = wait_for(
            driver,
            lambda s: (
                s["framesPlayed"] >= MIN_PLAYED_FRAMES
                and s["userText"].strip()
                and s["assistantText"].strip()
                and server.model.frames >= MIN_SERVER_FRAMES
            ),
            DEADLINE_S,
            f"{MIN_SERVER_FRAMES} server frames, a user transcript, assistant text and {MIN_PLAYED_FRAMES} played frames",
        )
        assert state["state"] == "connected", state
        assert state["lastError"] is None, state
        assert state["framesSent"] >= MIN_SERVER_FRAMES, state
        assert state["framesReceived"] >= state["framesPlayed"] >= MIN_PLAYED_FRAMES, state
        assert state["contextRate"] > 0 and state["inputRate"] == 16000, state
        assert state["latencyMs"] is not None and state["latencyMs"] > 0, state
        # The page shows the words, not only its state object.
        assert driver.find_element("id", "user").text.strip()
        assert driver.find_element("id", "assistant").text.strip()
        assert driver.find_element("id", "status").text == "connected: talk"
        assert driver.find_element("id", "model").text == "tiny-random"
        # The server's stats event reached the page (lag, frame count, real-time factor).
        wait_for(
            driver,
            lambda s: (
                s["serverFrames"] is not None and s["lagMs"] is not None and s["rtf"] is not None
            ),
            10,
            "the server's stats",
        )
        shot = os.environ.get("MLX_VOICECHAT_SCREENSHOT")  # the README's picture
        if shot:
            wait_for(driver, lambda s: s["framesPlayed"] >= 60, 30, "a few seconds of conversation")
            screenshots(driver, Path(shot))

        # Interrupt: the response in progress ends as cancelled (and the player is emptied).
        wait_for(driver, lambda s: s["speaking"], 15, "a response in progress")
        driver.find_element("id", "interrupt").click()
        deadline = time.monotonic() + 10
        while not driver.find_elements("css selector", "#assistant .entry.cancelled"):
            assert time.monotonic() < deadline, f"no cancelled response: {page_state(driver)}"
            time.sleep(0.2)

        # A second page while the first is talking: the one slot is taken.
        first = driver.current_window_handle
        driver.switch_to.new_window("tab")
        open_page(driver, server.url, API_KEY)
        driver.find_element("id", "start").click()
        busy = wait_for(
            driver, lambda s: s["state"] == "busy", 15, "the busy state", ended=("error",)
        )
        assert busy["closeCode"] == 1013, busy
        assert driver.find_element("id", "status").text == "the model is busy, try again"
        assert "the model is busy, try again" in driver.find_element("id", "error").text
        assert console_errors(driver) == []
        driver.close()

        # A wrong key is refused before any work, in words on the page.
        driver.switch_to.window(first)
        driver.switch_to.new_window("tab")
        open_page(driver, server.url, "not-the-key")
        driver.find_element("id", "start").click()
        refused = wait_for(
            driver, lambda s: s["state"] == "error", 15, "the refusal", ended=("busy", "closed")
        )
        assert "refused" in refused["lastError"], refused
        assert "refused" in driver.find_element("id", "error").text
        unexpected = [e for e in console_errors(driver) if "WebSocket" not in e["message"]]
        assert unexpected == []
        driver.close()

        # The first page is still in its conversation, and stops cleanly.
        driver.switch_to.window(first)
        sent = page_state(driver)["framesSent"]
        wait_for(
            driver,
            lambda s: s["framesSent"] > sent and s["state"] == "connected",
            10,
            "more frames sent",
        )
        driver.find_element("id", "stop").click()
        wait_for(driver, lambda s: s["state"] == "closed", 5, "the stopped state", ended=("error",))
        assert console_errors(driver) == []
    finally:
        driver.quit()
    assert time.monotonic() - started < 80


@pytest.mark.skipif(FIREFOX is None or PULSEAUDIO is None, reason="no firefox-esr / pulseaudio")
def test_page_talks_to_the_model_in_firefox(server, tmp_path):
    import asyncio
    import json
    import urllib.request

    import websockets

    started = time.monotonic()
    health = server.url + "/health"
    deadline = time.monotonic() + 10
    while json.load(urllib.request.urlopen(health, timeout=5))["sessions"]:
        assert time.monotonic() < deadline, "the server's session slot was not freed"
        time.sleep(0.1)

    home = tmp_path / "home"
    (home / "pulse").mkdir(parents=True)
    profile = tmp_path / "profile"
    profile.mkdir()
    (profile / "user.js").write_text(
        "".join(f"user_pref({json.dumps(k)}, {json.dumps(v)});\n" for k, v in FIREFOX_PREFS.items())
    )
    env = dict(
        os.environ,
        HOME=str(home),
        XDG_RUNTIME_DIR=str(home),
        PULSE_RUNTIME_PATH=str(home / "pulse"),
    )
    env.pop("DISPLAY", None)
    pulse = subprocess.Popen(
        [
            PULSEAUDIO,
            "--daemonize=no",
            "--exit-idle-time=-1",
            "-n",
            "--use-pid-file=no",
            "--load=module-null-sink sink_name=null",
            "--load=module-native-protocol-unix",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    firefox = None
    try:
        deadline = time.monotonic() + 10
        while not (home / "pulse" / "native").exists():
            assert pulse.poll() is None and time.monotonic() < deadline, "PulseAudio did not start"
            time.sleep(0.05)
        port = free_port()
        firefox = subprocess.Popen(
            [
                FIREFOX,
                "--headless",
                "--no-remote",
                "--profile",
                str(profile),
                f"--remote-debugging-port={port}",
                "about:blank",
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

        async def drive() -> dict:
            deadline = time.monotonic() + 30
            while True:
                try:
                    ws = await websockets.connect(
                        f"ws://127.0.0.1:{port}/session", max_size=1 << 24
                    )
                    break
                except OSError:
                    assert firefox.poll() is None and time.monotonic() < deadline, (
                        "Firefox did not start"
                    )
                    await asyncio.sleep(0.1)
            async with ws:
                b = Bidi(ws)
                await b.call("session.new", capabilities={})
                await b.call("session.subscribe", events=["log.entryAdded"])
                context = (await b.call("browsingContext.getTree"))["contexts"][0]["context"]
                await b.call(
                    "browsingContext.navigate",
                    context=context,
                    url=server.url + "/",
                    wait="complete",
                )
                assert await b.js(context, "window.voicechat.state") == "idle"
                check_player(await b.js(context, f"({PLAYER_CHECK})()"))
                await b.js(
                    context,
                    "document.getElementById('secret').value = "
                    + json.dumps(client_secret(server.url, API_KEY)),
                )
                # The protocol's default rate here (Chromium sends the model's 16 kHz).
                await b.js(context, "document.getElementById('rate').value = '24000'")
                await b.js(context, "document.getElementById('transport').value = 'websocket'")
                await b.click(context, "start")
                deadline = time.monotonic() + DEADLINE_S
                while True:
                    state = await b.js(context, "Object.assign({}, window.voicechat)")
                    if (
                        state["framesPlayed"] >= MIN_PLAYED_FRAMES
                        and state["userText"].strip()
                        and state["assistantText"].strip()
                    ):
                        break
                    assert (
                        state["state"] in ("idle", "connecting", "connected")
                        and time.monotonic() < deadline
                    ), state
                    await asyncio.sleep(0.25)
                await b.click(context, "stop")
                state["after_stop"] = await b.js(context, "window.voicechat.state")
                state["console"] = [
                    e["params"]
                    for e in b.events
                    if e["method"] == "log.entryAdded" and e["params"].get("level") == "error"
                ]
                return state  # (Firefox 153 does not answer session.end; it is stopped below)

        state = asyncio.run(asyncio.wait_for(drive(), 60))
    finally:
        if firefox is not None:
            stop_process(firefox)
        stop_process(pulse)
    assert state["lastError"] is None, state
    assert (
        state["framesSent"] >= MIN_PLAYED_FRAMES
        and state["framesReceived"] >= state["framesPlayed"]
    ), state
    assert state["inputRate"] == 24000 and state["contextRate"] > 0, state
    assert state["latencyMs"] is not None and state["serverFrames"] is not None, state
    assert state["after_stop"] == "closed", state
    assert state["console"] == [], state["console"]
    assert time.monotonic() - started < 60
