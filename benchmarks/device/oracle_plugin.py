"""A pytest plugin that records each test's outcome and, for each bound it passed
(``assert err < tol``), the largest error seen next to the tolerance: how close the oracle tests
come to their limits on the device they ran on (a failed bound's values are in its message).
Loaded by ``bench_device.py`` with ``-p oracle_plugin -o enable_assertion_pass_hook=true``;
writes JSON to ``$MLX_VOICECHAT_ORACLE_JSON``."""

import json
import os
import re

_RESULTS = {}


def _entry(nodeid):
    return _RESULTS.setdefault(nodeid, {"outcome": None, "seconds": 0.0, "checks": []})


_NUMBER = re.compile(r"^(?:[\w.]*\()?\s*([-+]?(?:\d+\.?\d*(?:e[-+]?\d+)?|inf|nan))\s*\)?$", re.I)


def _number(text):
    """The number in ``1e-05``, ``np.float32(3.1e-07)`` or ``(0.5)`` as written; None for
    anything else."""
    m = _NUMBER.match(text.strip())
    return m.group(1) if m else None


def pytest_assertion_pass(item, lineno, orig, expl):
    # The explanation's first line is the comparison with its values filled in
    # ("1.2e-05 < 0.0001"); a bound checked in a loop is kept once, with its worst value.
    first = expl.splitlines()[0] if expl else ""
    for op in (" <= ", " < "):
        if op in first:
            texts = [x.strip() for x in first.split(op, 1)]
            break
    else:
        return
    numbers = [_number(t) for t in texts]
    if None in numbers or all(re.fullmatch(r"[-+]?\d+", n) for n in numbers):
        return  # not numbers, or a count against its limit rather than an error
    left, right = (float(n) for n in numbers)
    checks = _entry(item.nodeid)["checks"]
    for c in checks:
        if c["line"] == lineno:
            c["n"] += 1
            c["worst"] = max(c["worst"], left)
            return
    checks.append(
        {"line": lineno, "assert": orig, "op": op.strip(), "worst": left, "bound": right, "n": 1}
    )


def pytest_runtest_logreport(report):
    e = _entry(report.nodeid)
    e["seconds"] += report.duration
    if report.when == "call" or report.outcome != "passed":
        e["outcome"] = report.outcome if e["outcome"] in (None, "passed") else e["outcome"]
    if report.failed:
        crash = getattr(report.longrepr, "reprcrash", None)
        e["message"] = (crash.message if crash else str(report.longrepr))[-2000:]
    if report.skipped and isinstance(report.longrepr, tuple):
        e["message"] = str(report.longrepr[-1])


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get("MLX_VOICECHAT_ORACLE_JSON")
    if path:
        with open(path, "w", encoding="utf-8") as f:
            json.dump({"exitstatus": int(exitstatus), "tests": _RESULTS}, f, indent=1)
