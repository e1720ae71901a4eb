"""The open-file limits of a real ``mlx-voicechat serve`` (issue 26): importing ``mlx_lm.utils``
sets a process's limits to (2048, 4096), and the command line imports every verb module to
build its parser, so a verb module that imported mlx at its top would lower them before
``serve`` could keep them. Here the server runs as a user runs it, ``python -m mlx_voicechat
serve`` in a process of its own, with limits the test sets in that process."""

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

ROOT = Path(__file__).resolve().parents[2]
LIMIT = 20000  # the child's soft open-file limit where the hard one allows (`ulimit -n 20000`)
FEW, MANY = 1000, 5000  # --max-connections: 2128 and 10128 files


def _env():
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _proc_limits(pid: int):
    """(soft, hard) of "Max open files" in /proc/PID/limits, or None without /proc."""
    path = Path(f"/proc/{pid}/limits")
    if not path.exists():
        return None
    for line in path.read_text().splitlines():
        if line.startswith("Max open files"):
            soft, hard = line.split()[3:5]
            return soft, hard
    raise AssertionError(f"no open-file line in {path}")


def _files(connections: int) -> int:
    return 2 * connections + 128  # what serve asks for (serve.limits.Limits.files_needed)


def test_a_real_serve_keeps_the_open_file_limits_it_was_started_with(tmp_path):
    """The server process starts with a soft limit above what ``--max-connections`` needs and
    above mlx_lm's 2048; once it answers, its limits are still the ones it started with, and
    no connection was given up. (The test process itself may have imported ``mlx_lm.utils``
    and so hold a hard limit of 4096, which a child cannot raise: the child gets the most this
    process has, and as many connections as fit in fewer files than that.)"""
    checkpoint = tmp_path / "tiny"
    argv = [sys.executable, "-m", "mlx_voicechat", "make-checkpoint", str(checkpoint)]
    subprocess.run(argv, env=_env(), check=True, capture_output=True, timeout=300)
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    soft = LIMIT if hard == resource.RLIM_INFINITY else min(hard, LIMIT)
    connections = MANY if _files(MANY) < soft else FEW
    if _files(connections) >= soft:
        pytest.skip(f"the hard open-file limit here is {hard}, too few for the test")
    hard = LIMIT if hard == resource.RLIM_INFINITY else hard

    def set_limits():  # in the child, before it runs Python
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    port = _free_port()
    log = tmp_path / "serve.log"
    argv = [sys.executable, "-m", "mlx_voicechat", "serve", "--model", str(checkpoint)]
    argv += ["--port", str(port), "--max-connections", str(connections)]
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, env=_env(), preexec_fn=set_limits
        )
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, log.read_text()[-2000:]
            assert time.monotonic() < deadline, "the server did not start"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            time.sleep(0.2)
        limits = _proc_limits(proc.pid)
    finally:
        proc.terminate()
        proc.wait(30)
    text = log.read_text()
    assert "--max-connections lowered" not in text, text[-2000:]
    if limits is not None:
        assert limits == (str(soft), str(hard))


def test_building_the_command_line_imports_no_mlx():
    """Verb modules keep their heavy imports inside ``run``: ``--help`` and the parser import
    neither mlx nor mlx-lm (whose import would lower the open-file limits)."""
    code = (
        "import sys\n"
        "from mlx_voicechat.cli import build_parser\n"
        "build_parser()\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('mlx', 'mlx_lm', 'mlx_audio')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_convert_offers_the_dtypes_it_converts_to():
    from mlx_voicechat.cli.convert import DTYPE_NAMES
    from mlx_voicechat.nemotron_voicechat.weights.convert import DTYPES

    assert list(DTYPE_NAMES) == list(DTYPES)
