"""Data safety (issue 11), outputs: nothing a user owns is destroyed (FIFOs, devices, symlinks,
read-only files and folders, the input itself), and make-checkpoint and convert refuse folders
they did not write. Through the public entry points: the CLI (``mlx_voicechat.cli.main`` and
subprocesses) and ``mlx_voicechat.load``. The other subjects are in test_safety_signals.py and
test_safety_inputs.py; the shared fixtures in tests/support/safety_support.py.

Device-like outputs are FIFOs, symlinks and character devices: /dev/null itself only from a
process that cannot replace it (a user's, or root's child after it drops to "nobody"), else a
null device made in a temporary folder, so a regression can never replace the machine's.
"""

import json
import os
import shutil
import stat
import threading
from pathlib import Path

import pytest
import soundfile as sf
from safety_support import (  # noqa: F401  (fixtures)
    _child,
    _cli,
    _generate_args,
    _one_line_error,
    _unprivileged_cli,
    _wave,
    ckpt,
    copy_of,
    tiny,
)

from mlx_voicechat.factory import make_checkpoint

# --- 1, 13: outputs are never destroyed --------------------------------------------------------


def test_fifo_output_is_written_through(ckpt, question, tmp_path, capsys):
    fifo = tmp_path / "reply.fifo"
    os.mkfifo(fifo)
    got = {}

    def reader():
        with open(fifo, "rb") as f:
            got["bytes"] = f.read()

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    rc, _, err = _cli(_generate_args(ckpt, question, fifo), capsys)
    t.join(timeout=30)
    assert rc == 0, err
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)  # still a FIFO, not a regular file
    assert got["bytes"][:4] == b"RIFF" and got["bytes"][8:12] == b"WAVE"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["reply.fifo"]


def _is_null_device(path):
    st = os.stat(path)
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == os.stat("/dev/null").st_rdev


def test_dev_null_output_is_written_through():
    """save_wav and the output check on /dev/null itself, in a child that cannot create files
    in /dev (as root it drops to "nobody" once its imports are done)."""
    code = """
        import os, sys
        import numpy as np
        import soundfile  # imported while the interpreter's folder is still readable
        from mlx_voicechat.audio.io import check_output, save_wav

        if os.geteuid() == 0:
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
        assert not os.access("/dev", os.W_OK)  # a replacement of /dev/null would fail
        assert str(check_output("/dev/null")) == "/dev/null"
        assert str(save_wav("/dev/null", np.zeros(1764, np.float32), 22050)) == "/dev/null"
        print("written")
    """
    r = _child(code, cwd="/")
    assert r.returncode == 0 and r.stdout == "written\n", r.stderr[-2000:]
    assert _is_null_device("/dev/null")


@pytest.fixture
def null_device(tmp_path):
    """A character device to write to: /dev/null where this user cannot replace it, else (as
    root) a null device of our own in ``tmp_path``."""
    if not os.access("/dev", os.W_OK):
        return Path("/dev/null")
    node = tmp_path / "null"
    try:
        os.mknod(node, stat.S_IFCHR | 0o666, os.stat("/dev/null").st_rdev)
        node.write_bytes(b"probe")
    except OSError as e:  # no CAP_MKNOD, or a nodev file system
        pytest.skip(f"cannot make a character device here ({e.strerror})")
    return node


def test_character_device_output_is_written_through(ckpt, question, null_device, capsys):
    rc, _, err = _cli(_generate_args(ckpt, question, null_device), capsys)
    assert rc == 0, err
    assert _is_null_device(null_device)  # still the device, not a file put in its place
    if null_device.parent != Path("/dev"):
        assert os.listdir(null_device.parent) == ["null"]  # no temporary file left beside it


def test_symlink_output_writes_its_target(tiny, ckpt, question, tmp_path, capsys):
    target = tmp_path / "real.wav"
    target.write_bytes(b"old")
    target.chmod(0o600)
    link = tmp_path / "link.wav"
    link.symlink_to(target)
    rc, _, err = _cli(_generate_args(ckpt, question, link), capsys)
    assert rc == 0, err
    dangling = tmp_path / "dangling.wav"
    dangling.symlink_to(tmp_path / "new.wav")
    tiny.generate(_wave(), extra_decoding_seconds=0.0).save(dangling)
    assert link.is_symlink() and dangling.is_symlink()
    assert sf.info(str(target)).samplerate == 22050
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    assert sf.info(str(tmp_path / "new.wav")).samplerate == 22050


def test_read_only_output_is_refused_before_any_work(question, tmp_path, capsys):
    out = tmp_path / "keep.wav"
    out.write_bytes(b"precious")
    out.chmod(0o444)
    # The model path does not exist: the output check has to come first to be reported.
    rc, _, err = _cli(_generate_args(tmp_path / "no-model", question, out), capsys)
    _one_line_error(rc, err, f"cannot write {out}", "read-only")
    assert out.read_bytes() == b"precious" and stat.S_IMODE(out.stat().st_mode) == 0o444


def test_unwritable_folder_is_refused_before_any_work(question, tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        args = _generate_args(tmp_path / "no-model", question, folder / "r.wav")
        rc, _, err = _unprivileged_cli(args, folder)
    finally:
        folder.chmod(0o755)
    _one_line_error(rc, err, f"cannot write {folder / 'r.wav'}", "no permission")
    assert os.listdir(folder) == []


def test_replaced_file_keeps_its_permissions(tiny, question, tmp_path):
    out = tmp_path / "r.wav"
    out.write_bytes(b"old")
    out.chmod(0o640)
    tiny.generate(str(question), extra_decoding_seconds=0.0).save(out)
    assert stat.S_IMODE(out.stat().st_mode) == 0o640
    assert sf.info(str(out)).frames > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.wav"]


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
@pytest.mark.parametrize("writer", ["wav", "plot"])
def test_a_replaced_file_keeps_its_owner(writer, tmp_path):
    """An output written over another user's file (root writing a user's) stays that user's."""
    import numpy as np

    from mlx_voicechat.audio.io import save_wav
    from mlx_voicechat.nemotron_voicechat.runtime import plot

    out = tmp_path / f"r.{'png' if writer == 'plot' else 'wav'}"
    out.write_bytes(b"old")
    os.chown(out, 4321, 4322)
    out.chmod(0o640)
    if writer == "wav":
        save_wav(out, np.zeros(1764, np.float32), 22050)
    else:
        timeline = plot.Timeline(np.zeros(1600, np.float32), 16000, np.zeros(1764, np.float32),
                                 22050, 0.08, 1)
        plot.save(timeline, out)
    st = out.stat()
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (4321, 4322, 0o640)
    assert out.read_bytes() != b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == [out.name]


def test_output_that_is_the_input_is_refused(ckpt, question, tmp_path, capsys):
    audio = tmp_path / "q.wav"
    shutil.copy(question, audio)
    before = audio.read_bytes()
    link = tmp_path / "alias.wav"
    link.symlink_to(audio)
    for out in (audio, link):
        rc, _, err = _cli(_generate_args(ckpt, audio, out), capsys)
        _one_line_error(rc, err, f"cannot write {out}", "is the input audio file")
    assert audio.read_bytes() == before


def test_output_folder_is_refused_before_the_run(ckpt, question, tmp_path, capsys, monkeypatch):
    import mlx_voicechat

    loads = []
    monkeypatch.setattr(mlx_voicechat, "load", lambda *a, **k: loads.append(a))
    rc, _, err = _cli(_generate_args(ckpt, question, tmp_path), capsys)
    _one_line_error(rc, err, f"cannot write {tmp_path}", "is a folder")
    assert loads == []  # refused before the model loads


def test_new_files_and_folders_follow_the_umask(tiny, tmp_path):
    old = os.umask(0o027)
    try:
        tiny.generate(_wave(), extra_decoding_seconds=0.0).save(tmp_path / "r.wav")
        folder = make_checkpoint(tmp_path / "ck", "tiny")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "r.wav").stat().st_mode) == 0o640
    assert stat.S_IMODE(folder.stat().st_mode) == 0o750


# --- 2, 15: make-checkpoint and convert refuse what they did not write --------------------------


def test_make_checkpoint_refuses_a_non_empty_folder(tmp_path, capsys):
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "notes.txt").write_text("keep me")
    for extra in ([], ["--force"]):
        rc, _, err = _cli(["make-checkpoint", folder, *extra], capsys)
        _one_line_error(rc, err, str(folder))
    assert (folder / "notes.txt").read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]  # no temp folder left


def test_make_checkpoint_refuses_the_current_folder(tmp_path, capsys, monkeypatch):
    (tmp_path / "notes.txt").write_text("keep me")
    monkeypatch.chdir(tmp_path)
    rc, _, err = _cli(["make-checkpoint", "."], capsys)
    _one_line_error(rc, err, "is the current folder")
    assert os.listdir(tmp_path) == ["notes.txt"]


def test_make_checkpoint_force_replaces_only_its_own_folder(tmp_path, capsys):
    folder = tmp_path / "ck"
    rc, _, err = _cli(["make-checkpoint", folder, "--layout", "nvidia"], capsys)
    assert rc == 0, err
    rc, _, err = _cli(["make-checkpoint", folder], capsys)
    _one_line_error(rc, err, "already exists", "--force")
    rc, _, err = _cli(["make-checkpoint", folder, "--force"], capsys)
    assert rc == 0, err
    assert json.loads((folder / "config.json").read_text())["model_type"] == "nemotron_voicechat"
    (folder / "my-notes.txt").write_text("mine")  # now it holds something it did not write
    rc, _, err = _cli(["make-checkpoint", folder, "--force"], capsys)
    _one_line_error(rc, err, "not a checkpoint folder this command wrote")
    assert (folder / "my-notes.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


def test_make_checkpoint_onto_a_file(tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("x")
    rc, _, err = _cli(["make-checkpoint", f], capsys)
    _one_line_error(rc, err, "is not a folder")
    assert f.read_text() == "x"


def test_convert_output_current_folder(ckpt, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc, _, err = _cli(["convert", "--source", ckpt, "--output", ".", "--quiet"], capsys)
    _one_line_error(rc, err, "is the current folder")
    (tmp_path / "notes.txt").write_text("keep me")
    rc, _, err = _cli(["convert", "--source", ckpt, "--output", ".", "--quiet"], capsys)
    _one_line_error(rc, err, "already exists")
    assert os.listdir(tmp_path) == ["notes.txt"]
