"""The `serve` process (issue 26): its open-file limits survive loading the model, bad limits
are one-line errors, and a real `mlx-voicechat serve` answers under 2,000 idle connections
(bounded, 127.0.0.1 only).
"""

import contextlib
import os
import resource
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
websockets = pytest.importorskip("websockets")

from hardening_support import SECRET, idle_sockets  # noqa: E402

from mlx_voicechat.serve.limits import Limits, raise_open_file_limit  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    return tiny_checkpoint


# --- the process: open files, 2,000 idle connections, its log -----------------------------------


@pytest.fixture
def started(monkeypatch):
    """`serve.run` with uvicorn replaced (the arguments it got are returned)."""
    from mlx_voicechat.cli import serve as cli

    calls = {}
    def serve_app(app, shutdown_timeout, **kw):  # instead of uvicorn
        calls.update(app=app, shutdown_timeout=shutdown_timeout, **kw)
        return 0

    monkeypatch.setattr(cli, "_serve_app", serve_app)
    monkeypatch.delenv(cli.KEY_ENV, raising=False)
    limits = resource.getrlimit(resource.RLIMIT_NOFILE)
    yield calls
    with contextlib.suppress(ValueError, OSError):  # (a hard limit lowered for good)
        resource.setrlimit(resource.RLIMIT_NOFILE, limits)


def parse(*argv):
    import argparse

    from mlx_voicechat.cli import serve as cli

    p = argparse.ArgumentParser(prog="mlx-voicechat")
    cli.add_parser(p.add_subparsers(dest="command"))
    return p.parse_args(["serve", "--model", "some/ckpt", *argv])


def test_the_open_file_limits_survive_loading_the_model(started, monkeypatch):
    import types

    import mlx_voicechat
    from mlx_voicechat.cli import serve as cli
    from mlx_voicechat.serve import limits

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    finite = hard != resource.RLIM_INFINITY
    imported = []

    def import_module(name):  # importing mlx_lm.utils lowers both limits (to 2048 / 4096)
        imported.append(name)
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard - 1 if finite else 1 << 20))

    def load(path, tokenizer=None):  # something else in the load lowers the soft one
        now = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, now[1]))
        return "model"

    monkeypatch.setattr(limits, "importlib", types.SimpleNamespace(import_module=import_module))
    monkeypatch.setattr(mlx_voicechat, "load", load)
    assert cli.run(parse("--idle-timeout", "30", "--keep-alive-timeout", "2")) == 0
    assert imported == ["mlx_lm.utils"]
    now = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert now[1] == hard  # a process without privileges could never raise it again
    wanted = Limits().files_needed
    assert now[0] >= (min(max(soft, wanted), hard) if finite else max(soft, wanted))
    assert started["timeout_keep_alive"] == 2 and started["http"].__name__.startswith("Guarded")
    assert started["app"].state.server.idle_timeout == 30


@pytest.mark.parametrize(
    "argv, message",
    [
        (("--idle-timeout", "-1"), "--idle-timeout"),
        (("--max-connections", "0"), "--max-connections"),
        (("--header-timeout", "0"), "--header-timeout"),
        (("--keep-alive-timeout", "0"), "--keep-alive-timeout"),
        (("--shutdown-timeout", "0"), "--shutdown-timeout"),
        (("--max-prompt-tokens", "0"), "--max-prompt-tokens"),
    ],
)
def test_bad_limits_are_one_line_errors(started, argv, message):
    from mlx_voicechat.cli import serve as cli

    with pytest.raises(cli.ServeError, match=message):
        cli.run(parse(*argv))


def test_the_cli_server_answers_under_2000_idle_connections(checkpoint, tmp_path):
    n = 2100  # past the 2048 files that importing mlx_lm.utils leaves a process
    if (raise_open_file_limit(None, n + 512) or 1 << 30) < n + 512:
        pytest.skip("this process may not open enough files for the test")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path / "serve.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-m", "mlx_voicechat", "serve", "--model", str(checkpoint)]
    argv += ["--port", str(port), "--api-key", "the-key"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"

    def get(path, timeout=2.0):
        try:
            with urllib.request.urlopen(url + path, timeout=timeout) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code
        except OSError as e:
            return repr(e)

    socks = []
    try:
        deadline = time.monotonic() + 120
        while get("/health", 0.5) != 200:
            assert proc.poll() is None, log.read_text()[-2000:]
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.2)
        assert get(f"/v1/models?api_key={SECRET}") == 401
        socks = idle_sockets(port, n)
        time.sleep(0.5)
        for _ in range(5):  # /health answers throughout
            assert get("/health") == 200
            time.sleep(0.2)
    finally:
        for s in socks:
            s.close()
        proc.terminate()
        proc.wait(30)
    text = log.read_text()
    assert "Too many open files" not in text and "out of system resource" not in text
    assert SECRET not in text and "/v1/models?api_key=(hidden)" in text
    assert len(text) < 20_000, f"the log grew to {len(text)} bytes"
