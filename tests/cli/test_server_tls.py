"""`serve --ssl-certfile F --ssl-keyfile K`: TLS for wss:// clients and https:// pages, with a
throwaway self-signed certificate made here (the `cryptography` package); the flags' one-line
errors, and a real `mlx-voicechat serve` process answering over wss:// and https://."""

import asyncio
import json
import os
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from test_server_cli import parse, started  # noqa: F401  (the CLI tests' fixture)
from tls_support import self_signed

from mlx_voicechat.cli import serve

ROOT = Path(__file__).resolve().parents[2]




@pytest.fixture(scope="module")
def cert(tmp_path_factory):
    return self_signed(tmp_path_factory.mktemp("tls"))


# --- the flags ----------------------------------------------------------------------------


def test_tls_flags_reach_uvicorn_and_the_banner_says_wss(started, cert, capsys):  # noqa: F811
    certfile, keyfile = map(str, cert)
    assert serve.run(parse("--ssl-certfile", certfile, "--ssl-keyfile", keyfile)) == 0
    assert (started["ssl_certfile"], started["ssl_keyfile"]) == (certfile, keyfile)
    err = capsys.readouterr().err
    assert "wss://127.0.0.1:8000/v1/realtime" in err and "https://127.0.0.1:8000/" in err
    assert serve.run(parse()) == 0  # without the flags: plain ws://, no TLS
    assert started["ssl_certfile"] is None and "ws://127.0.0.1:8000/v1" in capsys.readouterr().err


def test_bad_tls_flags_are_one_line_errors(started, cert, tmp_path):  # noqa: F811
    certfile, keyfile = map(str, cert)
    _, other_key = self_signed(tmp_path)
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    cases = [
        (("--ssl-keyfile", keyfile), "--ssl-keyfile needs --ssl-certfile"),
        (("--ssl-certfile", str(tmp_path / "none.pem")), "none.pem: no such file"),
        (("--ssl-certfile", str(junk)), "do not load as a PEM certificate"),
        (("--ssl-certfile", certfile, "--ssl-keyfile", str(other_key)), "do not load"),
        (("--ssl-certfile", certfile, "--ssl-keyfile", keyfile, "--ray"), "TLS proxy"),
    ]
    for argv, message in cases:
        with pytest.raises(serve.ServeError, match=message) as e:
            serve.run(parse(*argv))
        assert "\n" not in str(e.value)
    assert "ssl_certfile" not in started  # none of them started a server


# --- a real server over TLS ---------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_serve(checkpoint, cert, log: Path, *extra):
    """A real ``mlx-voicechat serve`` on 127.0.0.1 over TLS (key K); (process, port) once
    /health answers over https."""
    port = free_port()
    argv = [sys.executable, "-m", "mlx_voicechat", "serve", "--model", str(checkpoint)]
    argv += ["--port", str(port), "--api-key", "K", "--ssl-certfile", str(cert[0])]
    argv += ["--ssl-keyfile", str(cert[1]), *extra]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
    context = ssl.create_default_context(cafile=str(cert[0]))
    deadline = time.monotonic() + 180
    while True:
        try:
            url = f"https://127.0.0.1:{port}/health"
            with urllib.request.urlopen(url, timeout=1, context=context) as r:
                if r.status == 200:
                    return proc, port
        except (OSError, urllib.error.URLError):
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("serve did not start:\n" + log.read_text()[-3000:])
        time.sleep(0.3)


def stop(proc) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoints):
    return tiny_checkpoints["mlx-community"]


def test_a_real_serve_answers_over_wss_and_https(checkpoint, cert, tmp_path):
    websockets = pytest.importorskip("websockets")
    proc, port = start_serve(checkpoint, cert, tmp_path / "serve.log")
    trusting = ssl.create_default_context(cafile=str(cert[0]))

    async def session_created():
        url = f"wss://127.0.0.1:{port}/v1/realtime"
        headers = {"Authorization": "Bearer K"}
        async with websockets.connect(url, additional_headers=headers, ssl=trusting) as ws:
            return json.loads(await asyncio.wait_for(ws.recv(), 20))

    try:
        event = asyncio.run(session_created())
        assert event["type"] == "session.created"
        with urllib.request.urlopen(f"https://localhost:{port}/", context=trusting) as r:
            assert r.status == 200 and b"<html" in r.read().lower()
        # a client that does not trust the certificate is refused by its own TLS check
        with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
            urllib.request.urlopen(f"https://127.0.0.1:{port}/health", timeout=5)
        # plain HTTP on the TLS port gets no answer a client could take for the server's
        with pytest.raises((OSError, urllib.error.URLError)):
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5).read()
    finally:
        stop(proc)
    assert "wss://127.0.0.1" in (tmp_path / "serve.log").read_text()
