"""The server's MLX worker at interpreter exit, in any process (not only `serve`, which stops
it itself): the job that runs is cut short between two lines of Python and no other starts,
so the process exits cleanly (MLX work cut by the interpreter's finalization aborted the
process: "terminate called without an active exception", exit status 134)."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import time

import mlx.core as mx

from mlx_voicechat.serve.worker import Worker

w = Worker()
done = []


def busy(n):  # MLX work for a second, whatever the machine's speed
    a = mx.random.normal((64, 64), key=mx.random.key(0))
    t0 = time.monotonic()
    while time.monotonic() - t0 < 1.0:
        a = mx.tanh(a @ a / 8.0)
        mx.eval(a)
    done.append(n)
    print("job", n, "done", flush=True)


w.submit(busy, 1)
w.submit(busy, 2)
time.sleep(0.2)  # job 1 is running when the script ends
"""


def test_a_job_running_at_exit_ends_and_the_process_exits_cleanly(tmp_path):
    script = tmp_path / "exit_while_busy.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for _ in range(3):
        done = subprocess.run(
            [sys.executable, str(script)],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
            check=False,
        )
        assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
        assert "job 2" not in done.stdout  # the job that waited never started
