"""MCP tools that run (runtime.mcp, chat --mcp): small MCP servers of the tests' own
(``tests/support/mcp_server.py``, over stdio and streamable HTTP on 127.0.0.1), their tools as the
model's, calls forced on the function channel, every failure a result the model hears, and
nothing left running after the conversation."""

import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("mcp", reason="the [mcp] extra (the official MCP SDK) is not installed")

from mcp_support import SERVER, http_url, stdio  # noqa: E402, F401  (http_url: a fixture)

from mlx_voicechat.audio.devices import ArraySink, ArraySource  # noqa: E402
from mlx_voicechat.nemotron_voicechat.runtime.mcp import (  # noqa: E402
    MCPError,
    MCPTools,
    parse_config,
    require_sdk,
)
from mlx_voicechat.nemotron_voicechat.runtime.tools import ToolCall, tool_result_ids  # noqa: E402


def gone(pid):
    """The process has ended (a zombie counts: its parent, this process, may not have reaped
    it yet); an exiting process is given a moment to end."""
    for _ in range(200):
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in "ZX":
                return True
        except OSError:
            return True
        time.sleep(0.05)
    return False


def test_config_and_sdk_errors_are_one_line(monkeypatch):
    assert [s.name for s in parse_config({"mcpServers": {"a": stdio("add")}})] == ["a"]
    for bad, words in [
        ([], '"mcpServers"'),
        ({"mcpServers": {}}, "no servers"),
        ({"mcpServers": {"a": {}}}, '"command" (stdio) or "url"'),
        ({"mcpServers": {"a": {"url": "ftp://x"}}}, "http://"),
        ({"mcpServers": {"a": {"command": "x", "args": "y"}}}, "args must be a list"),
        ({"mcpServers": {"a b": {"command": "x"}}}, "letters, digits"),
        ({"mcpServers": {"a": {"url": "http://x", "headers": {"k": 1}}}}, "headers"),
    ]:
        with pytest.raises(MCPError, match=words.replace("(", r"\(").replace(")", r"\)")):
            parse_config(bad)
    spec = parse_config({"mcpServers": {"h": {"url": "http://x/mcp", "headers": {"A": "secret"}}}})
    assert "secret" not in repr(spec) and spec[0].where == "http://x/mcp"
    spec = parse_config({"mcpServers": {"h": {"url": "https://u:pw@x:8443/mcp?key=k3y"}}})
    assert spec[0].where == "https://x:8443/mcp"
    monkeypatch.setitem(sys.modules, "mcp", None)
    with pytest.raises(MCPError, match=r"pip install 'mlx-voicechat\[mcp\]'"):
        require_sdk()


def test_an_exception_group_is_described_by_its_first_leaf():
    from mlx_voicechat.nemotron_voicechat.runtime.mcp import _describe

    class BackportGroup(Exception):  # the exceptiongroup backport's shape (Python 3.10)
        def __init__(self, exceptions):
            super().__init__("unhandled errors in a TaskGroup")
            self.exceptions = tuple(exceptions)

    leaf = ConnectionError("refused")
    groups = [BackportGroup([BackportGroup([leaf])])]
    if sys.version_info >= (3, 11):
        groups.append(BaseExceptionGroup("g", [ExceptionGroup("h", [leaf])]))  # noqa: F821
    for group in groups:
        assert _describe(group) == "ConnectionError: refused"


def test_a_call_cancelled_under_it_is_still_an_outcome():
    """A call whose future the closing client cancels still gives the model an outcome (the
    callback raised CancelledError, so the outcome never came and in_flight stayed up)."""
    from concurrent.futures import Future

    with MCPTools([]) as tools:
        tools.routes = {"f": ("s", "t")}
        cancelled = Future()
        cancelled.cancel()
        tools.client.call = lambda *a: cancelled
        outcome = _run(tools, "f")
        assert (outcome.kind, outcome.error) == ("protocol", "the call did not run (cancelled)")
        assert tools.take_finished() == [outcome] and tools.in_flight == 0


def _start(specs, **kw):
    tools = MCPTools(specs, **kw)
    try:
        tools.start()
    except BaseException:
        tools.close()
        raise
    return tools


def _run(tools, name, arguments="{}", call_id="c"):
    return tools.submit(ToolCall(call_id, name, arguments)).result(30)


def test_two_servers_their_tools_named_and_called(http_url):
    specs = parse_config({"mcpServers": {
        "s": stdio("add,pid,get_weather"),
        "h": {"url": http_url, "headers": {"X-Test": "1"}, "allowedTools": ["add", "big"]},
    }})
    tools = _start(specs)
    try:
        # a name two servers share is prefixed by the server; the others keep their own
        names = [f["name"] for f in tools.functions]
        assert names == ["s_add", "get_weather", "pid", "h_add", "big"]
        add = tools.functions[0]
        assert add["type"] == "function" and add["description"] == "Add two integers."
        assert set(add["parameters"]["properties"]) == {"a", "b"}
        assert tools.routes["h_add"] == ("h", "add")
        assert _run(tools, "s_add", '{"a": 1, "b": 2}').output == "3"
        assert _run(tools, "h_add", '{"a": 1, "b": 5}').output == "6"
        weather = _run(tools, "get_weather", '{"city": "Paris"}')
        assert weather.ok and json.loads(weather.output) == {"city": "Paris", "temp_c": 21}
        assert (weather.server, weather.tool, weather.seconds > 0) == ("s", "get_weather", True)
        big = _run(tools, "big")  # 1 MB over HTTP: refused, as a message
        assert not big.ok and "returned 1048576 characters; at most 4000" in big.output
        pid = int(_run(tools, "pid").output)
        assert len(tools.take_finished()) == 5 and tools.in_flight == 0
    finally:
        tools.close()
    assert gone(pid) and not tools.client.thread.is_alive()  # the stdio server stopped


def test_every_failure_is_a_result_the_model_hears(tmp_path):
    specs = parse_config({"mcpServers": {"s": stdio("add,hang,fail,die,pid")}})
    tools = _start(specs, timeout=5.0)
    try:
        pid = int(_run(tools, "pid").output)
        hang = _run(tools, "hang")
        assert hang.error == "the tool 'hang' did not answer within 5 s"
        fail = _run(tools, "fail", '{"reason": "no network"}')
        assert not fail.ok and "the tool failed: no network" in fail.output
        bad = _run(tools, "add", "{not json")
        assert bad.error.startswith("the arguments are not JSON")
        died = _run(tools, "die")
        assert died.error.startswith("the MCP server 's' stopped during the call")
        after = _run(tools, "add", '{"a": 1, "b": 1}')
        assert after.error.startswith("the MCP server 's' is not running")
        assert gone(pid)
        # what chat does with them: each one a result the model hears, errors as {"error"}
        from mlx_voicechat.cli.chat import inject_results

        class Heard:
            def __init__(self):
                self.results = []

            def add_tool_result(self, call_id, output):
                self.results.append(output)

        heard = Heard()
        done = inject_results(heard, tools)
        assert [o.kind for o in done] == ["ok", "timeout", "tool", "arguments", "closed", "closed"]
        assert heard.results[0] == str(pid)
        assert heard.results[1:] == [{"error": o.error} for o in done[1:]]
    finally:
        tools.close()
    # a server that does not start, too many tools, a tool the server lacks: one line each
    crash = {"command": sys.executable, "args": ["-c", "import sys; sys.exit('boom at start')"]}
    cases = [
        ({"c": crash}, "the MCP server 'c' .* did not start: .*boom at start"),
        ({"s": stdio("add,hang,fail,die,pid"), "t": stdio("add")}, "at most 5 in all"),
        ({"s": dict(stdio("add"), allowedTools=["nope"])}, "has no tool 'nope'"),
    ]
    for servers, words in cases:
        with pytest.raises(MCPError, match=words) as e:
            _start(parse_config({"mcpServers": servers}), start_timeout=30)
        assert "\n" not in str(e.value)


# --- chat: a forced call runs while the frames go on ------------------------------------------


class ForcingSource(ArraySource):
    """A microphone of silence that forces ``ids`` on the function channel (one per frame:
    read k makes frame k - 1 final), creates ``path`` ``wait`` frames after the call, then
    waits for the call's outcome before the next block, so the loop injects it at once."""

    def __init__(self, session, ids, path, wait, frames, futures):
        super().__init__(np.zeros(1280 * frames + 199, np.float32), 16000)
        self.session, self.ids, self.path, self.wait = session, ids, path, wait
        self.futures = futures
        self.reads = 0
        self.touched = None

    def read(self, n):
        k, self.reads = self.reads, self.reads + 1
        if 1 <= k <= len(self.ids):
            self.session.force(function_id=self.ids[k - 1])
        if k == len(self.ids) + 1 + self.wait:
            assert self.futures and not self.futures[0].done()  # it waits for the file
            self.touched = self.session.frames
            Path(self.path).touch()
        if self.touched is not None and k == len(self.ids) + 2 + self.wait:
            self.futures[0].result(30)
        return super().read(n)


@pytest.mark.parametrize("transport", ["stdio", "http"])
def test_chat_loop_runs_a_forced_call_and_injects_its_result(tiny, http_url, tmp_path, transport):
    from mlx_voicechat.cli.chat import chat_loop

    server = stdio("wait_for,add") if transport == "stdio" else {
        "url": http_url, "allowedTools": ["wait_for", "add"]
    }
    tools = _start(parse_config({"mcpServers": {"t": server}}))
    try:
        session = tiny.session("Be brief.", tools=tools.functions, seed=3)
        tok = tiny.tokenizer
        path = str(tmp_path / f"go-{transport}")
        text = json.dumps([{"name": "wait_for", "arguments": {"path": path}}])
        start, end = tok.convert_tokens_to_ids(["<SPECIAL_20>", "<SPECIAL_21>"])
        ids = [start] + tok.encode(f"<TOOLCALL>{text}</TOOLCALL>", add_special_tokens=False) + [end]
        futures, submit = [], tools.submit
        tools.submit = lambda call: futures.append(submit(call)) or futures[-1]
        result_ids = tool_result_ids(tok, "the file is there")
        wait = 12
        frames = len(ids) + wait + len(result_ids) + 6
        source = ForcingSource(session, ids, path, wait, frames, futures)
        events, outcomes = [], []
        chat_loop(session, source, ArraySink(22050), on_events=events.extend, tools=tools,
                  on_outcome=outcomes.append)
    finally:
        tools.close()
    called = [k for k, e in enumerate(events) if e.tool_calls]
    assert len(called) == 1 and events[called[0]].tool_calls[0].name == "wait_for"
    (outcome,) = outcomes
    assert outcome.ok and outcome.output == "the file is there"
    # the frames went on while the tool ran: it could not answer before the file, made `wait`
    # frames after the call, and the result is injected right after it arrived
    first = next(k for k in range(called[0] + 1, len(events)) if events[k].forced)
    assert first - called[0] > wait and source.touched > called[0] + wait
    injected = events[first : first + len(result_ids)]
    assert [e.function_id for e in injected] == result_ids and all(e.forced for e in injected)
    assert session.tool_frames == len(result_ids)


def our_servers(settle=False):
    """Live stdio test servers this process started (zombies not counted); with
    ``settle``, those still there after a moment to end."""
    for _ in range(100 if settle else 1):
        found = _our_servers()
        if not found:
            return found
        time.sleep(0.05)
    return found


def _our_servers():
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmd = (stat.parent / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        ours = int(fields[1]) == os.getpid() and "mcp_server.py\x00stdio" in cmd
        if fields[0] != "Z" and ours:
            found.append(cmd)
    return found


def test_chat_cli_starts_prints_and_stops_its_servers(tiny_checkpoints, monkeypatch, capsys,
                                                      tmp_path):
    import threading

    from mlx_voicechat.audio import devices
    from mlx_voicechat.cli import main

    class Interrupting(ArraySource):
        """A microphone the user stops with Ctrl-C after 6 blocks."""

        def read(self, n):
            if self.position >= 6 * 1280:
                assert our_servers()  # the stdio server runs while the conversation does
                raise KeyboardInterrupt
            return super().read(n)

    monkeypatch.setattr(devices, "check", lambda *a: None)
    monkeypatch.setattr(devices, "open_microphone",
                        lambda d, r: Interrupting(np.zeros(16000, np.float32), r))
    monkeypatch.setattr(devices, "open_speaker", lambda d, r: ArraySink(r))
    config = tmp_path / "mcp.json"
    config.write_text(json.dumps({"mcpServers": {"calc": stdio("add,pid")}}))
    argv = ["chat", "--model", str(tiny_checkpoints["mlx-community"]), "--mcp", str(config)]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "MCP server calc (" in err and ": add, pid" in err and "ended after 6 frames" in err
    assert not our_servers(settle=True)  # Ctrl-C stopped the server it started
    assert not [t for t in threading.enumerate() if t.name == "mlx-voicechat-mcp"]
    config.write_text(json.dumps({"servers": {}}))
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and '"mcpServers"' in err[0]
    config.write_text(json.dumps({"mcpServers": {"calc": stdio("add,pid")}}))
    assert main(argv + ["--tool-timeout", "0"]) == 2
    assert "--tool-timeout must be > 0" in capsys.readouterr().err
