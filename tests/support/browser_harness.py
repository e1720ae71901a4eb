"""The browser harness of the page tests (tests/serve/test_browser.py, test_webrtc_browser.py,
test_webrtc_agents_js.py, tests/nemotron_asr/test_asr_browser.py): the installed browsers, a spoken WAV
as Chromium's microphone, Chromium through Selenium and Debian's ``chromium-driver``, Firefox
ESR over WebDriver BiDi (``Bidi``: Firefox speaks it itself, Debian has no geckodriver), the
page's state and checks, and the page's server (``server``: the real server on a tiny
random-weight checkpoint, counting the frames its session batch emits).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import wave
from pathlib import Path

import numpy as np
import pytest

CHROMIUM = next(
    (
        p
        for p in ("/usr/bin/chromium", shutil.which("chromium"), shutil.which("chromium-browser"))
        if p and os.path.exists(p)
    ),
    None,
)
CHROMEDRIVER = (
    "/usr/bin/chromedriver"
    if os.path.exists("/usr/bin/chromedriver")
    else shutil.which("chromedriver")
)

FIREFOX = shutil.which("firefox-esr") or shutil.which("firefox")
PULSEAUDIO = shutil.which("pulseaudio")

SPOKEN = (
    "Hello, how are you today? Please tell me the weather in Santa Clara this afternoon. "
    "What is the capital of France?"
)
MIN_SERVER_FRAMES = 25  # 2 s of microphone audio through the session
MIN_PLAYED_FRAMES = 8  # reply frames the page's player received and played out
DEADLINE_S = 40.0  # for the page to get there


def write_microphone_wav(path: Path) -> Path:
    """Several seconds of speech (espeak-ng) or, without it, a tone sequence: 16-bit PCM mono."""
    espeak = shutil.which("espeak-ng")
    if espeak:
        subprocess.run(
            [espeak, "-w", str(path), SPOKEN], check=True, capture_output=True, timeout=30
        )
        with wave.open(str(path)) as w:
            if w.getsampwidth() == 2 and w.getnframes() > 2 * w.getframerate():
                return path
    rate = 16000
    t = np.arange(int(6 * rate)) / rate
    pitch = 180 + 60 * np.sin(2 * np.pi * 0.7 * t)  # a voice-like glide, with pauses
    tone = 0.3 * np.sin(2 * np.pi * np.cumsum(pitch) / rate) * (np.sin(2 * np.pi * 0.5 * t) > -0.3)
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((tone * 32767).astype("<i2").tobytes())
    return path


class CountingModel:
    """The real model; the session batch the server opens counts the frames its steps emit
    (what the server consumed), nothing else changes."""

    def __init__(self, model):
        self._model = model
        self.frames = 0

    def __getattr__(self, name):
        return getattr(self._model, name)

    def session_batch(self, *args, **kwargs):
        return CountingBatch(self, self._model.session_batch(*args, **kwargs))


class CountingBatch:
    def __init__(self, owner: CountingModel, batch):
        self._owner, self._batch = owner, batch

    def __getattr__(self, name):
        return getattr(self._batch, name)

    def __len__(self):
        return len(self._batch)

    def step(self, *args, **kwargs):
        out = self._batch.step(*args, **kwargs)
        self._owner.frames += sum(len(events) for events in out.values())
        return out


API_KEY = "browser-test-key"


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    import mlx_voicechat
    from mlx_voicechat.serve.app import ServerThread, create_app

    model = CountingModel(mlx_voicechat.load(tiny_checkpoint))
    app = create_app(
        model, api_key=API_KEY, model_id="tiny-random", max_sessions=1, stats_every_frames=5
    )
    with ServerThread(app) as s:
        s.model = model
        yield s


def chromium(tmp: Path, wav: Path):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    assert CHROMEDRIVER, (
        "Chromium is installed but chromedriver is not (apt-get install chromium-driver)"
    )
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        "--use-fake-ui-for-media-stream",
        "--use-fake-device-for-media-stream",
        f"--use-file-for-fake-audio-capture={wav}",
        f"--user-data-dir={tmp}",
        "--window-size=1280,1000",
    ):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(20)
    driver.set_script_timeout(10)
    return driver


def page_state(driver) -> dict:
    return driver.execute_script("return Object.assign({}, window.voicechat)")


def wait_for(driver, condition, timeout: float, what: str, ended=("error", "closed")) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        state = page_state(driver)
        if condition(state):
            return state
        if time.monotonic() > deadline or state["state"] in ended:
            error = driver.find_element("id", "error").text
            raise AssertionError(
                f"the page did not get {what} in {timeout:.0f} s: {state} (error shown: {error!r})"
            )
        time.sleep(0.25)


def console_errors(driver) -> list:
    return [e for e in driver.get_log("browser") if e.get("level") == "SEVERE"]


def client_secret(url: str, key: str) -> str:
    """A client secret minted with the server's key, as a web app's back-end does."""
    import json
    import urllib.request

    request = urllib.request.Request(
        url + "/v1/realtime/client_secrets",
        data=b"{}",
        method="POST",
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as r:
        return json.loads(r.read())["value"]


def open_page(driver, url: str, key: str, transport: str = "websocket"):
    driver.get(url + "/")
    assert driver.title == "mlx-voicechat"
    assert page_state(driver)["state"] == "idle"
    # The page takes a client secret, never the server's key: the test's back-end mints one.
    secret = client_secret(url, key) if key == API_KEY else key
    driver.find_element("id", "secret").send_keys(secret)
    # WebRTC is the page's default; its tests are tests/serve/test_webrtc_browser.py
    driver.execute_script("document.getElementById('transport').value = arguments[0]", transport)


def screenshots(driver, target: Path) -> None:
    """The page in use at desktop and phone width, side by side, into ``target``."""
    from PIL import Image

    parts = []
    for width, name in ((1280, "desktop"), (390, "phone")):
        metrics = {"width": width, "height": 800, "deviceScaleFactor": 1, "mobile": width < 500}
        driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", metrics)
        time.sleep(0.5)
        metrics["height"] = min(1800, driver.execute_script("return document.body.scrollHeight"))
        driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", metrics)
        time.sleep(1.0)
        path = target.with_name(f"{target.stem}-{name}.png")
        driver.save_screenshot(str(path))
        parts.append(Image.open(path).convert("RGB"))
        path.unlink()
    driver.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})
    gap = 24
    height = max(p.height for p in parts)
    sheet = Image.new("RGB", (sum(p.width for p in parts) + gap, height), "#f6f7f9")  # page bg
    sheet.paste(Image.new("RGB", (gap, height), "#c9ced6"), (parts[0].width, 0))
    sheet.paste(parts[0], (0, 0))
    sheet.paste(parts[1], (parts[0].width + gap, 0))
    sheet.save(target, optimize=True)


PLAYER_CHECK = """async () => {
  const rate = 48000;
  const ctx = new OfflineAudioContext(1, rate * 1.2, rate);
  await ctx.audioWorklet.addModule('/static/resampler.js');
  await ctx.audioWorklet.addModule('/static/playback-worklet.js');
  const node = new AudioWorkletNode(ctx, 'voicechat-playback', {
    numberOfInputs: 0, numberOfOutputs: 1, outputChannelCount: [1],
    processorOptions: {inputRate: 24000, startSeconds: 0.08, growSeconds: 0.04,
                       maxTargetSeconds: 0.3, maxLatencySeconds: 0.5},
  });
  node.connect(ctx.destination);
  let stats = null;
  node.port.onmessage = (e) => { if (e.data.type === 'stats') stats = e.data; };
  let sent = 0;
  const send = (frames) => {  // 80 ms frames of one continuous 440 Hz tone at 24 kHz
    for (let k = 0; k < frames; k++, sent++) {
      const x = new Float32Array(1920);
      for (let i = 0; i < x.length; i++) {
        x[i] = 0.5 * Math.sin(2 * Math.PI * 440 * (sent * 1920 + i) / 24000);
      }
      node.port.postMessage({type: 'audio', samples: x});
    }
  };
  const settle = () => new Promise((r) => setTimeout(r, 100));
  const at = (t, fn) => ctx.suspend(t).then(async () => { fn(); await settle(); ctx.resume(); });
  // Firefox has no OfflineAudioContext.suspend: there, only the first part.
  const timed = typeof ctx.suspend === 'function';
  send(3);  // 240 ms, then nothing: an underrun
  if (timed) {
    at(0.4, () => send(4));  // 320 ms, then an underrun again
    at(0.8, () => send(5));  // 400 ms queued ...
    at(0.9, () => node.port.postMessage({type: 'flush'}));  // ... and emptied (an interrupt)
  }
  await settle();
  const y = (await ctx.startRendering()).getChannelData(0);
  await settle();
  let jump = 0, peak = 0, tail = 0;
  for (let i = 1; i < y.length; i++) {
    jump = Math.max(jump, Math.abs(y[i] - y[i - 1]));
    peak = Math.max(peak, Math.abs(y[i]));
  }
  for (let i = Math.round(0.92 * rate); i < y.length; i++) tail = Math.max(tail, Math.abs(y[i]));
  return {timed, jump, peak, tail, step: 0.5 * 2 * Math.PI * 440 / rate, stats};
}"""


def check_player(result: dict) -> None:
    """The playback worklet rendered offline: a tone sent in 80 ms packets, two underruns and an
    interrupt play without a click (no sample step larger than the tone's own), the jitter
    buffer grew on underrun and started over when emptied, nothing is left after the flush."""
    assert "error" not in result, result
    stats = result["stats"]
    assert result["jump"] <= 1.01 * result["step"] and abs(result["peak"] - 0.5) < 1e-3, result
    assert result["tail"] == 0 and stats["queuedSeconds"] == 0, result
    if not result["timed"]:  # three packets, then an underrun
        assert stats["received"] == stats["played"] == 3 and stats["underruns"] == 1, result
        assert abs(stats["targetSeconds"] - 0.12) < 1e-6, result
        return
    assert stats["received"] == 12 and stats["played"] + stats["dropped"] == 12, result
    assert stats["played"] >= 7 and stats["underruns"] >= 2, result
    assert abs(stats["targetSeconds"] - 0.08) < 1e-6, result


def chromium_player_check(driver) -> dict:
    return driver.execute_async_script(
        "const done = arguments[arguments.length - 1];"
        f"({PLAYER_CHECK})().then(done, (e) => done({{error: String(e)}}));"
    )


RESAMPLER_CHECK = """
const [rateIn, rateOut, freq] = arguments;
const x = new Float32Array(rateIn);
for (let i = 0; i < x.length; i++) x[i] = Math.sin(2 * Math.PI * freq * i / rateIn);
const whole = Array.from(new StreamResampler(rateIn, rateOut).process(x));
const blocks = new StreamResampler(rateIn, rateOut);
let pieces = [];
for (let i = 0, n = 1; i < x.length; i += n, n = 1 + (i * 7919) % 300) {
  pieces = pieces.concat(Array.from(blocks.process(x.subarray(i, i + n))));
}
let seam = 0, peak = 0, error = 0;
for (let j = 0; j < whole.length; j++) seam = Math.max(seam, Math.abs(whole[j] - pieces[j]));
for (let j = Math.floor(rateOut * 0.1); j < Math.floor(rateOut * 0.8); j++) {
  peak = Math.max(peak, Math.abs(whole[j]));
  error = Math.max(error, Math.abs(whole[j] - Math.sin(2 * Math.PI * freq * j / rateOut)));
}
return {n: whole.length, pieces: pieces.length, seam, peak, error};
"""


def check_resampler(driver) -> None:
    """The worklets' resampler, run in the page: the same samples whatever the block sizes
    (no seam at joins), a pass-band tone kept, a tone above the new Nyquist removed."""
    for rate_in, rate_out in ((48000, 16000), (44100, 24000), (24000, 48000), (24000, 44100)):
        r = driver.execute_script(RESAMPLER_CHECK, rate_in, rate_out, 1000)
        assert r["n"] == r["pieces"] and r["n"] > 0.99 * rate_out, r
        assert r["seam"] < 1e-6 and r["error"] < 1e-3 and abs(r["peak"] - 1) < 1e-3, r
    r = driver.execute_script(RESAMPLER_CHECK, 48000, 16000, 10000)
    assert r["peak"] < 1e-3, r


FIREFOX_PREFS = {
    "media.navigator.streams.fake": True,  # a fake microphone (a tone)
    "media.navigator.permission.disabled": True,
    "media.autoplay.default": 0,
    "remote.active-protocols": 1,  # BiDi only
    "browser.shell.checkDefaultBrowser": False,
    "datareporting.policy.dataSubmissionEnabled": False,
    "toolkit.telemetry.reportingpolicy.firstRun": False,
    "app.update.enabled": False,
    "extensions.update.enabled": False,
    "network.captive-portal-service.enabled": False,
    "browser.safebrowsing.malware.enabled": False,
    "browser.safebrowsing.phishing.enabled": False,
    "browser.startup.homepage_override.mstone": "ignore",
}


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Bidi:
    """The few WebDriver BiDi commands the test needs, over one WebSocket."""

    def __init__(self, ws):
        self.ws, self.count, self.events = ws, 0, []

    async def call(self, method: str, **params):
        import asyncio
        import json

        self.count += 1
        mine = self.count
        await self.ws.send(json.dumps({"id": mine, "method": method, "params": params}))
        deadline = time.monotonic() + 15
        while True:
            left = deadline - time.monotonic()
            try:
                message = json.loads(await asyncio.wait_for(self.ws.recv(), max(left, 0.01)))
            except asyncio.TimeoutError:
                raise AssertionError(f"Firefox did not answer {method} in 15 s (a hung page?)")
            if message.get("id") == mine:
                assert message.get("type") != "error", f"{method}: {message}"
                return message["result"]
            if message.get("type") == "event":
                self.events.append(message)

    async def js(self, context: str, expression: str):
        """Evaluate ``expression`` (JSON.stringify'd in the page) and return it parsed."""
        import json

        result = await self.call(
            "script.evaluate",
            expression=f"Promise.resolve({expression}).then((v) => JSON.stringify(v === undefined ? null : v))",
            target={"context": context},
            awaitPromise=True,
            resultOwnership="none",
        )
        assert result["type"] == "success", result.get("exceptionDetails", result).get("text")
        return json.loads(result["result"]["value"])

    async def click(self, context: str, element_id: str):
        """A real pointer click (a user gesture, as an AudioContext wants)."""
        x, y = await self.js(
            context,
            f"(() => {{ const r = document.getElementById('{element_id}').getBoundingClientRect();"
            " return [Math.round(r.x + r.width / 2), Math.round(r.y + r.height / 2)]; })()",
        )
        actions = [
            {"type": "pointerMove", "x": x, "y": y},
            {"type": "pointerDown", "button": 0},
            {"type": "pointerUp", "button": 0},
        ]
        await self.call(
            "input.performActions",
            context=context,
            actions=[
                {
                    "type": "pointer",
                    "id": "mouse",
                    "parameters": {"pointerType": "mouse"},
                    "actions": actions,
                }
            ],
        )


def stop_process(process) -> None:
    process.terminate()
    try:
        process.wait(10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(10)
