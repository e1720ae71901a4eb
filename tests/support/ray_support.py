"""What the Ray Serve tests (tests/serve/test_ray.py) use: HTTP and health waits, the stock
client's session (``Session``: a ``server_support.Client`` over the Ray proxy), the CLI started
and stopped as a user does, and the cluster's processes as ``/proc`` shows them."""

import asyncio
import contextlib
import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
from server_support import Client, pcm

openai = pytest.importorskip("openai")

TIMEOUT = 30.0  # seconds, any single wait on a server
STARTUP = 120.0  # seconds for a cluster or a replica to start (model load and warm-up)
AUDIO = 0.6  # seconds of client audio per session


def run(coro, timeout=STARTUP):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def get(url):
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def health(url):
    status, body = get(url + "/health")
    return status, json.loads(body)


def wait_health(url, pred, timeout=STARTUP):
    deadline = time.monotonic() + timeout
    while True:
        try:
            status, h = health(url)
            if status == 200 and pred(h):
                return h
        except (OSError, ValueError):
            h = None
        assert time.monotonic() < deadline, f"/health did not get there in {timeout} s: {h}"
        time.sleep(0.25)


def noise(seconds, rate=24000, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(int(seconds * rate)) * 3000).astype("<i2")


_ID = re.compile(r"^(resp|item|sess|conv)_[0-9a-f]+$")


def normalized(events):
    """Events without what differs between two runs of the same audio: event ids, random
    item / response ids (numbered in order of appearance), the transport's stats events and
    the vendor field naming the replica."""
    names = {}

    def walk(x):
        if isinstance(x, dict):
            return {k: walk(v) for k, v in x.items() if k not in ("event_id", "x-voicechat")}
        if isinstance(x, list):
            return [walk(v) for v in x]
        if isinstance(x, str) and _ID.match(x):
            return names.setdefault(x, f"{x.split('_')[0]}_{len(names)}")
        return x

    return [walk(e) for e in events if e["type"] != "x-voicechat.stats"]


class Session(Client):
    """A stock ``openai`` realtime connection, its events read as raw JSON."""

    def __init__(self, base_url):
        self.client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused")
        self.events = []
        self.closed = None  # (code, reason) once the server closed the connection

    async def __aenter__(self):
        self._cm = self.client.realtime.connect(model="tiny", extra_query={"x-voicechat": "1"})
        self.conn = await asyncio.wait_for(self._cm.__aenter__(), TIMEOUT)
        self.created = await self.recv()
        return self

    async def __aexit__(self, *exc):
        with contextlib.suppress(Exception):  # (a connection the server closed already)
            await self._cm.__aexit__(*exc)

    async def recv(self, timeout=TIMEOUT):
        import websockets

        try:
            e = json.loads(await asyncio.wait_for(self.conn.recv_bytes(), timeout))
        except websockets.ConnectionClosed as c:
            self.closed = (c.rcvd.code, c.rcvd.reason) if c.rcvd else (1006, "")
            raise
        self.events.append(e)
        return e

    @property
    def replica(self):
        return self.created.get("x-voicechat", {}).get("replica")

    async def send_audio(self, samples, chunk=4800):
        for i in range(0, len(samples), chunk):
            await self.conn.input_audio_buffer.append(audio=pcm(samples[i : i + chunk]))

    async def until_events(self, n, timeout=TIMEOUT):
        """Until ``n`` events besides the stats events have come."""
        deadline = time.monotonic() + timeout
        while len(normalized(self.events)) < n:
            await self.recv(max(deadline - time.monotonic(), 0.01))

    async def until_closed(self, timeout=TIMEOUT):
        import websockets

        with pytest.raises(websockets.ConnectionClosed):
            while True:
                await self.recv(timeout)
        return self.closed


def _start_cli(*argv):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlx_voicechat", "serve", *argv],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    out = []

    def read():
        for line in proc.stderr:
            out.append(line)

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + STARTUP
    while not any("Ctrl-C stops" in line for line in out):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail("serve --ray did not start:\n" + "".join(out[-30:]))
        time.sleep(0.2)
    return proc, out


def _stop_cli(proc, out, signum):
    proc.send_signal(signum)
    try:
        return proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("serve --ray did not stop:\n" + "".join(out[-30:]))


def _processes():
    """pid -> (parent pid, command line) of every process."""
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        out[int(pid)] = (ppid, cmd)
    return out


def _in_session(sid):
    """The processes of session ``sid`` (a CLI started with ``start_new_session`` leads one,
    and every process it starts stays in it unless it leaves: orphans too)."""
    out = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            out.add(int(pid))
    return out


def _cluster_processes(driver_pid):
    """The processes of the Ray cluster a driver started: its daemons (their command lines name
    the session folder, whose name ends in the driver's pid), what they started, and the
    processes of its session."""
    procs = _processes()
    ours = {p for p, (_, cmd) in procs.items() if f"_{driver_pid}/" in cmd}
    ours |= _in_session(driver_pid) & set(procs)
    while True:
        more = {p for p, (ppid, _) in procs.items() if ppid in ours} - ours
        if not more:
            return ours
        ours |= more
