"""The JavaScript clients through npm, each on its defaults with only the URL and key changed,
against a real server (uvicorn on 127.0.0.1, the tiny factory checkpoint): `@openai/agents-realtime`
(Node, WebSocket transport) and the `openai` package's `openai/realtime/ws` (always `wss:`, so
over `--ssl-*` with a throwaway certificate that Node trusts through NODE_EXTRA_CA_CERTS).

The Node scripts are in tests/serve/js/; the pinned packages (tests/serve/js/package-lock.json) are installed
from the npm registry with `npm ci` into a cache folder ($MLX_VOICECHAT_NPM_CACHE, else
~/.cache/mlx-voicechat/npm-<hash of the lock>), once. Without node and npm the tests skip; where
the install fails they skip too, except under CI (CI set), where they fail. Random weights never
write a tool call: once the client's audio flows, the test forces one into the live session's
function channel (as tests/serve/test_server_tools.py does) and the client runs the round trip. The
agents client then barges in with espeak-ng speech (interrupt() by hand without espeak-ng).
"""

import hashlib
import json
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from framework_support import Recording
from tls_support import self_signed

from mlx_voicechat.serve.app import ServerThread, create_app
from mlx_voicechat.serve.worker import Worker

JS = Path(__file__).resolve().parent / "js"
KEY = "the-js-key"
CALL = '<TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</TOOLCALL>'
NODE_TIMEOUT = 240  # seconds, one Node script at most
LAG = 120.0  # seconds of audio that may wait for the model: a loaded CI machine runs behind


@pytest.fixture(scope="module")
def node_modules():
    """The folder holding the pinned npm packages (installed once, from the registry)."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if not (node and npm):
        pytest.skip("node and npm are needed for the JavaScript client tests (Node 20 or later)")
    version = subprocess.run([node, "--version"], capture_output=True, text=True, check=False)
    version = version.stdout.strip()
    if int(version.lstrip("v").split(".")[0] or 0) < 20:
        pytest.skip(f"the JavaScript client tests need Node 20 or later, not {version}")
    lock = (JS / "package-lock.json").read_bytes()
    name = f"npm-{hashlib.sha256(lock).hexdigest()[:16]}"
    default = Path.home() / ".cache" / "mlx-voicechat" / name
    folder = Path(os.environ.get("MLX_VOICECHAT_NPM_CACHE") or default)
    if not (folder / "node_modules" / ".package-lock.json").is_file():
        staging = folder.with_name(folder.name + f".tmp{os.getpid()}")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        for name in ("package.json", "package-lock.json"):
            shutil.copy(JS / name, staging / name)
        done = subprocess.run(
            [npm, "ci", "--no-audit", "--no-fund", "--loglevel=error"],
            cwd=staging, capture_output=True, text=True, timeout=600, check=False,
        )
        if done.returncode != 0:
            shutil.rmtree(staging, ignore_errors=True)
            why = f"npm ci failed: {(done.stderr or done.stdout).strip()[-500:]}"
            if os.environ.get("CI"):
                pytest.fail(why)
            pytest.skip(why)
        shutil.rmtree(folder, ignore_errors=True)
        staging.rename(folder)  # whole or not at all
    return folder


@pytest.fixture(scope="module")
def worker():
    return Worker.shared()


@pytest.fixture(scope="module")
def model(worker, tiny_checkpoints):
    """The tiny checkpoint as it is (it starts a turn at once and keeps talking), loaded on the
    worker, which runs all MLX work of the server."""
    import mlx_voicechat

    return worker.submit(mlx_voicechat.load, tiny_checkpoints["mlx-community"]).result()


@pytest.fixture(scope="module")
def cert(tmp_path_factory):
    return self_signed(tmp_path_factory.mktemp("js-tls"))


def run_node(script, node_modules, env, rec, worker):
    """Run tests/serve/js/``script`` (copied next to the packages, where Node's ESM resolution finds
    them) while a thread forces a get_weather call into the session the client opens; the
    script's result."""
    for name in (script, "wait.mjs"):  # the script and the helpers it imports
        shutil.copy(JS / name, node_modules / name)
    proc = subprocess.Popen(
        ["node", str(node_modules / script)],
        cwd=node_modules,
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    tok = rec.model.tokenizer
    start, end = tok.convert_tokens_to_ids(["<SPECIAL_20>", "<SPECIAL_21>"])
    ids = [start] + tok.encode(CALL, add_special_tokens=False) + [end]
    forced = []

    def force_once_audio_flows():
        deadline = time.monotonic() + NODE_TIMEOUT
        while not rec.sessions and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if rec.sessions:
            session = rec.sessions[-1]

            def force_all():  # in one job: no frame runs between the forced ids
                for i in ids:
                    session.force(None, i)

            worker.submit(force_all).result()
            forced.append(len(ids))

    forcer = threading.Thread(target=force_once_audio_flows, daemon=True)
    forcer.start()
    try:
        out, err = proc.communicate(timeout=NODE_TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    forcer.join(10)
    lines = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    results = [x["result"] for x in lines if "result" in x]
    assert results, f"{script} printed no result (exit {proc.returncode}):\n{err[-3000:]}"
    assert forced, "the client never opened a session"
    return results[-1], proc.returncode, err


def check_the_round(seen, exit_code, err):
    """What every client must have seen: its setup kept, audio, a tool round trip, an accepted
    interrupt, and no error event."""
    assert exit_code == 0 and "failure" not in seen, (seen.get("failure"), err[-2000:], seen)
    final = seen["updated"][-1]
    assert final["instructions"] == "You are a weather assistant. Be brief."
    assert [t["name"] for t in final["tools"]] == ["get_weather"]
    assert seen["audioDeltas"] > 0
    assert seen["toolCalls"] == ["Paris"] and seen["toolOutputs"] == 1
    assert seen["cancelled"] or seen.get("truncated")
    assert seen["errors"] == [], seen["errors"]


@pytest.fixture(scope="module")
def speech_24k(tmp_path_factory):
    """espeak-ng speech as raw 24 kHz PCM16 from its first loud sample (None without espeak-ng:
    the agents test then interrupts by hand)."""
    import numpy as np
    from test_speech_events import SPOKEN, onset

    from mlx_voicechat.serve.wire import Resampler

    espeak = shutil.which("espeak-ng")
    if espeak is None:
        return None
    import soundfile as sf

    folder = tmp_path_factory.mktemp("speech")
    subprocess.run([espeak, "-w", str(folder / "s.wav"), SPOKEN], check=True, timeout=30)
    x, rate = sf.read(folder / "s.wav", dtype="float32")
    x = Resampler(rate, 24000)(x, last=True)
    x = x[onset(x, window=240) :]
    (folder / "s.pcm").write_bytes(np.round(np.clip(x, -1, 1) * 32767).astype("<i2").tobytes())
    return folder / "s.pcm"


def test_openai_agents_realtime_over_ws(node_modules, model, worker, speech_24k):
    rec = Recording(model)
    app = create_app(rec, api_key=KEY, worker=worker, warmup=False, max_lag_seconds=LAG)
    with ServerThread(app) as server:
        env = {"VOICECHAT_URL": f"ws://127.0.0.1:{server.port}/v1/realtime", "VOICECHAT_KEY": KEY}
        if speech_24k is not None:
            env["VOICECHAT_SPEECH"] = str(speech_24k)
        seen, code, err = run_node("agents_realtime.mjs", node_modules, env, rec, worker)
    check_the_round(seen, code, err)
    assert seen["types"].get("conversation.item.retrieved", 0) > 0  # after truncate, transcripts
    if speech_24k is not None:  # the user barged in: the SDK stopped playing on speech_started
        assert seen["speechStarted"] >= 1 and seen["cancelled"] and seen["truncated"]
        # ... before 200 ms of the user's speech had been sent (the wall time is printed)
        assert seen["bargeIn"]["speechMsSent"] <= 200, seen["bargeIn"]
        print(f"barge-in: playback stopped {seen['bargeIn']['msAfterOnset']} ms after the onset")


def test_openai_node_realtime_ws_over_tls(node_modules, model, worker, cert):
    rec = Recording(model)
    app = create_app(rec, api_key=KEY, worker=worker, warmup=False, max_lag_seconds=LAG)
    with ServerThread(app, ssl_certfile=str(cert[0]), ssl_keyfile=str(cert[1])) as server:
        env = {
            "VOICECHAT_BASE_URL": f"https://127.0.0.1:{server.port}/v1",
            "VOICECHAT_KEY": KEY,
            "NODE_EXTRA_CA_CERTS": str(cert[0]),
        }
        seen, code, err = run_node("openai_node.mjs", node_modules, env, rec, worker)
    assert seen["url"].startswith(f"wss://127.0.0.1:{server.port}/v1/realtime")
    check_the_round(seen, code, err)
