"""The Realtime server on Ray Serve, with the tiny random-weight checkpoint and stock ``openai``
clients, on one local Ray cluster that the module starts the way a user does:
``mlx-voicechat serve --ray --replicas 2 --max-sessions 2`` (its HTTP proxy on 127.0.0.1).
This process joins that cluster as a second driver for what the CLI does not deploy: a
replica without a model at ``/broken`` and ``serve run`` of ``examples/ray-serve.yaml`` at
``/yaml``. The last test stops the CLI with SIGTERM and checks that nothing of the cluster is
left; the fixtures stop it too where a test failed. Starting the cluster and its replicas
takes most of the module's time, so every test shares them.
"""

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

# Ray turns token authentication on for a new local cluster (the CLI's); a driver that joins
# one by its address has to ask for it before Ray reads its configuration.
os.environ.setdefault("RAY_AUTH_MODE", "token")
pytest.importorskip("fastapi")
pytest.importorskip("ray.serve", reason="ray[serve] is not installed: pip install '.[ray]'")
openai = pytest.importorskip("openai")

import ray  # noqa: E402
from ray import serve  # noqa: E402
from ray_support import (  # noqa: E402
    AUDIO,
    STARTUP,
    TIMEOUT,
    Session,
    _cluster_processes,
    _in_session,
    _processes,
    _start_cli,
    _stop_cli,
    get,
    health,
    noise,
    normalized,
    run,
    wait_health,
)

from mlx_voicechat.serve.ray_app import REPORT_SECONDS, start_serve  # noqa: E402
from mlx_voicechat.serve.ray_proxy import CLOSE_REPLICA_LOST  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


# --- fixtures -----------------------------------------------------------------------------


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    return tiny_checkpoint


@pytest.fixture(scope="module")
def cli(checkpoint):
    """``serve --ray``: a local cluster, Serve, two replicas of two sessions each; no silence
    feed, so a session's events depend on its client's audio only. Stopped by the last test
    (or here)."""
    started = time.monotonic()
    port = _free_port()
    proc, out = _start_cli(
        *("--model", str(checkpoint), "--ray", "--replicas", "2", "--max-sessions", "2"),
        *("--no-silence-feed", "--port", str(port)),
    )
    info = {"proc": proc, "out": out, "url": f"http://127.0.0.1:{port}", "ours": set()}
    try:
        info["address"] = next(m.group(1) for m in map(_ADDRESS.search, out) if m)
        yield info
    finally:
        try:
            if proc.poll() is None:
                info["ours"] |= _cluster_processes(proc.pid)
                _stop_cli(proc, out, signal.SIGTERM)
        finally:
            for pid in info["ours"] & set(_processes()):  # what a failed stop left behind
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            print(f"\nthe Ray module took {time.monotonic() - started:.1f} s", file=sys.stderr)


_ADDRESS = re.compile(r"started a local Ray cluster at (\S+)")


@pytest.fixture(scope="module")
def cluster(cli):
    """This process as a second driver of the CLI's cluster."""
    try:
        ray.init(address=cli["address"], logging_level="warning")
        yield cli
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def deployment(cli):
    wait_health(cli["url"], lambda h: h["deployment"]["replicas_ready"] == 2)
    return cli["url"]


@pytest.fixture(scope="module")
def reference(checkpoint):
    """The single-process server on the same checkpoint and settings, and its events for
    :data:`AUDIO` seconds of noise (a stats event after each worker job tells when the last
    frame has been answered)."""
    from mlx_voicechat import load
    from mlx_voicechat.serve.app import ServerThread, create_app
    from mlx_voicechat.serve.wire import Resampler
    from mlx_voicechat.serve.worker import Worker

    worker = Worker.shared()
    model = worker.submit(load, checkpoint).result()
    x = noise(AUDIO)

    def frames():
        s = model.session()
        n = len(s.feed(Resampler(24000, 16000)(x.astype(np.float32) / 32768.0)))
        s.close()
        return n

    n = worker.submit(frames).result()
    app = create_app(model, model_id="tiny", silence_feed=False, stats_every_frames=1)
    with ServerThread(app) as server:

        async def main():
            async with Session(server.url) as s:
                await s.send_audio(x)
                await s.until(lambda e: e["type"] == "x-voicechat.stats" and e["frames"] >= n)
                return s

        single = run(main())
    assert single.replica is None  # a single server names no replica
    events = normalized(single.events)
    assert any(e["type"] == "response.output_audio.delta" for e in events)
    return x, events


# --- the tests ----------------------------------------------------------------------------


def test_the_page_and_three_stock_clients_spread_over_both_replicas(deployment, reference):
    x, want = reference
    status, page = get(deployment + "/")
    assert status == 200 and b"<" in page

    async def converse():
        async with Session(deployment) as s:
            await s.send_audio(x)
            await s.until_events(len(want))
            return s

    async def three():
        return await asyncio.gather(*(converse() for _ in range(3)))

    sessions = run(three())
    assert len({s.replica for s in sessions}) == 2 and None not in {s.replica for s in sessions}
    for s in sessions:
        assert s.created["session"]["model"] == "tiny"
        assert normalized(s.events) == want  # the single server's events on the same audio


def test_capacity_then_busy_1013_at_once(deployment):
    async def main():
        sessions = [await Session(deployment).__aenter__() for _ in range(4)]
        try:
            assert all(s.created["type"] == "session.created" for s in sessions)
            assert len({s.replica for s in sessions}) == 2
            # the other replica's sessions reach /health within a report (0.1 s)
            h = wait_health(deployment, lambda h: h["deployment"]["sessions"] == 4, 5.0)
            assert h["deployment"]["capacity"] == 4 and h["deployment"]["replicas_live"] == 2
            t = time.monotonic()
            async with Session(deployment) as fifth:
                assert fifth.created["type"] == "error"
                assert fifth.created["error"]["code"] == "server_busy"
                code, _ = await fifth.until_closed()
            print(f"busy answer and close after {time.monotonic() - t:.3f} s", file=sys.stderr)
            assert code == 1013
        finally:
            for s in sessions:
                await s.__aexit__(None, None, None)

    run(main())


def test_every_replica_reports_the_series_through_rays_metrics(deployment, cluster):
    """The replicas (both stepped frames in the tests above) record the server's series
    through ``ray.util.metrics``, tagged with the replica: Ray's Prometheus export carries
    them. A replica's own ``/metrics`` says where they are."""
    status, body = get(deployment + "/metrics")
    assert status == 404 and b"Ray's own metrics" in body
    nodes = [n for n in ray.nodes() if n["Alive"]]
    urls = [f"http://{n['NodeManagerAddress']}:{n['MetricsExportPort']}/metrics" for n in nodes]
    deadline = time.monotonic() + 60  # (a worker hands its metrics to Ray every few seconds)
    while True:
        text = "".join(get(url)[1].decode() for url in urls)
        replicas = set(re.findall(r'ray_voicechat_frames_total\{[^}]*replica="([^"]+)"', text))
        if len(replicas) >= 2 or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert len(replicas) >= 2, [line for line in text.splitlines() if "voicechat" in line]
    for series in ("frame_step_seconds_bucket", "conversations_opened_total", "batch_size_sum"):
        assert f"ray_voicechat_{series}" in text, series


def test_a_killed_replica_loses_only_its_sessions_and_comes_back(deployment, reference):
    x, want = reference

    async def main():
        a = await Session(deployment).__aenter__()
        b = await Session(deployment).__aenter__()
        later = []
        try:
            assert a.replica != b.replica
            await a.send_audio(x)
            await b.send_audio(x[: len(x) // 2])
            await a.until_events(3)  # mid-session: its first frames answered
            _, h = health(deployment)
            pid = {r["replica"]: r["pid"] for r in h["deployment"]["replicas"]}[a.replica]
            os.kill(pid, signal.SIGKILL)
            code, reason = await a.until_closed()
            assert (code, reason) == (CLOSE_REPLICA_LOST, "replica lost")
            assert a.events[-1]["type"] == "error"
            assert a.events[-1]["error"]["code"] == "replica_lost"

            c = await Session(deployment).__aenter__()  # at once, on the live replica
            later.append(c)
            assert c.created["type"] == "session.created" and c.replica == b.replica

            await b.send_audio(x[len(x) // 2 :])  # b's session goes on untouched
            await b.until_events(len(want))
            assert normalized(b.events) == want

            t = time.monotonic()
            back = await asyncio.to_thread(
                wait_health,
                deployment,
                lambda h: (
                    h["deployment"]["replicas_ready"] == 2
                    and a.replica not in {r["replica"] for r in h["deployment"]["replicas"]}
                ),
            )
            print(f"replacement ready after {time.monotonic() - t:.1f} s", file=sys.stderr)
            # Ray's routers poll each replica's routing stats every REPORT_SECONDS: the
            # replacement takes connections once they have seen it ready.
            await asyncio.sleep(2 * REPORT_SECONDS)
            new = {r["replica"] for r in back["deployment"]["replicas"]} - {b.replica}
            d = await Session(deployment).__aenter__()  # b's replica is full (b and c)
            later.append(d)
            assert d.created["type"] == "session.created" and {d.replica} == new
        finally:
            for s in [a, b, *later]:
                await s.__aexit__(None, None, None)

    run(main(), timeout=STARTUP + 60)


@pytest.fixture(scope="module")
def from_yaml(cluster, checkpoint, tmp_path_factory):
    """``serve run --non-blocking`` of examples/ray-serve.yaml on the cluster, its application
    at /yaml (one replica of the tiny model) and a second one at /broken whose model does not
    load (both start side by side)."""
    import yaml

    config = yaml.safe_load((ROOT / "examples" / "ray-serve.yaml").read_text())
    app = config["applications"][0]
    assert app["import_path"] == "mlx_voicechat.serve.ray_app:app_builder"
    app.update(name="from-yaml", route_prefix="/yaml")
    app["args"].update(model=str(checkpoint), replicas=1, ray_actor_options={"num_cpus": 0})
    folder = tmp_path_factory.mktemp("yaml")
    (folder / "no-checkpoint").mkdir()
    broken = dict(app, name="broken", route_prefix="/broken")
    broken["args"] = dict(app["args"], model=str(folder / "no-checkpoint"))
    config["applications"].append(broken)
    path = folder / "ray-serve.yaml"
    path.write_text(yaml.safe_dump(config))
    serve_cli = Path(sys.executable).with_name("serve")
    try:
        subprocess.run(
            [str(serve_cli), "run", str(path), "--address", cluster["address"], "--non-blocking"],
            check=True,
            timeout=STARTUP,
            capture_output=True,
        )
        yield cluster["url"]
    finally:
        for name in ("from-yaml", "broken"):
            if ray.is_initialized():  # (the last test stops the whole cluster)
                serve.delete(name)


def test_serve_run_of_the_example_config(from_yaml):
    h = wait_health(from_yaml + "/yaml", lambda h: h["status"] == "ok")
    assert h["model"] == "tiny" and h["deployment"]["capacity"] == 1


def test_a_replica_without_a_model_says_so_and_takes_no_sessions(from_yaml):
    url = from_yaml + "/broken"
    deadline = time.monotonic() + STARTUP
    while True:  # until the replica answers (Ray answers 404 itself before)
        status, body = get(url + "/health")
        with contextlib.suppress(ValueError):
            h = json.loads(body)
            break
        assert time.monotonic() < deadline, (status, body)
        time.sleep(0.25)
    assert status == 503 and h["status"] == "error"
    assert h["error"].startswith("the model failed to load: ")
    assert h["deployment"]["replicas_ready"] == 0 and h["deployment"]["capacity"] == 0
    row = h["deployment"]["replicas"][0]
    assert row["status"] == "error" and row["error"] == h["error"]

    async def main():
        async with Session(url) as s:
            assert s.created["type"] == "error"
            assert s.created["error"]["code"] == "model_unavailable"
            return await s.until_closed()

    assert run(main())[0] == 1011
    assert start_serve("127.0.0.1", 1) is False  # Serve runs: its proxies stay as they are


def _nothing_left(proc, ours, t0, within=10.0):
    """No process of ``ours``, nor of the CLI's session, runs ``within`` s after ``t0``: a look
    that starts later finds none (returns when the first look found none)."""
    while True:
        now = time.monotonic()
        procs = _processes()
        left = (ours & set(procs)) | (_in_session(proc.pid) & set(procs))
        if not left:
            return now - t0
        where = {p: procs[p][1][:80] for p in left}
        assert now < t0 + within, f"left running {now - t0:.1f} s after the signal: {where}"
        print(f"{now - t0:.1f} s after the signal, still running: {where}", file=sys.stderr)
        time.sleep(0.2)


def test_cli_sigterm_stops_everything_it_started(cli, cluster):
    """The last test on the module's cluster (one of whose replicas was killed and came back):
    on SIGTERM ``serve --ray`` deletes its deployment, stops Serve and the local cluster it
    started, and within 10 s no process of them runs, those Ray restarted included."""
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
    assert any(n.startswith("SERVE_REPLICA::mlx-voicechat#") for n in names), names
    ours = cli["ours"] = _cluster_processes(cli["proc"].pid)
    assert len(ours) > 3, "the cluster's daemons, workers and replicas"
    ray.shutdown()  # this driver first: its cluster goes away
    live = _LiveSession(cli["url"].replace("http", "ws") + "/v1/realtime")
    assert live.created.wait(TIMEOUT), live.events
    t0 = time.monotonic()
    rc = _stop_cli(cli["proc"], cli["out"], signal.SIGTERM)
    assert rc == 128 + signal.SIGTERM, "".join(cli["out"][-30:])
    assert any("mlx-voicechat serve: stopped" in line for line in cli["out"])
    took = _nothing_left(cli["proc"], ours, t0)
    print(f"nothing left {took:.1f} s after SIGTERM", file=sys.stderr)
    live.join(TIMEOUT)
    # the session open at the stop was told, as a single server tells it
    assert live.events[-1]["type"] == "error", live.events[-3:]
    assert live.events[-1]["error"]["code"] == "server_shutting_down"
    assert live.close_code == 1012


class _LiveSession(threading.Thread):
    """A conversation read on a thread of its own until its close."""

    def __init__(self, url):
        super().__init__(daemon=True)
        self.url, self.events, self.close_code = url, [], None
        self.created = threading.Event()
        self.start()

    def run(self):
        from websockets.exceptions import ConnectionClosed
        from websockets.sync.client import connect

        try:
            with connect(self.url, open_timeout=TIMEOUT) as ws:
                while True:
                    self.events.append(json.loads(ws.recv(3 * TIMEOUT)))
                    self.created.set()
        except ConnectionClosed as e:
            self.close_code = e.rcvd.code if e.rcvd is not None else None
        finally:
            self.created.set()


def test_cli_ctrl_c_leaves_nothing_behind(checkpoint):
    """A fresh ``serve --ray`` (no replica killed) stopped as a terminal's Ctrl-C does it:
    SIGINT to its whole process group, and again once it says it stops (an impatient user).
    Exit 130 with its one line, no traceback, and within 10 s no process of it runs."""
    port = _free_port()
    proc, out = _start_cli("--model", str(checkpoint), "--ray", "--port", str(port))
    ours = _cluster_processes(proc.pid)
    try:
        t0 = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
        while not any("stopping" in line for line in out) and time.monotonic() < t0 + 10:
            time.sleep(0.02)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGINT)
        try:
            rc = proc.wait(30)
        except subprocess.TimeoutExpired:
            pytest.fail("serve --ray did not stop:\n" + "".join(out[-30:]))
        assert rc == 130, "".join(out[-30:])
        time.sleep(0.5)  # (the reader thread takes the last lines)
        assert out[-1].strip() == "mlx-voicechat serve: interrupted", "".join(out[-30:])
        assert not any("Traceback" in line for line in out), "".join(out)
        took = _nothing_left(proc, ours, t0)
        print(f"nothing left {took:.1f} s after Ctrl-C", file=sys.stderr)
    finally:
        for pid in (ours | _in_session(proc.pid)) & set(_processes()):  # a failed stop's
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
