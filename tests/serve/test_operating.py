"""Operating `serve` (docs/operating.md): a real `serve` subprocess stopped by SIGTERM and by
SIGINT while its worker is busy, `GET /metrics` parsed with prometheus_client's own parser, and
the worker's stop that the clean exit rests on."""

import base64
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("websockets")
pytest.importorskip("prometheus_client")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from websockets.exceptions import ConnectionClosed  # noqa: E402
from websockets.sync.client import connect  # noqa: E402

from mlx_voicechat.serve.app import ServerThread, create_app  # noqa: E402
from mlx_voicechat.serve.worker import Worker, WorkerStopped  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
KEY = "operator-key"
SILENCE_1S = base64.b64encode(bytes(2 * 24000)).decode()  # 1 s of pcm16 at 24 kHz
PROMPT_TOKENS = 3500


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    return tiny_checkpoint


# --- the worker's stop ---------------------------------------------------------------------


def test_stop_cuts_a_running_job_short_cancels_the_rest_and_joins():
    worker = Worker(name="test-stop")
    started = threading.Event()

    def spin():
        started.set()
        while True:
            sum(range(100))

    running, queued = worker.submit(spin), worker.submit(lambda: 1)
    assert started.wait(10)
    assert worker.stop(10.0) and not worker.thread.is_alive()
    with pytest.raises(WorkerStopped):
        running.result(1)
    assert queued.cancelled()
    with pytest.raises(WorkerStopped):
        worker.submit(lambda: 1).result(1)  # a stopped worker takes no more jobs


def test_stop_gives_up_at_its_timeout_while_one_call_runs():
    # An asynchronous exception waits for the C call in flight (an MLX eval, here a sleep):
    # stop() says so within its timeout, and the job ends at its next line of Python.
    worker = Worker(name="test-stop-timeout")
    started = threading.Event()

    def one_call():
        started.set()
        time.sleep(2.0)
        return "not reached"

    job = worker.submit(one_call)
    assert started.wait(10)
    t = time.monotonic()
    assert not worker.stop(0.2)
    assert time.monotonic() - t < 1.5
    assert worker.stop(20.0)
    with pytest.raises(WorkerStopped):
        job.result(1)


def test_serve_exits_as_the_signal_asks_once_the_worker_stopped(monkeypatch, capsys):
    from types import SimpleNamespace

    from mlx_voicechat.cli import Terminated
    from mlx_voicechat.cli import serve as cli

    class Exited(Exception):
        pass

    def fake_exit(code):
        raise Exited(code)

    monkeypatch.setattr(cli.os, "_exit", fake_exit)

    def after(signals, stopped, started=True):
        server = SimpleNamespace(started=started, signals=signals, time_left=lambda: 0.0)
        return cli._exit(server, SimpleNamespace(stop=lambda timeout: stopped))

    with pytest.raises(Terminated) as e:
        after([signal.SIGTERM], True)
    assert e.value.signum == signal.SIGTERM
    with pytest.raises(KeyboardInterrupt):
        after([signal.SIGINT, signal.SIGINT], True)
    assert after([], True) == 0
    with pytest.raises(cli.ServeError, match="did not start"):
        after([], True, started=False)
    # one MLX call outlasted --shutdown-timeout: no interpreter may finalize around it
    with pytest.raises(Exited) as e:
        after([signal.SIGTERM], False)
    assert e.value.args == (128 + signal.SIGTERM,)
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "mlx-voicechat serve: terminated (SIGTERM); the work in flight was dropped at "
        "--shutdown-timeout"
    ]


# --- signals: a real `serve` -----------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sigint_as_in_a_terminal():  # (a test run started in the background ignores SIGINT)
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _get(url, headers=None, timeout=5.0):
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _instructions(checkpoint, tokens: int) -> str:
    """Instructions of about ``tokens`` new tokens (never seen before: no cached prompt)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(checkpoint) / "tokenizer.json"))
    words, n = [], 0
    while n < tokens:
        words.append(f"rule{len(words)}x{os.getpid()}")
        n += len(tok.encode(" " + words[-1], add_special_tokens=False).ids)
    return " ".join(words)


class Client(threading.Thread):
    """A conversation on its own thread: what it sends first, then every event until the
    close; ``sent`` is set once its first messages are out."""

    def __init__(self, url, first):
        super().__init__(daemon=True)
        self.url, self.first = url, first
        self.events, self.close_code, self.sent = [], None, threading.Event()

    def run(self):
        try:
            with connect(self.url, open_timeout=20) as ws:
                self.events.append(json.loads(ws.recv(20)))
                for message in self.first:
                    ws.send(message)
                self.sent.set()
                while True:
                    self.events.append(json.loads(ws.recv(60)))
        except ConnectionClosed as e:
            self.close_code = e.rcvd.code if e.rcvd is not None else None
        finally:
            self.sent.set()


@pytest.mark.parametrize(
    "signum, twice",
    [(signal.SIGTERM, False), (signal.SIGINT, False), (signal.SIGINT, True)],
    ids=["SIGTERM", "SIGINT", "SIGINT-twice"],
)
def test_a_signal_while_the_worker_is_busy_ends_the_server_cleanly(
    checkpoint, tmp_path, signum, twice
):
    port = _free_port()
    log_path = tmp_path / "serve.log"
    argv = [sys.executable, "-m", "mlx_voicechat", "serve", "--model", str(checkpoint)]
    argv += ["--port", str(port), "--max-sessions", "4"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            preexec_fn=_sigint_as_in_a_terminal,
        )
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "the server did not start"
            try:
                if _get(f"http://127.0.0.1:{port}/health", timeout=1)[0] == 200:
                    break
            except OSError:
                pass
            time.sleep(0.2)
        url = f"ws://127.0.0.1:{port}/v1/realtime"
        append = json.dumps({"type": "input_audio_buffer.append", "audio": SILENCE_1S})
        live = Client(url, [append])
        live.start()
        assert live.sent.wait(30)
        # The busy one: 3,500 tokens of new instructions (their prefill), then 8 s of audio at
        # once, so that the worker still has this conversation's work when the signal comes
        # however fast the prefill is.
        update = {"type": "session.update", "session": {"type": "realtime"}}
        update["session"]["instructions"] = _instructions(checkpoint, PROMPT_TOKENS)
        busy = Client(url, [json.dumps(update)] + [append] * 8)
        busy.start()
        assert busy.sent.wait(30)
        time.sleep(0.5)
        proc.send_signal(signum)
        t = time.monotonic()
        if twice:  # Ctrl-C again as uvicorn is done and the worker is being stopped
            while "Finished server process" not in log_path.read_text():
                if proc.poll() is not None or time.monotonic() > t + 10:
                    break
                time.sleep(0.01)
            if proc.poll() is None:
                proc.send_signal(signum)
        try:
            rc = proc.wait(15)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running 15 s after {signum.name}: {log_path.read_text()[-2000:]}")
        took = time.monotonic() - t
        for client in (live, busy):
            client.join(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    text = log_path.read_text()
    assert "terminate called" not in text and "Traceback" not in text, text[-3000:]
    assert rc == 128 + signum, text[-3000:]
    said = "interrupted" if signum == signal.SIGINT else f"terminated ({signum.name})"
    assert text.strip().splitlines()[-1] == f"mlx-voicechat serve: {said}", text[-1000:]
    assert took < 15
    for client in (live, busy):
        assert client.close_code in (1001, 1012), (client.close_code, client.events[-3:])
        if twice:
            continue  # (a second signal does not wait for the conversations to take the error)
        errors = [e for e in client.events if e["type"] == "error"]
        assert errors and errors[-1]["error"]["code"] == "server_shutting_down", errors
        assert errors[-1]["error"]["type"] == "server_error"


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_mid_stream_is_one_line_and_no_partial_output(checkpoint, tmp_path, signum):
    # `stream --realtime` runs as long as its audio (6 s) and more: the signal comes while it
    # loads or steps frames; either way one line, no traceback, and the WAV whole or absent.
    import numpy as np
    import soundfile as sf

    audio, out = tmp_path / "long.wav", tmp_path / "out.wav"
    sf.write(audio, 0.05 * np.random.default_rng(0).standard_normal(6 * 16000), 16000)
    argv = [sys.executable, "-m", "mlx_voicechat", "stream", "--model", str(checkpoint)]
    argv += ["--audio", str(audio), "--realtime", "--output-audio", str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        preexec_fn=_sigint_as_in_a_terminal,
    )
    time.sleep(10.0)  # (here: about 7 s to load and warm up, then 9 s of frames)
    proc.send_signal(signum)
    try:
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    said = "interrupted" if signum == signal.SIGINT else f"terminated ({signum.name})"
    assert proc.returncode == 128 + signum, err
    assert err.strip().splitlines()[-1] == f"mlx-voicechat stream: {said}", err
    assert "Traceback" not in err and "terminate called" not in err, err
    assert {p.name for p in tmp_path.iterdir()} <= {"long.wav", "out.wav"}  # no temporary left
    if out.exists():
        assert sf.info(out).frames > 0


# --- GET /metrics -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(checkpoint):
    import mlx_voicechat

    worker = Worker.shared()
    model = worker.submit(mlx_voicechat.load, str(checkpoint)).result()
    app = create_app(model, api_key=KEY, max_sessions=3, worker=worker, stats_every_frames=0)
    with ServerThread(app) as s:
        yield s, model, worker


def _scrape(base, headers):
    status, body = _get(base + "/metrics", headers)
    assert status == 200, body
    out = {}
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def test_metrics_with_two_live_conversations_and_a_malformed_event(served):
    server, _, _ = served
    base = f"http://127.0.0.1:{server.port}"
    auth = {"Authorization": f"Bearer {KEY}"}
    append = json.dumps({"type": "input_audio_buffer.append", "audio": SILENCE_1S})
    url = base.replace("http", "ws") + "/v1/realtime"
    kw = {"additional_headers": auth, "max_queue": None}  # (events pile up unread: take them)
    with connect(url, **kw) as a, connect(url, **kw) as b:
        for ws in (a, b):
            assert json.loads(ws.recv(20))["type"] == "session.created"
            ws.send(append)
        a.send("{this is not json")
        while (event := json.loads(a.recv(20)))["type"] != "error":
            pass
        assert event["error"]["code"] == "invalid_json"
        deadline = time.monotonic() + 60
        while True:  # both conversations' second of audio stepped
            m = _scrape(base, auth)
            if m[("voicechat_frames_total", ())] >= 24 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        health = json.loads(_get(base + "/health")[1])
        assert m[("voicechat_conversations_live", ())] == health["sessions"] == 2
        assert m[("voicechat_conversations_opened_total", ())] == 2
        assert m[("voicechat_error_events_total", (("code", "invalid_json"),))] == 1
        assert m[("voicechat_frames_total", ())] >= 24
        assert m[("voicechat_frame_step_seconds_count", ())] > 0
        assert m[("voicechat_lag_seconds_count", ())] > 0
        assert m[("voicechat_session_open_seconds_count", ())] == 2
        cache = {
            r: m.get(("voicechat_prompt_state_cache_total", (("result", r),)), 0)
            for r in ("hit", "miss")
        }
        assert cache["hit"] + cache["miss"] == 2 and cache["hit"] >= 1  # the same prompt twice
        if sys.platform.startswith("linux"):
            assert m[("process_resident_memory_bytes", ())] > 0
    deadline = time.monotonic() + 20
    while _scrape(base, auth)[("voicechat_conversations_live", ())] and time.monotonic() < deadline:
        time.sleep(0.1)
    m = _scrape(base, auth)
    assert m[("voicechat_conversations_live", ())] == 0
    assert m[("voicechat_conversations_closed_total", (("reason", "client_closed"),))] == 2
    # (no step runs now) every batched frame counted once, with its batch size: the step
    # histogram's count is the batched frames, the sizes add up to the conversation frames
    frames, steps = m[("voicechat_frames_total", ())], m[("voicechat_frame_step_seconds_count", ())]
    assert m[("voicechat_batch_size_count", ())] == steps <= frames
    assert m[("voicechat_batch_size_sum", ())] == frames
    assert m[("voicechat_frame_step_seconds_sum", ())] > 0


def test_metrics_ask_for_the_key_unless_public(served):
    server, model, worker = served
    base = f"http://127.0.0.1:{server.port}"
    assert _get(base + "/metrics")[0] == 401
    assert _get(base + "/metrics", {"Authorization": "Bearer wrong"})[0] == 401
    assert _get(base + "/health")[0] == 200  # /health stays open
    app = create_app(model, api_key=KEY, worker=worker, warmup=False, metrics_public=True)
    with ServerThread(app) as public:
        status, body = _get(f"http://127.0.0.1:{public.port}/metrics")
    assert status == 200 and "voicechat_conversations_live 0.0" in body


def test_the_ray_backend_records_the_same_series_tagged_with_the_replica(monkeypatch):
    # ray.util.metrics as a recorder (its real export is tests/serve/test_ray.py's): the same calls
    # reach Ray's series, each with the replica's tag.
    ray_util = pytest.importorskip("ray.util")
    from types import SimpleNamespace

    from mlx_voicechat.serve.metrics import PREFIX, SERIES, Metrics

    made, calls = {}, []

    class Series:
        def __init__(self, name, description, boundaries=None, tag_keys=()):
            made[name] = self
            self.name, self.tag_keys, self.boundaries, self.default = name, tag_keys, boundaries, {}

        def set_default_tags(self, tags):
            self.default = dict(tags)

        def inc(self, n=1, tags=None):
            calls.append((self.name, "inc", n, {**self.default, **(tags or {})}))

        def observe(self, v, tags=None):
            calls.append((self.name, "observe", v, {**self.default, **(tags or {})}))

        def set(self, v, tags=None):
            calls.append((self.name, "set", v, {**self.default, **(tags or {})}))

    fake = SimpleNamespace(Counter=Series, Gauge=Series, Histogram=Series)
    monkeypatch.setattr(ray_util, "metrics", fake, raising=False)
    monkeypatch.setitem(sys.modules, "ray.util.metrics", fake)
    live = [3]
    m = Metrics("ray", live=lambda: live[0], tags={"replica": "r1"})
    assert m.registry is None and set(made) == {PREFIX + n for n in SERIES}
    assert all(s.tag_keys[-1] == "replica" for s in made.values())
    m.opened()
    m.error_sent("invalid_json")
    m.step([2, 1], 0.1)
    assert (PREFIX + "conversations_live", "set", 3, {"replica": "r1"}) in calls
    assert (PREFIX + "error_events", "inc", 1, {"replica": "r1", "code": "invalid_json"}) in calls
    assert (PREFIX + "frames", "inc", 3, {"replica": "r1"}) in calls
    sizes = [c[2] for c in calls if c[0] == PREFIX + "batch_size"]
    assert sizes == [2, 1]  # two batched frames: both conversations, then the one with two
