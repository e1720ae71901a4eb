"""`mlx-voicechat serve` argument handling, without starting a server (uvicorn is replaced)."""

import argparse
import sys

import pytest

from mlx_voicechat.cli import serve


def parse(*argv):
    p = argparse.ArgumentParser(prog="mlx-voicechat")
    serve.add_parser(p.add_subparsers(dest="command"))
    return p.parse_args(["serve", "--model", "some/ckpt", *argv])


@pytest.fixture
def started(monkeypatch):
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    import mlx_voicechat

    calls = {}
    monkeypatch.setattr(mlx_voicechat, "load", lambda path, tokenizer=None: f"model:{path}")
    def serve_app(app, shutdown_timeout, **kw):  # instead of uvicorn
        calls.update(app=app, shutdown_timeout=shutdown_timeout, **kw)
        return 0

    monkeypatch.setattr(serve, "_serve_app", serve_app)
    monkeypatch.delenv(serve.KEY_ENV, raising=False)
    return calls


def test_defaults_bind_loopback_without_a_warning(started, capsys):
    assert serve.run(parse()) == 0
    server = started["app"].state.server
    assert started["host"] == "127.0.0.1" and started["port"] == 8000
    assert started["ws_max_size"] > (1 << 20)
    assert server.api_key is None and server.max_sessions == 1 and server.silence_feed
    assert server.model == "model:some/ckpt" and server.model_id == "ckpt"
    assert started["shutdown_timeout"] == 10.0
    assert "warning" not in capsys.readouterr().err


def test_key_from_the_environment_and_flags(started, capsys, monkeypatch):
    monkeypatch.setenv(serve.KEY_ENV, "env-key")
    args = parse(
        "--host",
        "0.0.0.0",
        "--max-sessions",
        "3",
        "--allow-origin",
        "http://a.example",
        "--no-silence-feed",
    )
    assert serve.run(args) == 0
    server = started["app"].state.server
    assert server.api_key == "env-key" and server.max_sessions == 3
    assert server.allow_origins == {"http://a.example"} and not server.silence_feed
    assert "warning" not in capsys.readouterr().err  # a key: no warning
    assert serve.run(parse("--api-key", "flag-key")) == 0
    assert started["app"].state.server.api_key == "flag-key"


def test_public_host_without_a_key_warns(started, capsys):
    assert serve.run(parse("--host", "0.0.0.0")) == 0
    err = capsys.readouterr().err
    assert "warning" in err and "without an API key" in err


@pytest.mark.parametrize(
    "argv, message",
    [
        (("--port", "0"), "--port"),
        (("--max-sessions", "0"), "--max-sessions"),
        (("--max-lag-seconds", "0"), "--max-lag-seconds"),
    ],
)
def test_bad_values_are_one_line_errors(started, argv, message):
    with pytest.raises(serve.ServeError, match=message):
        serve.run(parse(*argv))


def test_missing_server_extra_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "fastapi", None)  # makes `import fastapi` fail
    with pytest.raises(serve.ServeError, match=r"mlx-voicechat\[server\]"):
        serve.run(parse())
