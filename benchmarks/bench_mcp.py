"""chat --mcp keeps the 80 ms clock while a tool runs: frames against the wall clock.

    python benchmarks/bench_mcp.py [--model DIR] [--seconds 16] [--tool-seconds 2]

Drives ``cli.chat.chat_loop`` (what ``chat --mcp`` runs) with a microphone stand-in that hands
out an 80 ms block when its time has come, as a real one does, on the tiny random-weight
checkpoint (or ``--model``), once with the test MCP server over stdio and once over streamable
HTTP on 127.0.0.1. A call to its ``wait_for`` tool is forced on the function channel (random
weights never write one); the tool answers ``--tool-seconds`` after the call, its result is
injected, and the conversation goes on to ``--seconds``. For each frame: how late the loop came
back for the next block against the microphone's clock (0 when it waited for the
microphone), and the loop's own time for the block (the frame step, the sink, the MCP
hand-over). Printed for the frames run while the tool ran and for the others: the mean and
largest loop time and lateness, in ms and in frames (the issue's bound: none later than one
frame), and the ratio of the mean loop times: a tool that held up the loop would show its
seconds there. On a machine that does not run the model in real time the lateness grows with
or without a tool; the loop times still compare the two.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SERVER = ROOT / "tests" / "support" / "mcp_server.py"
FRAME = 0.08


class PacedSource:
    """Silence, one block per 80 ms of wall clock; forces ``ids`` from block 1 on and records
    how late each read came (the loop's lateness)."""

    def __init__(self, session, ids, seconds, on_read):
        self.sample_rate = 16000
        self.session, self.ids, self.on_read = session, ids, on_read
        self.blocks = int(seconds / FRAME)
        self.k, self.t0, self.late, self.work, self.back = 0, None, [], [], None

    def read(self, n):
        if self.k >= self.blocks:
            return None
        now = time.monotonic()
        if self.back is not None:
            self.work.append(now - self.back)  # the loop's own time for the last block
        if self.t0 is None:
            self.t0 = now
        due = self.t0 + self.k * FRAME
        self.late.append(max(0.0, now - due))
        if now < due:
            time.sleep(due - now)
        if 1 <= self.k <= len(self.ids):
            self.session.force(function_id=self.ids[self.k - 1])
        self.on_read(self.k)
        self.k += 1
        self.back = time.monotonic()
        return np.zeros(n, np.float32)


class NullSink:
    sample_rate = 22050

    def write(self, samples):
        pass


def run(model, transport, seconds, tool_seconds, http_url):
    from mlx_voicechat.cli.chat import chat_loop
    from mlx_voicechat.nemotron_voicechat.runtime.mcp import MCPTools, parse_config

    if transport == "stdio":
        server = {"command": sys.executable, "args": [str(SERVER), "stdio", "--only", "wait_for"]}
    else:
        server = {"url": http_url, "allowedTools": ["wait_for"]}
    tools = MCPTools(parse_config({"mcpServers": {"t": server}}))
    try:
        tools.start()
        session = model.session("Be brief.", tools=tools.functions)
        tok = model.tokenizer
        path = Path(tempfile.mkdtemp()) / "go"
        text = json.dumps([{"name": "wait_for", "arguments": {"path": str(path)}}])
        start, end = tok.convert_tokens_to_ids(["<SPECIAL_20>", "<SPECIAL_21>"])
        ids = [start] + tok.encode(f"<TOOLCALL>{text}</TOOLCALL>", add_special_tokens=False)
        ids.append(end)
        state = {"called": None, "done": None}

        def on_events(events):
            for e in events:
                if e.tool_calls and state["called"] is None:
                    state["called"] = session.frames
                    timer = threading.Timer(tool_seconds, path.touch)
                    timer.daemon = True
                    timer.start()

        def on_outcome(outcome):
            state["done"] = session.frames
            state["outcome"] = outcome

        source = PacedSource(session, ids, seconds, lambda k: None)
        chat_loop(session, source, NullSink(), on_events=on_events, tools=tools,
                  on_outcome=on_outcome)
    finally:
        tools.close()
    late = np.array(source.late[1:]) * 1000
    work = np.array(source.work) * 1000
    a, b = state["called"], state["done"]
    if a is None or b is None:
        print(f"{transport}: the call did not complete (called at {a}, done at {b})")
        return
    # block k (k >= 1) makes frame k - 1 final: frames a..b-1 ran while the tool did
    during, outside = slice(a, b), np.r_[0:a, b : len(work)]
    outcome = state["outcome"]
    print(
        f"{transport:5s}: the tool ran {outcome.seconds:.2f} s ({b - a} frames, "
        f"{'ok' if outcome.ok else outcome.error}); result injected over {session.tool_frames} "
        "frames"
    )
    for name, part in (("while the tool ran", during), ("outside the call", outside)):
        w, lt = work[part], late[part]
        print(
            f"    {name:18s}: loop time per 80 ms frame mean {w.mean():6.1f} ms, max "
            f"{w.max():6.1f} ms ({w.max() / 80:.2f} frames); late against the clock: max "
            f"{lt.max():6.1f} ms ({lt.max() / 80:.2f} frames)"
        )
    ratio = work[during].mean() / work[outside].mean()
    print(f"    mean loop time while the tool ran / outside: {ratio:.2f}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint folder (default: a tiny one)")
    ap.add_argument("--seconds", type=float, default=16.0)
    ap.add_argument("--tool-seconds", type=float, default=2.0)
    args = ap.parse_args(argv)
    import subprocess

    from mlx_voicechat import load

    if args.model is None:
        from mlx_voicechat.factory import make_checkpoint

        folder = Path(tempfile.mkdtemp()) / "tiny"
        args.model = make_checkpoint(folder, "tiny", "mlx-community", seed=0)
    model = load(args.model)
    proc = subprocess.Popen([sys.executable, str(SERVER), "http"], stdout=subprocess.PIPE,
                            text=True)
    try:
        url = f"http://127.0.0.1:{int(proc.stdout.readline())}/mcp"
        for transport in ("stdio", "http"):
            run(model, transport, args.seconds, args.tool_seconds, url)
    finally:
        proc.kill()
        proc.wait(10)


if __name__ == "__main__":
    main()
