"""Data safety (issue 11), interruptions: SIGTERM / SIGHUP clean up like Ctrl-C, Ctrl-C at any
moment (the heavy imports too) is one line, and generation from other threads works and exits
cleanly. Through the CLI in child interpreters (tests/support/safety_support.py)."""

import threading

import numpy as np
from safety_support import (  # noqa: F401  (fixtures)
    _child,
    _generate_args,
    _wave,
    ckpt,
    copy_of,
    tiny,
)

from mlx_voicechat import load

# --- 3: SIGTERM / SIGHUP clean up like Ctrl-C ------------------------------------------------

_SIGNAL_DURING = """
    import os, signal, sys
    import mlx_voicechat.nemotron_voicechat.weights.writer as writer
    from mlx_voicechat.cli import main

    name = sys.argv[1]
    real = writer.write_tensor

    def write_then_signal(f, spec, array):
        real(f, spec, array)
        os.kill(os.getpid(), getattr(signal, name))  # as if sent from outside, mid-shard

    writer.write_tensor = write_then_signal
    # The signal's default action, as in a terminal: a suite started under nohup would pass on
    # SIGHUP's ignore, which the CLI rightly keeps.
    signal.signal(getattr(signal, name), signal.SIG_DFL)
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
        import mlx_voicechat.nemotron_voicechat.runtime.step as frame_step
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
