"""Data safety and bad input (issue 11): nothing a user owns is destroyed, every bad input is one
clear error. Through the public entry points: the CLI (``mlx_voicechat.cli.main`` and
subprocesses), ``mlx_voicechat.load``, ``mlx_lm.load`` and ``mlx_audio.sts``.

Device-like outputs are FIFOs, symlinks and character devices: /dev/null itself only from a
process that cannot replace it (a user's, or root's child after it drops to "nobody"), else a
null device made in a temporary folder, so a regression can never replace the machine's.
"""

import json
import os
import shutil
import stat
import subprocess
import sys
import textwrap
import threading
import warnings
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import soundfile as sf

from mlx_voicechat import load
from mlx_voicechat.cli import main
from mlx_voicechat.errors import VoiceChatError
from mlx_voicechat.factory import make_checkpoint

ROOT = Path(__file__).parent.parent
NVIDIA = Path(__file__).parent / "fixtures" / "oracle" / "nvidia-layout"
SUBPROCESS_TIMEOUT = 120  # seconds, for each child interpreter


# --- fixtures -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("safety") / "tiny", "tiny")


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
        from mlx_voicechat.runtime.audio import check_output, save_wav

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


# --- 3: SIGTERM / SIGHUP clean up like Ctrl-C ------------------------------------------------

_SIGNAL_DURING = """
    import os, signal, sys
    import mlx_voicechat.weights.writer as writer
    from mlx_voicechat.cli import main

    name = sys.argv[1]
    real = writer.write_tensor

    def write_then_signal(f, spec, array):
        real(f, spec, array)
        os.kill(os.getpid(), getattr(signal, name))  # as if sent from outside, mid-shard

    writer.write_tensor = write_then_signal
    sys.exit(main(sys.argv[2:]))
"""


def test_convert_sigterm_removes_the_temp_folder(ckpt, tmp_path):
    out = tmp_path / "out"
    r = _child(_SIGNAL_DURING, "SIGTERM", "convert", "--source", ckpt, "--output", out, "--quiet")
    assert r.returncode == 143, r.stderr
    assert "terminated (SIGTERM)" in r.stderr and "Traceback" not in r.stderr
    assert list(tmp_path.iterdir()) == []  # neither the output nor a hidden temp folder


def test_make_checkpoint_sighup_removes_the_temp_folder(tmp_path):
    r = _child(_SIGNAL_DURING, "SIGHUP", "make-checkpoint", tmp_path / "ck")
    assert r.returncode == 129, r.stderr
    assert "terminated (SIGHUP)" in r.stderr and "Traceback" not in r.stderr
    assert list(tmp_path.iterdir()) == []


def test_generate_sigterm_leaves_no_file(ckpt, question, tmp_path):
    code = """
        import os, signal, sys
        import mlx_voicechat.runtime.step as frame_step
        from mlx_voicechat.cli import main

        real = frame_step._speak

        def speak_then_signal(*a, **k):
            os.kill(os.getpid(), signal.SIGTERM)
            return real(*a, **k)

        frame_step._speak = speak_then_signal
        sys.exit(main(sys.argv[1:]))
    """
    out = tmp_path / "r.wav"
    r = _child(code, *_generate_args(ckpt, question, out))
    assert r.returncode == 143, r.stderr
    assert "terminated (SIGTERM)" in r.stderr
    assert list(tmp_path.iterdir()) == []


# --- 16: Ctrl-C at any moment ----------------------------------------------------------------


def test_ctrl_c_during_the_heavy_imports(ckpt):
    # SIGINT delivered while `python -m mlx_voicechat` imports MLX (the first second of any
    # command), deterministically: an audit hook sends it when mlx.core starts importing. The
    # parser imports no MLX, so that happens in the verb, which names itself.
    code = """
        import os, runpy, signal, sys

        # As in a terminal: a shell starts background jobs with SIGINT ignored, and a child
        # of a test run started that way would inherit it and never see this Ctrl-C.
        signal.signal(signal.SIGINT, signal.default_int_handler)

        def hook(event, args):
            if event == "import" and args[0] == "mlx.core":
                os.kill(os.getpid(), signal.SIGINT)

        sys.addaudithook(hook)
        sys.argv = ["mlx-voicechat", "info", sys.argv[1]]
        runpy.run_module("mlx_voicechat", run_name="__main__", alter_sys=True)
    """
    r = _child(code, ckpt)
    assert r.returncode == 130, r.stderr
    assert r.stderr.strip() == "mlx-voicechat info: interrupted"


# --- 4, 11, 12: generation arguments ---------------------------------------------------------


@pytest.mark.parametrize("prompt", [[1, 99999, 2], [1, -1, 2], [1, 400, 2], [1, 1.5, 2], [True]])
def test_prompt_ids_outside_the_embedding_table(tiny, prompt):
    with pytest.raises(VoiceChatError, match="is not a token id of this model: ids are integers"):
        tiny.generate(_wave(), prompt=prompt, extra_decoding_seconds=0.0)


@pytest.mark.parametrize("seed", [None, 1.5, "0", -1, 2**64, True])
def test_bad_seed_api(tiny, seed):
    with pytest.raises(VoiceChatError, match="seed must be an integer from 0 to 2\\*\\*64 - 1"):
        tiny.generate(_wave(), seed=seed, extra_decoding_seconds=0.0)


@pytest.mark.parametrize("seed", ["-1", "18446744073709551616"])
def test_bad_seed_cli(seed, ckpt, question, tmp_path, capsys):
    args = _generate_args(ckpt, question, tmp_path / "r.wav", "--seed", seed)
    _one_line_error(*_cli(args, capsys)[::2], "--seed must be an integer from 0 to 2**64 - 1")
    assert list(tmp_path.iterdir()) == []


def test_largest_seed_works(tiny):
    assert tiny.generate(_wave(), seed=2**64 - 1, extra_decoding_seconds=0.0).frames > 0


@pytest.mark.parametrize("seconds", ["3", None, float("nan"), float("inf"), -1.0, True])
def test_bad_extra_decoding_seconds_api(tiny, seconds):
    with pytest.raises(VoiceChatError, match="extra_decoding_seconds must be a finite number"):
        tiny.generate(_wave(), extra_decoding_seconds=seconds)


def test_huge_extra_decoding_seconds_is_bounded_before_allocating(tiny, ckpt, question, tmp_path,
                                                                  capsys, monkeypatch):
    """Refused before the silence is made: 1e9 s of it (58 TiB) would fail to allocate with
    another error, or run the encoder (counted here) on what could be allocated."""
    runs = []
    perception = type(tiny.stt_model.perception)
    real = perception.__call__
    monkeypatch.setattr(perception, "__call__", lambda *a, **k: runs.append(1) or real(*a, **k))
    with pytest.raises(VoiceChatError, match="the LLM's context is 4096"):
        tiny.generate(_wave(), extra_decoding_seconds=1e9)
    args = _generate_args(ckpt, question, tmp_path / "r.wav")
    args[-1] = "1e9"
    _one_line_error(*_cli(args, capsys)[::2], "extra_decoding_seconds (1e+09 s)",
                    "the LLM's context is 4096")
    assert runs == []
    assert not (tmp_path / "r.wav").exists()


# --- 5: threads ------------------------------------------------------------------------------


def test_generate_from_other_threads(tiny, ckpt):
    """Each thread has its own input, prompt and seed and gets its own solo run's result: a
    call that used another's state (or the model's from an earlier call) would not."""
    second = load(ckpt)
    jobs = {  # name: (model, input, prompt, seed)
        "other": (tiny, _wave(0.4, seed=1), "", 3),
        "a": (tiny, _wave(0.4, seed=2), "Be brief.", 4),
        "b": (second, _wave(0.48, seed=3), "Say more.", 5),
    }

    def generate(name):
        model, wave, prompt, seed = jobs[name]
        return model.generate(wave, system_prompt=prompt, extra_decoding_seconds=0.0, seed=seed)

    want = {name: generate(name) for name in jobs}
    for x, y in (("other", "a"), ("a", "b"), ("other", "b")):  # so that cross-talk would show
        assert not np.array_equal(want[x].codes, want[y].codes)
    results, errors = {}, []

    def run(name):
        try:
            results[name] = generate(name)
        except Exception as e:  # reported below, with the thread's name
            errors.append(f"{name}: {type(e).__name__}: {e}")

    t = threading.Thread(target=run, args=("other",))
    t.start()
    t.join(timeout=120)
    pair = [threading.Thread(target=run, args=(n,)) for n in ("a", "b")]
    for t in pair:
        t.start()
    for t in pair:
        t.join(timeout=120)
    assert errors == []
    for name in jobs:
        np.testing.assert_array_equal(results[name].codes, want[name].codes, err_msg=name)
        assert results[name].text_ids == want[name].text_ids, name
        np.testing.assert_array_equal(results[name].audio, want[name].audio, err_msg=name)


def test_process_exits_cleanly_after_a_generating_thread(ckpt):
    code = """
        import sys, threading
        import numpy as np
        from mlx_voicechat import load

        model = load(sys.argv[1])
        wave = (0.1 * np.random.default_rng(0).standard_normal(12000)).astype(np.float32)
        t = threading.Thread(target=lambda: model.generate(wave, extra_decoding_seconds=0.0))
        t.start()
        t.join()
        print("done")
    """
    r = _child(code, ckpt)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "terminate called" not in r.stderr


# --- 6: mlx-audio's non-strict loading checks shapes -----------------------------------------


def test_post_load_hook_rejects_a_misshaped_tensor(ckpt, copy_of):
    import mlx_audio.sts as sts

    folder = copy_of(ckpt)
    (shard,) = folder.glob("model-*.safetensors")
    w = dict(mx.load(str(shard)))
    w["stt_model.lm_head.weight"] = w["stt_model.lm_head.weight"][:-1]
    mx.save_safetensors(str(shard), w, metadata={"format": "mlx"})
    message = "tensor 'stt_model.lm_head.weight' has shape [399, 64] in the checkpoint but the " \
              "model expects [400, 64]"
    with pytest.raises(VoiceChatError) as ours:
        load(folder)
    with pytest.raises(VoiceChatError) as theirs:
        sts.load_model(str(folder))
    assert str(ours.value) == str(theirs.value) == message


# --- 7: the RNNT vocabulary ------------------------------------------------------------------


def _edit_config(folder, edit):
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    edit(cfg)
    path.write_text(json.dumps(cfg))


def test_checkpoint_without_rnnt_vocabulary(ckpt, copy_of, tmp_path, question, capsys):
    folder = copy_of(ckpt)
    _edit_config(folder, lambda c: c.pop("rnnt_vocabulary"))
    shutil.rmtree(folder / "rnnt_tokenizer")
    with pytest.raises(VoiceChatError, match="has no RNNT vocabulary"):
        load(folder)
    rc, _, err = _cli(["transcribe", "--model", folder, "--audio", question], capsys)
    _one_line_error(rc, err, "has no RNNT vocabulary")


def test_rnnt_vocabulary_shorter_than_the_joint(ckpt, copy_of):
    folder = copy_of(ckpt)
    _edit_config(folder, lambda c: c.update(rnnt_vocabulary=c["rnnt_vocabulary"][:10]))
    with pytest.raises(VoiceChatError, match="has 10 pieces but the transcript head has 40"):
        load(folder)


# --- 8, 10, 19: odd audio inputs -------------------------------------------------------------


def test_channel_layouts_by_shape(tiny):
    from mlx_voicechat.runtime.audio import load_audio

    tone = _wave(1.0)
    many = np.stack([tone] * 16)  # [16, N]: more channels than any layout allows
    with pytest.raises(VoiceChatError, match="ambiguous: time must be axis 0"):
        load_audio(many)
    with pytest.raises(VoiceChatError, match="ambiguous"):
        tiny.generate(many, extra_decoding_seconds=0.0)
    np.testing.assert_allclose(load_audio(np.stack([tone] * 3)), tone, atol=1e-6)  # [3, N]
    np.testing.assert_allclose(load_audio(np.stack([tone] * 3, axis=1)), tone, atol=1e-6)
    np.testing.assert_allclose(load_audio(tone[None]), tone)  # [1, N]
    np.testing.assert_allclose(load_audio(tone[:, None]), tone)  # [N, 1]
    with pytest.raises(VoiceChatError, match="ambiguous"):
        load_audio(np.ones((4, 6), np.float32))  # 4 samples of 6 channels, or 6 of 4?


def test_many_channel_file_is_mixed(tmp_path):
    from mlx_voicechat.runtime.audio import load_audio

    tone = _wave(0.5)
    sf.write(tmp_path / "m.wav", np.stack([tone] * 12, axis=1), 16000, subtype="FLOAT")
    np.testing.assert_allclose(load_audio(tmp_path / "m.wav"), tone, atol=1e-6)
    # A file's layout is never guessed: one frame of two channels is one sample.
    sf.write(tmp_path / "one.wav", np.array([[0.5, 0.25]], np.float32), 16000, subtype="FLOAT")
    np.testing.assert_allclose(load_audio(tmp_path / "one.wav"), [0.375])


def test_truncated_wav_warns_with_its_name(ckpt, tmp_path, capsys):
    from mlx_voicechat.runtime.audio import AudioWarning, load_audio

    full = tmp_path / "full.wav"
    sf.write(full, _wave(1.0), 16000, subtype="PCM_16")
    cut = tmp_path / "cut.wav"
    cut.write_bytes(full.read_bytes()[:20000])
    with pytest.warns(AudioWarning, match=f"audio file {cut} is truncated"):
        assert len(load_audio(cut)) == 9978
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_audio(full)  # an intact file: no warning
    rc, _, err = _cli(["transcribe", "--model", ckpt, "--audio", cut], capsys)
    assert rc == 0, err
    assert f"mlx-voicechat transcribe: warning: audio file {cut} is truncated" in err


def test_unreadable_audio_file(ckpt, question, tmp_path):
    audio = tmp_path / "q.wav"
    shutil.copy(question, audio)
    audio.chmod(0)
    rc, _, err = _unprivileged_cli(["transcribe", "--model", ckpt, "--audio", audio], audio)
    _one_line_error(rc, err, f"cannot read audio file {audio}: Permission denied")


def test_none_bytes_and_file_objects(tiny, question):
    with pytest.raises(VoiceChatError, match="no audio given"):
        tiny.generate(None)
    want = tiny.transcribe(str(question)).tokens
    assert tiny.transcribe(os.fsencode(str(question))).tokens == want
    with open(question, "rb") as f:
        assert tiny.transcribe(f).tokens == want
    with pytest.raises(VoiceChatError, match="a file path or an array .* got dict"):
        tiny.transcribe({"a": 1})


def test_info_on_quantized_weights_without_a_quantization_config(tmp_path, capsys):
    folder = make_checkpoint(tmp_path / "q", "tiny", quantize=4)
    _edit_config(folder, lambda c: [c.pop("quantization"), c.pop("quantization_config")])
    rc, out, err = _cli(["info", folder], capsys)
    assert rc == 0, err
    assert "None" not in out
    assert "4-bit, group 64, 15 modules (inferred from the weights" in out
    with pytest.raises(VoiceChatError, match="quantized but config.json has no quantization"):
        load(folder)


# --- 9, 15: group sizes ---------------------------------------------------------------------


@pytest.mark.parametrize("size", ["7", "0", "-64"])
def test_make_checkpoint_bad_group_size(size, tmp_path, capsys):
    args = ["make-checkpoint", tmp_path / "ck", "--quantize", "4", "--group-size", size]
    _one_line_error(*_cli(args, capsys)[::2], f"group size must be 32, 64 or 128, not {size}")
    assert list(tmp_path.iterdir()) == []


def test_convert_bad_group_size(ckpt, tmp_path, capsys):
    args = ["convert", "--source", ckpt, "--output", tmp_path / "o", "--quantize", "4",
            "--group-size", "0", "--quiet"]
    _one_line_error(*_cli(args, capsys)[::2], "--group-size must be 32, 64 or 128, not 0")


def test_config_group_size_mlx_cannot_use(tmp_path):
    folder = make_checkpoint(tmp_path / "q", "tiny", quantize=4)
    _edit_config(folder, lambda c: c["quantization"].update(group_size=7))
    with pytest.raises(VoiceChatError, match="group_size must be 32, 64 or 128, not 7"):
        load(folder)


# --- 14: config.json and tokenizer oddities ---------------------------------------------------


def test_config_json_that_is_a_list(ckpt, copy_of, capsys):
    folder = copy_of(ckpt)
    (folder / "config.json").write_text("[1, 2]")
    rc, _, err = _cli(["info", folder], capsys)
    _one_line_error(rc, err, "holds a JSON list; a checkpoint config is a JSON object")
    with pytest.raises(VoiceChatError, match="holds a JSON list"):
        load(folder)


def test_unreadable_config_json(ckpt, copy_of):
    folder = copy_of(ckpt)
    (folder / "config.json").chmod(0)
    rc, _, err = _unprivileged_cli(["info", folder], folder / "config.json")
    line = _one_line_error(rc, err, f"cannot read {folder / 'config.json'}: Permission denied")
    assert "JSON" not in line


def test_missing_tokenizer_folder(ckpt, question, tmp_path, capsys):
    missing = tmp_path / "no-tokenizer"
    args = _generate_args(ckpt, question, tmp_path / "r.wav", "--tokenizer", missing)
    _one_line_error(*_cli(args, capsys)[::2], f"tokenizer folder {missing} does not exist")
    with pytest.raises(VoiceChatError, match="^tokenizer folder .* does not exist$"):
        load(ckpt, tokenizer=str(missing))


# --- 17, 18: the ecosystem entry points ------------------------------------------------------


def test_mlx_lm_load(ckpt):
    # In a child whose start-up hook is this checkout's (an installed copy may be older).
    code = """
        import sys
        import numpy as np
        import mlx_lm
        from mlx_voicechat import load

        model, tokenizer = mlx_lm.load(sys.argv[1])
        wave = (0.1 * np.random.default_rng(0).standard_normal(12000)).astype(np.float32)
        kw = dict(system_prompt="Be brief.", extra_decoding_seconds=0.0, seed=1)
        got, want = model.generate(wave, **kw), load(sys.argv[1]).generate(wave, **kw)
        print("SAME", bool((got.codes == want.codes).all()), got.text == want.text,
              got.user_transcript == want.user_transcript)
        try:
            mlx_lm.load(sys.argv[2])
        except ValueError as e:
            print("NVIDIA", e)
    """
    r = _child(code, ckpt, NVIDIA)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "SAME True True True" in r.stdout
    (line,) = [ln for ln in r.stdout.splitlines() if ln.startswith("NVIDIA ")]
    assert "is NVIDIA's raw NemotronLabs VoiceChat release" in line
    assert "mlx_voicechat.load" in line and "mlx-voicechat convert" in line


def test_model_without_tokenizer_says_what_to_call(tiny):
    from mlx_voicechat.nemotron_voicechat import Model

    bare = Model(tiny.config)
    with pytest.raises(VoiceChatError, match=r"call model\.setup_tokenizer\(tokenizer\)"):
        bare.generate(_wave())


def test_mlx_audio_sts_generate_generic_flags(ckpt, question, tmp_path, capsys):
    from mlx_audio.sts.generate import main as sts_main

    out = tmp_path / "r.wav"
    with pytest.warns(UserWarning, match="ignores temperature, top_p"):
        sts_main(["--model", str(ckpt), "--audio", str(question), "--output-path", str(out),
                  "--sample-rate", "16000", "--temperature", "0.7", "--top-p", "0.9"])
    assert sf.info(str(out)).samplerate == 22050
    with pytest.raises(VoiceChatError, match="does not know: text"):
        sts_main(["--model", str(ckpt), "--audio", str(question), "--output-path", str(out),
                  "--text", "hello"])

def test_sample_rate_is_the_array_rate(tiny, question):
    wave = _wave(0.6)
    a = tiny.generate(wave[::2], sample_rate=8000, extra_decoding_seconds=0.0)
    b = tiny.generate(wave[::2], source_rate=8000, extra_decoding_seconds=0.0)
    np.testing.assert_array_equal(a.codes, b.codes)
    with pytest.raises(VoiceChatError, match="is at 16000 Hz, not the 8000 Hz given"):
        tiny.generate(str(question), sample_rate=8000)


# --- also: progress over the system prompt ---------------------------------------------------


def test_progress_for_the_prompt_phase(tiny):
    calls = []
    ids = [1] + [45] * 12 + [2]
    r = tiny.generate(_wave(), prompt=ids, extra_decoding_seconds=0.0,
                      prompt_progress=lambda d, t: calls.append((d, t)))
    # Each step the seed's prompt chain still had to run, then the end (the steps themselves
    # run once per seed: tests/test_promptchain.py).
    total = len(ids) - 1
    assert calls[-1] == (total, total) and all(t == total for _, t in calls)
    assert [d for d, _ in calls] == sorted(d for d, _ in calls)
    assert r.frames > 0
