"""@openai/agents-realtime's WebRTC transport (`OpenAIRealtimeWebRTC` under a `RealtimeSession`)
in headless Chromium, on its defaults but for the base URL and a client secret: a web app's
page (its own origin, served here by a plain HTTP server) converses with `serve` on the tiny
checkpoint, and the secret does not admit a second call. The SDK comes from the npm registry
(tests/serve/js_webrtc/package-lock.json, installed once into a cache) and is bundled by esbuild."""

import functools
import hashlib
import http.server
import json
import os
import shutil
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("aiortc")
pytest.importorskip("selenium")

from browser_harness import CHROMIUM, chromium, write_microphone_wav  # noqa: E402
from test_webrtc import mint  # noqa: E402

from mlx_voicechat.serve.app import ServerThread, create_app  # noqa: E402

HERE = Path(__file__).parent / "js_webrtc"
NPM = shutil.which("npm")
KEY = "agents-js-key"
TIMEOUT = 60.0

pytestmark = [
    pytest.mark.skipif(CHROMIUM is None, reason="no Chromium (apt-get install chromium)"),
    pytest.mark.skipif(NPM is None, reason="no npm (apt-get install nodejs npm)"),
]


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    """The web app's page and the SDK bundle, served from their own origin."""
    lock = (HERE / "package-lock.json").read_bytes()
    cache_root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    cache = (
        cache_root / "mlx-voicechat-tests" / f"webrtc-js-{hashlib.sha256(lock).hexdigest()[:12]}"
    )
    if not (cache / "node_modules" / ".bin" / "esbuild").exists():
        staging = cache.with_name(cache.name + f".{os.getpid()}")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        for name in ("package.json", "package-lock.json"):
            shutil.copy(HERE / name, staging / name)
        subprocess.run(
            [NPM, "ci", "--no-audit", "--no-fund"],
            cwd=staging,
            check=True,
            timeout=300,
            capture_output=True,
        )
        shutil.rmtree(cache, ignore_errors=True)
        staging.rename(cache)
    out = tmp_path_factory.mktemp("webapp")
    shutil.copy(HERE / "agent.mjs", cache / "agent.mjs")
    subprocess.run(
        [
            str(cache / "node_modules" / ".bin" / "esbuild"),
            "agent.mjs",
            "--bundle",
            "--format=iife",
            "--platform=browser",
            f"--outfile={out / 'agent.js'}",
            "--log-level=error",
        ],
        cwd=cache,
        check=True,
        timeout=120,
    )
    (out / "index.html").write_text(
        '<!doctype html><title>web app</title><script src="agent.js"></script>\n'
    )
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(out))
    handler.log_message = lambda *a: None
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture(scope="module")
def served(model, worker, page):  # noqa: F811
    app = create_app(model, api_key=KEY, worker=worker, warmup=False, allow_origins=(page,))
    with ServerThread(app) as s:
        s.app = app
        yield s


def agent_state(driver) -> dict:
    return driver.execute_script(
        "const a = window.agent; return {events: a.events, transcripts: a.transcripts,"
        " error: a.error, status: a.status, callId: a.callId || null}"
    )


def test_agents_sdk_webrtc_transport_converses_with_a_client_secret(served, page, tmp_path):
    status, _, body = mint(served, key=KEY)
    assert status == 200, body
    secret = json.loads(body)["value"]
    driver = chromium(tmp_path / "profile", write_microphone_wav(tmp_path / "mic.wav"))
    try:
        driver.get(page + "/")
        calls = served.url + "/v1/realtime/calls"
        driver.execute_script("window.startAgent(arguments[0], arguments[1])", calls, secret)
        deadline = time.monotonic() + TIMEOUT
        while True:
            state = agent_state(driver)
            done = {"session.created", "output_audio_buffer.started", "response.done"}
            if done <= set(state["events"]) and state["transcripts"]:
                break
            assert state["error"] is None, state["error"]
            assert time.monotonic() < deadline, f"no conversation: {sorted(set(state['events']))}"
            time.sleep(0.25)
        assert state["status"] == "connected" and state["callId"].startswith("rtc_"), state
        assert "error" not in state["events"] and "session.updated" in state["events"]
        # The page never held the server's key, and its secret admitted this call only.
        driver.execute_script("window.agent.session.close()")
        driver.get(page + "/")
        driver.execute_script("window.startAgent(arguments[0], arguments[1])", calls, secret)
        deadline = time.monotonic() + TIMEOUT
        while agent_state(driver)["error"] is None:
            assert time.monotonic() < deadline, "the used secret was not refused"
            time.sleep(0.25)
        assert "401" in agent_state(driver)["error"]
    finally:
        driver.quit()
    deadline = time.monotonic() + 20
    while served.app.state.server.active or served.app.state.webrtc_calls:
        assert time.monotonic() < deadline, "the call was left running"
        time.sleep(0.1)
    models = urllib.request.Request(
        served.url + "/v1/models", headers={"Authorization": f"Bearer {secret}"}
    )
    with pytest.raises(urllib.error.HTTPError) as refused:  # a secret is no API key
        urllib.request.urlopen(models, timeout=10)
    assert refused.value.code == 401
