"""`mlx-voicechat stream`, `chat` (driven by arrays), `--plot`, and their bad inputs."""

import importlib.util
import re
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import soundfile as sf

from mlx_voicechat import load
from mlx_voicechat.audio import devices
from mlx_voicechat.audio.devices import ArraySink, ArraySource, DeviceError
from mlx_voicechat.cli import main
from mlx_voicechat.cli.chat import chat_loop
from mlx_voicechat.cli.stream import WordPrinter, stream_samples

SPF = 1764
EXTRA = "0.3"
HAVE_MPL = importlib.util.find_spec("matplotlib") is not None


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from mlx_voicechat.factory import make_checkpoint

    return make_checkpoint(
        tmp_path_factory.mktemp("ckpt") / "tiny", "tiny", "mlx-community", seed=0
    )


@pytest.fixture(scope="module")
def tiny(ckpt):
    return load(ckpt)


@pytest.fixture(scope="module")
def wave():
    rng = np.random.default_rng(0)
    t = np.arange(8000) / 16000
    return (0.2 * np.sin(2 * np.pi * 220 * t) + 0.05 * rng.standard_normal(8000)).astype(np.float32)


@pytest.fixture(scope="module")
def question(tmp_path_factory, wave):
    path = tmp_path_factory.mktemp("q") / "question.wav"
    sf.write(path, wave, 16000)
    return path


@pytest.fixture(scope="module")
def offline(tiny, wave):
    return tiny.generate(wave, system_prompt="Be brief.", extra_decoding_seconds=float(EXTRA))


def _argv(verb, ckpt, question, *extra):
    return [
        verb,
        "--model",
        str(ckpt),
        "--audio",
        str(question),
        "-p",
        "Be brief.",
        "--extra-decoding-seconds",
        EXTRA,
        *extra,
    ]


def _stream_argv(ckpt, question, *extra):
    return _argv("stream", ckpt, question, *extra)


def _one_error_line(err, *words):
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "error:" in lines[0] and "Traceback" not in err
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]


# --- stream --------------------------------------------------------------------------------


def test_stream_prints_words_latency_rtf_and_writes_generates_wav(
    ckpt, question, offline, tmp_path, capsys
):
    out, ref = tmp_path / "reply.wav", tmp_path / "generate.wav"
    assert main(_stream_argv(ckpt, question, "--output-audio", str(out))) == 0
    printed = capsys.readouterr().out
    assert "[user] " in printed and "[assistant] " in printed
    m = re.search(
        r"latency per frame .*: p50 ([\d.]+) ms, p95 ([\d.]+) ms, max [\d.]+ ms over "
        r"(\d+) frames",
        printed,
    )
    assert m and 0 < float(m.group(1)) <= float(m.group(2)) and int(m.group(3)) == offline.frames
    assert re.search(r"^RTF [\d.]+ \([\d.]+ s of compute for 0\.80 s of audio\)$", printed, re.M)
    assert "1280 k + 199 samples are in, 1081 samples (67.6 ms)" in printed
    # The streamed reply is generate's, sample for sample.
    assert main(_argv("generate", ckpt, question, "--output-audio", str(ref), "--quiet")) == 0
    a, rate = sf.read(out, dtype="int16")
    b, _ = sf.read(ref, dtype="int16")
    assert rate == 22050 and len(a) == offline.frames * SPF and np.array_equal(a, b)


def test_stream_latency_is_zero_when_each_frame_leaves_with_its_last_sample(tiny, wave, offline):
    """On a clock that moves only while waiting, every frame's event comes back from the call
    that fed its last needed sample, and the pacing sleeps exactly the audio's length."""
    now = [0.0]

    def sleep(s):
        now[0] += s

    session = tiny.session("Be brief.")
    run = stream_samples(
        session, wave, float(EXTRA), realtime=True, clock=lambda: now[0], sleep=sleep
    )
    assert len(run.events) == offline.frames == len(run.latencies)
    assert run.latencies == [0.0] * offline.frames
    assert now[0] == pytest.approx(len(run.samples) / 16000)
    assert np.max(np.abs(run.reply_audio(SPF) - offline.audio)) <= 1e-6
    # One more sample per frame would be needed if frames waited for their whole slot.
    feeds = [c for c in run.calls[:-1] if c[2]]
    assert feeds and all(n == 1 for *_, n in feeds)


def test_word_printer_one_line_per_run_of_a_channel():
    out = SimpleNamespace(parts=[], write=lambda s: out.parts.append(s), flush=lambda: None)
    ev = lambda tr="", tx="", fn="": SimpleNamespace(transcript=tr, text=tx, function_text=fn)  # noqa: E731
    p = WordPrinter(out)
    p([ev(tr="what"), ev(tr=" time"), ev(tx=" It", tr=" is"), ev(tx="'s \x1b[2J"), ev(fn="x")])
    p.end()
    assert "".join(out.parts) == ("[user] what time is\n[assistant] It's \ufffd[2J\n[function] x\n")
    from mlx_voicechat.nemotron_voicechat.runtime.tools import ToolCall

    out.parts.clear()
    call = SimpleNamespace(transcript="", text="", function_text="", errors=["bad JSON"],
                           tool_calls=[ToolCall("call_1", "get_weather", '{"city":"Paris"}')])
    p([call])
    p.end()
    assert "".join(out.parts) == (
        '[tool call] get_weather({"city":"Paris"}) id=call_1\n[tool call error] bad JSON\n'
    )


def test_stream_bad_inputs_one_line_exit_2(ckpt, question, tmp_path, capsys):
    missing = tmp_path / "nope.wav"
    assert main(_stream_argv(ckpt, missing)) == 2
    _one_error_line(capsys.readouterr().err, "nope.wav")
    assert main(_stream_argv(ckpt, question, "--output-audio", str(tmp_path / "no" / "r.wav"))) == 2
    _one_error_line(capsys.readouterr().err, "does not exist")
    locked = tmp_path / "locked.wav"
    locked.write_bytes(b"keep me")
    locked.chmod(0o444)
    assert main(_stream_argv(ckpt, question, "--output-audio", str(locked))) == 2
    _one_error_line(capsys.readouterr().err, "read-only")
    assert locked.read_bytes() == b"keep me"
    assert main(_stream_argv(ckpt, question, "--output-audio", str(question))) == 2
    _one_error_line(capsys.readouterr().err, "input audio")
    assert main(_stream_argv(ckpt, question, "--plot", str(tmp_path))) == 2
    _one_error_line(capsys.readouterr().err, "folder")
    assert main(_stream_argv(ckpt, question)[:-2] + ["--extra-decoding-seconds", "-1"]) == 2
    _one_error_line(capsys.readouterr().err, "extra_decoding_seconds")


# --- chat, driven by arrays ---------------------------------------------------------------


def test_chat_loop_on_arrays_plays_what_generate_says(tiny, wave, offline):
    session = tiny.session("Be brief.")
    sink = ArraySink(22050)
    seen = []
    frames = chat_loop(
        session,
        ArraySource(wave, 16000),
        sink,
        on_events=seen.extend,
        extra_decoding_seconds=float(EXTRA),
    )
    assert frames == offline.frames == len(seen)
    audio = sink.audio
    assert audio.shape == (offline.frames * SPF + 6,)  # the codec's fixed delay
    assert np.max(np.abs(audio[6:] - offline.audio)) <= 1e-6
    assert [e.text_id for e in seen] == offline.text_ids
    assert "".join(e.text for e in seen) == offline.text
    assert "".join(e.transcript for e in seen) == offline.user_transcript
    # A microphone at its own rate: the session resamples; the clock still runs in frames.
    session.reset()
    sink = ArraySink(22050)
    x48 = np.repeat(wave[:4000], 3)
    assert chat_loop(session, ArraySource(x48, 48000), sink) == 4  # as generate on 4000 samples
    assert len(sink.audio) == session.frames * SPF + 6
    with pytest.raises(DeviceError, match="22050"):
        chat_loop(session, ArraySource(wave, 16000), ArraySink(44100))


class _Interrupting(ArraySource):
    """A microphone the user stops with Ctrl-C after ``n`` blocks."""

    def __init__(self, samples, n):
        super().__init__(samples, 16000)
        self.n, self.closed = n, False

    def read(self, k):
        if self.n == 0:
            raise KeyboardInterrupt
        self.n -= 1
        return super().read(k)

    def close(self):
        self.closed = True


def test_chat_cli_on_array_devices_and_ctrl_c(ckpt, wave, monkeypatch, capsys):
    made = {}
    monkeypatch.setattr(devices, "check", lambda *a: None)

    def mic(device, rate):
        made["mic"] = _Interrupting(np.concatenate([wave, np.zeros(8000, np.float32)]), 12)
        return made["mic"]

    def speaker(device, rate):
        made["speaker"] = ArraySink(rate)
        return made["speaker"]

    monkeypatch.setattr(devices, "open_microphone", mic)
    monkeypatch.setattr(devices, "open_speaker", speaker)
    assert main(["chat", "--model", str(ckpt), "-p", "Be brief."]) == 0
    captured = capsys.readouterr()
    assert "[user] " in captured.out or "[assistant] " in captured.out
    assert re.search(r"ended after (\d+) frames", captured.err)
    frames = int(re.search(r"ended after (\d+) frames", captured.err).group(1))
    assert frames == 12  # 12 blocks of 1280 make frames 0..11 final (frame k: 1280 k + 199)
    assert made["mic"].closed and made["speaker"].closed
    assert len(made["speaker"].audio) == frames * SPF


def test_chat_without_sounddevice_portaudio_or_device(ckpt, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "sounddevice", None)
    assert main(["chat", "--model", str(ckpt)]) == 2
    _one_error_line(capsys.readouterr().err, "sounddevice", "[mic]")

    class NoPortAudio:
        def find_spec(self, name, path=None, target=None):
            if name == "sounddevice":
                raise OSError("PortAudio library not found")

    monkeypatch.delitem(sys.modules, "sounddevice")
    monkeypatch.setattr(sys, "meta_path", [NoPortAudio()] + sys.meta_path)
    assert main(["chat", "--model", str(ckpt)]) == 2
    _one_error_line(capsys.readouterr().err, "PortAudio", "libportaudio2")


def test_chat_without_a_microphone(ckpt, capsys):
    try:
        import sounddevice as sd
    except (ImportError, OSError):
        pytest.skip("python-sounddevice / PortAudio not installed")
    try:
        sd.query_devices(kind="input")
        pytest.skip("this machine has a microphone")
    except (ValueError, sd.PortAudioError):
        pass
    assert main(["chat", "--model", str(ckpt)]) == 2
    _one_error_line(capsys.readouterr().err, "no microphone")


# --- the timeline picture -------------------------------------------------------------------


@pytest.mark.skipif(not HAVE_MPL, reason="matplotlib not installed")
def test_plot_on_stream_and_generate(ckpt, question, tmp_path, capsys):
    from matplotlib.image import imread

    for verb, argv in (
        ("stream", _stream_argv(ckpt, question)),
        (
            "generate",
            [
                "generate",
                "--model",
                str(ckpt),
                "--audio",
                str(question),
                "--quiet",
                "--extra-decoding-seconds",
                EXTRA,
                "--output-audio",
                str(tmp_path / "g.wav"),
            ],
        ),
    ):
        png = tmp_path / f"{verb}.png"
        assert main(argv + ["--plot", str(png)]) == 0
        img = imread(png)
        assert img.shape[0] > 400 and img.shape[1] > 1000
        # Not a blank canvas: waveforms and words leave ink in every band of the picture.
        ink = (img[..., :3].mean(axis=2) < 0.9).mean(axis=1)
        assert (ink[int(0.15 * len(ink)) : int(0.85 * len(ink))] > 0).mean() > 0.5
    capsys.readouterr()


def test_plot_words_join_deltas_at_their_first_frame():
    from mlx_voicechat.nemotron_voicechat.runtime.plot import words

    assert words([(0, "Hel"), (1, "lo"), (2, " the"), (3, "re, you"), (5, " \x07!")]) == [
        (0, "Hello"),
        (2, "there,"),
        (3, "you"),
        (5, "\ufffd!"),
    ]
    assert words([(i, "ab") for i in range(10)])[0] == (0, "ab" * 8)


def test_plot_without_matplotlib_fails_before_the_work(
    ckpt, question, tmp_path, monkeypatch, capsys
):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    out = tmp_path / "r.wav"
    assert (
        main(
            _stream_argv(
                ckpt, question, "--output-audio", str(out), "--plot", str(tmp_path / "t.png")
            )
        )
        == 2
    )
    _one_error_line(capsys.readouterr().err, "matplotlib", "[plot]")
    assert not out.exists()


def test_speaker_queue_plays_in_order_and_silence_when_empty():
    from mlx_voicechat.audio.devices import PlayQueue

    q = PlayQueue()
    q.push(np.arange(1, 4, dtype=np.float32))
    q.push(np.array([[4.0, 5.0]]))
    out = np.full(4, -1.0, np.float32)
    q.fill(out)
    assert out.tolist() == [1, 2, 3, 4] and len(q) == 1
    out = np.full(3, -1.0, np.float32)
    q.fill(out)
    assert out.tolist() == [5, 0, 0] and len(q) == 0 and q.underruns == 1
    q.fill(out)
    assert out.tolist() == [0, 0, 0] and q.underruns == 1


def test_a_device_stream_that_does_not_start_is_closed(monkeypatch):
    """PortAudio opened the stream and could not start it: one DeviceError, and the stream
    closed (not left holding the device)."""
    streams = []

    class PortAudioError(Exception):
        pass

    class Stream:
        def __init__(self, **kw):
            self.closed = False
            streams.append(self)

        def start(self):
            raise PortAudioError("Device unavailable")

        def close(self):
            self.closed = True

    sd = SimpleNamespace(
        PortAudioError=PortAudioError,
        query_devices=lambda device, kind: {
            "name": "fake", f"max_{kind}_channels": 1, "default_samplerate": 48000.0
        },
        check_input_settings=lambda **kw: None,
        InputStream=Stream,
        OutputStream=Stream,
    )
    monkeypatch.setitem(sys.modules, "sounddevice", sd)
    with pytest.raises(DeviceError, match="cannot start microphone 'fake' at 16000 Hz: Device"):
        devices.open_microphone()
    with pytest.raises(DeviceError, match="cannot start speaker 'fake' at 22050 Hz: Device"):
        devices.open_speaker(None, 22050)
    assert [s.closed for s in streams] == [True, True]
