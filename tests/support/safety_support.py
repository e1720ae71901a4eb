"""What the data-safety tests (tests/test_safety_*.py) share: a tiny checkpoint and its model,
copies of it to break, the CLI in-process and in child interpreters, and a child that file
permissions bind even as root (it drops root's permission-bypass capabilities)."""

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from mlx_voicechat import load
from mlx_voicechat.cli import main

ROOT = Path(__file__).resolve().parents[2]
NVIDIA = ROOT / "tests" / "fixtures" / "oracle" / "nvidia-layout"
SUBPROCESS_TIMEOUT = 120  # seconds, for each child interpreter


# --- fixtures -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint):
    return tiny_checkpoint


@pytest.fixture(scope="module")
def tiny(ckpt):
    return load(ckpt)


@pytest.fixture
def copy_of(tmp_path):
    def copy(src, name="m"):
        dst = tmp_path / name
        shutil.copytree(src, dst)
        return dst

    return copy


def _wave(seconds=0.75, seed=0):
    rng = np.random.default_rng(seed)
    return (0.1 * rng.standard_normal(int(seconds * 16000))).astype(np.float32)


def _cli(args, capsys):
    """Run the CLI in-process: (exit code, stdout, stderr)."""
    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


def _one_line_error(rc, err, *needles):
    assert rc == 2, err
    assert "Traceback" not in err
    lines = [ln for ln in err.strip().splitlines() if ": error: " in ln]
    assert len(lines) == 1, err
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


def _generate_args(ckpt, audio, out, *extra):
    return ["generate", "--model", ckpt, "--audio", audio, "--output-audio", out, "--quiet",
            "--extra-decoding-seconds", "0", *extra]


def _child(code, *args, env=None, cwd=ROOT):
    """A child interpreter running ``code`` (this checkout first on the path)."""
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *map(str, args)],
        capture_output=True,
        text=True,
        env=full_env,
        cwd=cwd,
        timeout=SUBPROCESS_TIMEOUT,
    )


# Root passes permission bits through two capabilities (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH,
# bits 1 and 2). The child drops them from all its sets before anything else, so the kernel
# checks the bits for it as for any user. (Running it as "nobody" instead needs an interpreter
# and a checkout that user can read; a Python installed under /root is not.)
_DROP_DAC_CAPABILITIES = """
    import ctypes, sys
    libc = ctypes.CDLL(None, use_errno=True)
    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]
    class Sets(ctypes.Structure):
        _fields_ = [(n, ctypes.c_uint32) for n in ("effective", "permitted", "inheritable")]
    header, sets = Header(0x20080522, 0), (Sets * 2)()  # _LINUX_CAPABILITY_VERSION_3
    if sys.platform.startswith("linux"):
        if libc.capget(ctypes.byref(header), sets) != 0:
            raise OSError(ctypes.get_errno(), "capget")
        for name in ("effective", "permitted", "inheritable"):
            setattr(sets[0], name, getattr(sets[0], name) & ~0b110)
        if libc.capset(ctypes.byref(header), sets) != 0:
            raise OSError(ctypes.get_errno(), "capset")
"""
_NOT_REFUSED = 77  # the child's exit code when the OS lets it past the permission bits


def _unprivileged_cli(args, denied):
    """Run the CLI in a child interpreter that file permissions bind (as root too: see
    _DROP_DAC_CAPABILITIES); first it checks that the kernel itself refuses ``denied``
    (EACCES), so the test sees the error the OS gives. Returns (exit code, stdout, stderr).
    Skipped only off Linux as root, where no capability can be dropped."""
    code = _DROP_DAC_CAPABILITIES + """
    import errno, os, sys
    denied, args = sys.argv[1], sys.argv[2:]
    try:
        if os.path.isdir(denied):
            open(os.path.join(denied, "probe"), "x").close()
        else:
            open(denied, "rb").close()
    except PermissionError as e:
        assert e.errno == errno.EACCES, e
    else:
        sys.exit(NOT_REFUSED)
    from mlx_voicechat.cli import main
    sys.exit(main(args))
    """.replace("NOT_REFUSED", str(_NOT_REFUSED))
    r = _child(code, denied, *args)
    if r.returncode == _NOT_REFUSED:
        assert not sys.platform.startswith("linux"), f"{denied} is not refused after the drop"
        pytest.skip("the OS does not refuse this user (root off Linux)")
    return r.returncode, r.stdout, r.stderr
