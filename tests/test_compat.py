"""mlx-audio 0.6.2's NemotronVoiceChat API on our model (issue 17), and NVIDIA's default
system prompt.

A script written only against mlx-audio's surface runs through ``mlx_audio.sts.load_model``
with our plugin and with ``MLX_VOICECHAT_OVERRIDE=0`` (mlx-audio's own module): every call
works in both and gives the same kinds of results; ours equals our own ``Session``."""

import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlx_voicechat import load
from mlx_voicechat.errors import GenerationError, VoiceChatError
from mlx_voicechat.nemotron_voicechat.runtime import compat
from mlx_voicechat.nemotron_voicechat.runtime.request import (
    DEFAULT_SYSTEM_PROMPT,
    prompt_ids,
    resolve_system_prompt,
)

ROOT = Path(__file__).resolve().parents[1]

# Written only against mlx-audio 0.6.2's nemotron_voicechat (its Model, VoiceChatSession,
# VoiceChatStreamingSession, VoiceChatEvent, VoiceChatOutput, VoiceChatContextLimitError).
SCRIPT = r'''
import json, sys
import numpy as np
import mlx.core as mx
from mlx_audio.sts import load_model
from mlx_audio.sts.models.nemotron_voicechat import VoiceChatContextLimitError, VoiceChatEvent

path, out = sys.argv[1], sys.argv[2]
model = load_model(path)
x = (0.1 * np.random.default_rng(0).standard_normal(12000)).astype(np.float32)
RESULT = ("text", "audio", "text_tokens", "audio_tokens", "function_tokens", "audio_codes",
          "sample_rate", "user_transcript")
EVENT = ("frame_index", "token_id", "delta", "text", "samples", "sample_rate", "audio_codes")


def kind(v, field=None):
    if field == "audio" and isinstance(v, (mx.array, np.ndarray)):
        # ours keeps the waveform a numpy array (mx.array(r.audio) makes it an mx.array)
        return ["waveform", v.ndim, str(v.dtype).replace("mlx.core.", "")]
    if isinstance(v, mx.array):
        return ["mx.array", v.ndim, str(v.dtype)]
    return [type(v).__name__]


summary = {"module": type(model).__module__}
r = model.generate(mx.array(x), system_prompt="Hi.", verbose=True, max_frames=5, seed=0,
                   use_language_cache=True)
summary["generate"] = {f: kind(getattr(r, f), f) for f in RESULT}
summary["generate_frames"] = [r.text_tokens.shape[0], r.audio_tokens.shape[0],
                              r.function_tokens.shape[0], r.audio.shape[0] // 1764]
session = model.create_session()
r2 = session.generate(mx.array(x), system_prompt="Hi.", max_frames=20,
                      extra_decoding_seconds=0.0, seed=0, use_language_cache=False)
summary["session_generate"] = {f: kind(getattr(r2, f), f) for f in RESULT}
summary["session_frames"] = int(r2.text_tokens.shape[0])

duplex = model.create_duplex_session(system_prompt="Hi.", seed=0)
events = []
for i in range(0, len(x), 1000):
    events += duplex.push_audio(x[i : i + 1000], sample_rate=16000)
events += duplex.flush()
assert all(isinstance(e, VoiceChatEvent) for e in events)
first = {}
for e in events:
    first.setdefault(e.kind, e)
summary["kinds"] = sorted(first)
summary["fields"] = {k: {f: kind(getattr(e, f)) for f in EVENT} for k, e in first.items()}
summary["last"] = events[-1].kind
summary["closed"] = duplex.closed
summary["again"] = [len(duplex.flush()), len(duplex.cancel())]
try:
    duplex.push_audio(x[:100])
    summary["push_after_flush"] = "accepted"
except RuntimeError:
    summary["push_after_flush"] = "RuntimeError"
audio = [e for e in events if e.kind == "audio"]
summary["audio_sizes"] = sorted({int(e.samples.shape[0]) for e in audio})
summary["audio_frames"] = [e.frame_index for e in audio] == list(range(len(audio)))
text = [e for e in events if e.kind == "assistant_text_delta"]
summary["text_joined"] = "".join(e.delta for e in text) == (text[-1].text if text else "")

limited = session.create_streaming_session(system_prompt="", seed=1, max_streaming_seconds=0.4,
                                           use_language_cache=True, use_perception_cache=True)
n_audio, raised = 0, False
for i in range(20):
    try:
        n_audio += sum(e.kind == "audio" for e in limited.push_audio(x[1280 * i : 1280 * (i + 1)]))
    except VoiceChatContextLimitError:
        raised = True
        break
summary["limit"] = [n_audio, raised]
cancelled = session.create_streaming_session(system_prompt="Hi.", seed=2)
cancelled.push_audio(x[:3000])
summary["cancel"] = [e.kind for e in cancelled.cancel()] + [cancelled.closed]

np.savez(
    out,
    audio=np.concatenate([np.array(e.samples) for e in audio]),
    codes=np.stack([np.array(e.audio_codes) for e in audio]),
    text_ids=np.array([e.token_id for e in text], dtype=np.int64),
    function_ids=np.array([e.token_id for e in events if e.kind == "function_delta"],
                          dtype=np.int64),
    transcript="".join(e.delta for e in events if e.kind == "user_transcript_delta"),
    text="".join(e.delta for e in text),
)
print("SUMMARY " + json.dumps(summary))
'''


def _mlx_audio_view(src: Path, dst: Path) -> Path:
    """mlx-audio's own loader on a factory checkpoint: it looks the LLM config and tokenizer up
    by ``pretrained_llm`` (a hub id; offline here), so point that at a local folder, and it
    wants ``att_context_size`` one list shallower than NeMo writes it."""
    dst.mkdir()
    cfg = json.loads((src / "config.json").read_text())
    for f in src.iterdir():
        if f.name != "config.json":
            os.symlink(f.resolve(), dst / f.name)
    llm = dst / "llm"
    llm.mkdir()
    (llm / "config.json").write_text(json.dumps(cfg["text_config"]))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        os.symlink((src / name).resolve(), llm / name)
    stt = cfg["model"]["stt"]["model"]
    stt["pretrained_llm"] = str(llm)
    enc = stt["perception"]["encoder"]
    if enc["att_context_size"] and isinstance(enc["att_context_size"][0], list):
        enc["att_context_size"] = enc["att_context_size"][0]
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _run_script(path, out, override=True):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLX_VOICECHAT")}
    env["PYTHONPATH"] = str(ROOT)
    env["HF_HUB_OFFLINE"] = "1"
    if not override:
        env["MLX_VOICECHAT_OVERRIDE"] = "0"
    r = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(path), str(out)],
        capture_output=True, text=True, env=env, cwd="/", timeout=300,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("SUMMARY ")][-1]
    return json.loads(line[len("SUMMARY "):]), r.stdout


def _wave():
    return (0.1 * np.random.default_rng(0).standard_normal(12000)).astype(np.float32)


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoints):
    return Path(tiny_checkpoints["mlx-audio"])


@pytest.fixture(scope="module")
def tiny(ckpt):
    return load(ckpt)


@pytest.fixture(scope="module")
def ours(ckpt, tmp_path_factory):
    out = tmp_path_factory.mktemp("compat") / "ours.npz"
    summary, stdout = _run_script(ckpt, out)
    return summary, stdout, dict(np.load(out))


def test_script_runs_on_ours_and_equals_our_session(ours, tiny):
    summary, stdout, got = ours
    assert summary["module"] == "mlx_voicechat.nemotron_voicechat"
    # The script's events are our Session on the same input, chunked the same way.
    x = _wave()
    session = tiny.session("Hi.", seed=0)
    frames = []
    for i in range(0, len(x), 1000):
        frames += session.feed(x[i : i + 1000], sample_rate=16000)
    frames += session.finish(0.0)
    cfg = tiny.config
    special = {cfg.pad_token_id, cfg.silence_token_id, cfg.bos_token_id, cfg.eos_token_id}
    assert got["codes"].shape == (len(frames), cfg.tts_config.num_quantizers)
    assert np.array_equal(got["codes"], np.stack([f.codes for f in frames]))
    # one frame of samples per audio event: the codec's tail is not on the last one
    assert np.array_equal(got["audio"], np.concatenate([f.audio[:1764] for f in frames]))
    assert got["text_ids"].tolist() == [f.text_id for f in frames if f.text_id not in special]
    assert got["function_ids"].tolist() == [
        f.function_id for f in frames if f.function_id not in special
    ]
    assert str(got["text"]) == "".join(f.text for f in frames)
    assert str(got["transcript"]) == "".join(f.transcript for f in frames)
    # The same frames as offline generation on those samples.
    off = tiny.generate(x, system_prompt="Hi.", extra_decoding_seconds=0.0, seed=0)
    assert np.array_equal(got["codes"], off.codes)
    # verbose=True printed the reply text of the first generate.
    r = tiny.generate(mx.array(x), system_prompt="Hi.", max_frames=5, seed=0)
    assert stdout.splitlines()[0] == r.text
    assert summary["generate_frames"] == [5, 5, 5, 5]
    assert summary["session_frames"] == off.frames == 11  # 0.75 s, no trailing silence
    assert summary["limit"] == [5, True]  # 0.4 s = 5 frames, then the limit error
    assert summary["cancel"] == ["cancelled", True]
    assert summary["last"] == "done" and summary["closed"] and summary["again"] == [0, 0]
    assert summary["push_after_flush"] == "RuntimeError"
    assert summary["audio_frames"] and summary["text_joined"]


def test_mlx_audio_module_gives_the_same_kinds_of_results(ours, ckpt, tmp_path):
    theirs, _ = _run_script(_mlx_audio_view(ckpt, tmp_path / "view"), tmp_path / "t.npz", False)
    mine = ours[0]
    assert theirs["module"].startswith("mlx_audio.sts.models.nemotron_voicechat")
    for key in ("kinds", "generate", "session_generate", "fields", "last", "closed", "again",
                "push_after_flush", "audio_frames", "text_joined", "limit", "cancel",
                "generate_frames", "session_frames", "audio_sizes"):
        assert mine[key] == theirs[key], key
    assert mine["audio_sizes"] == [1764]  # every audio event, the last one too
    # The tiny reply has text, function ids and a transcript: every kind but "cancelled"
    # (which the script checks separately).
    assert set(mine["kinds"]) == set(compat.EVENT_KINDS) - {"cancelled"}


def test_result_aliases_are_arrays_over_the_stored_fields(tiny):
    r = tiny.generate(_wave(), system_prompt="", extra_decoding_seconds=0.0, seed=1)
    assert isinstance(r.text_tokens, mx.array) and r.text_tokens.dtype == mx.int32
    assert r.text_tokens.tolist() == r.text_ids
    assert r.function_tokens.tolist() == r.function_ids
    assert r.audio_tokens.dtype == mx.int32 and np.array_equal(np.array(r.audio_tokens), r.codes)
    assert r.audio_codes is r.audio_tokens and r.text_tokens is r.text_tokens  # converted once
    assert isinstance(r, compat.VoiceChatOutput)


def test_generate_keywords(tiny, capsys):
    x = _wave()
    full = tiny.generate(x, system_prompt="", extra_decoding_seconds=0.5, seed=2)
    capsys.readouterr()
    cut = tiny.generate(x, system_prompt="", extra_decoding_seconds=0.5, seed=2, max_frames=7,
                        verbose=True, use_language_cache=False)
    assert capsys.readouterr().out == cut.text + "\n"
    assert cut.frames == 7 and cut.text_ids == full.text_ids[:7]
    assert np.array_equal(cut.codes, full.codes[:7])
    # A long input with a small max_frames: cut before the encoder, same first frames.
    long = np.tile(x, 4)
    a = tiny.generate(long, system_prompt="", extra_decoding_seconds=0.0, seed=2, max_frames=3)
    b = tiny.generate(long, system_prompt="", extra_decoding_seconds=0.0, seed=2)
    assert a.text_ids == b.text_ids[:3] and np.array_equal(a.codes, b.codes[:3])
    with pytest.raises(GenerationError, match="max_frames must be an integer >= 1"):
        tiny.generate(x, system_prompt="", max_frames=0)
    with pytest.raises(GenerationError, match="verbose must be True or False"):
        tiny.generate(x, system_prompt="", verbose="yes")
    with pytest.raises(GenerationError, match="does not know: use_cache"):
        tiny.generate(x, system_prompt="", use_cache=True)
    # create_session().generate has mlx-audio's defaults: no trailing silence.
    s = tiny.create_session().generate(x, system_prompt="", seed=2)
    off = tiny.generate(x, system_prompt="", extra_decoding_seconds=0.0, seed=2)
    assert s.text_ids == off.text_ids and np.array_equal(s.codes, off.codes)


def test_streaming_session_errors_and_rates(tiny):
    with pytest.raises(VoiceChatError, match="does not know: language"):
        tiny.create_duplex_session(system_prompt="", language="en")
    with pytest.raises(VoiceChatError, match="use_perception_cache must be True or False"):
        tiny.create_duplex_session(system_prompt="", use_perception_cache=None)
    s = tiny.create_duplex_session(system_prompt="", seed=0)
    with pytest.raises(VoiceChatError, match="pad_partial=False is not supported"):
        s.flush(pad_partial=False)
    # Another rate is resampled (mlx-audio refuses it), int16 is scaled: same as our Session.
    x24 = (0.1 * np.random.default_rng(3).standard_normal(18000) * 32767).astype(np.int16)
    events = s.push_audio(x24, sample_rate=24000) + s.flush()
    ref = tiny.session("", seed=0)
    frames = ref.feed(x24, sample_rate=24000) + ref.finish(0.0)
    audio = [e for e in events if e.kind == "audio"]
    assert np.array_equal(np.stack([np.array(e.audio_codes) for e in audio]),
                          np.stack([f.codes for f in frames]))
    assert all(e.samples.shape == (1764,) for e in audio)
    assert s.tail.shape == (6,)  # the codec's tail, on no audio event
    assert s.closed
    with pytest.raises(compat.VoiceChatClosedError, match="closed"):
        s.push_audio(x24)


def test_audio_events_are_one_frame_each_and_the_tail_is_kept(tiny):
    x = _wave()
    # 1280 k + 199 samples: the end of input makes no new frame (our Session hands out a
    # remainder event that carries only the tail); 9000: the last frame carries it.
    for n in (1280 * 3 + 199, 9000):
        duplex = tiny.create_duplex_session(system_prompt="", seed=0)
        events = duplex.push_audio(x[:n])
        assert duplex.tail.shape == (0,)
        events += duplex.flush()
        ref = tiny.session("", seed=0)
        frames = ref.feed(x[:n]) + ref.finish(0.0)
        audio = [e for e in events if e.kind == "audio"]
        assert [e.samples.shape for e in audio] == [(1764,)] * len(audio)
        assert [e.frame_index for e in audio] == [f.index for f in frames if not f.remainder]
        assert duplex.tail.shape == (6,)
        # the events joined, then the tail: the session's whole waveform
        joined = np.concatenate([np.array(e.samples) for e in audio] + [np.array(duplex.tail)])
        assert np.array_equal(joined, np.concatenate([f.audio for f in frames]))
    # A stream that ends at max_streaming_seconds keeps its tail too.
    limited = tiny.create_duplex_session(system_prompt="", seed=0, max_streaming_seconds=0.4)
    events = limited.push_audio(x[:9000])
    assert [e.samples.shape for e in events if e.kind == "audio"] == [(1764,)] * 5
    assert events[-1].kind == "done" and limited.tail.shape == (6,)


# --- NVIDIA's default system prompt ------------------------------------------------------------


class _Stop(Exception):
    pass


def test_default_system_prompt(tiny, monkeypatch):
    assert DEFAULT_SYSTEM_PROMPT.startswith("You are an AI voice assistant developed by NVIDIA.")
    assert DEFAULT_SYSTEM_PROMPT.endswith("Start the conversation by greeting the user.")
    assert resolve_system_prompt(None) == DEFAULT_SYSTEM_PROMPT
    assert resolve_system_prompt("") == "" and resolve_system_prompt("Hi.") == "Hi."
    with pytest.raises(GenerationError, match="system_prompt must be a string"):
        resolve_system_prompt(3)
    default = prompt_ids(tiny, None)
    assert default == prompt_ids(tiny, DEFAULT_SYSTEM_PROMPT) and len(default) > 2
    assert prompt_ids(tiny, "") == []
    assert tiny.session().prompt_ids == default
    assert tiny.session("").prompt_ids == []
    assert tiny.create_duplex_session().session.prompt_ids == default
    # generate: the ids the session starts from (stopped there; the loop is tested elsewhere).
    from mlx_voicechat.nemotron_voicechat.runtime import generate as offline

    seen = []

    def start(model, request, *args, **kwargs):
        seen.append(list(request.prompt_ids))
        raise _Stop

    monkeypatch.setattr(offline, "open_state", start)
    x = _wave()[:4000]
    for kwargs in ({}, {"system_prompt": None}, {"system_prompt": ""}, {"system_prompt": "Hi."}):
        with pytest.raises(_Stop):
            tiny.generate(x, **kwargs)
        with pytest.raises(_Stop):
            tiny.create_session().generate(x, **kwargs)
    hi = prompt_ids(tiny, "Hi.")
    assert seen == [default, default, default, default, [], [], hi, hi]


def test_cli_prompt_default_and_empty(tiny_checkpoints, tmp_path, monkeypatch):
    import soundfile as sf

    from mlx_voicechat import nemotron_voicechat
    from mlx_voicechat.cli import main

    seen = []

    def spy(self, audio, system_prompt=None, *args, **kwargs):
        seen.append(system_prompt)
        raise _Stop

    monkeypatch.setattr(nemotron_voicechat.Model, "generate", spy)
    q = tmp_path / "q.wav"
    sf.write(q, _wave()[:4000], 16000)
    base = ["generate", "--model", str(tiny_checkpoints["mlx-audio"]), "--audio", str(q),
            "--output-audio", str(tmp_path / "r.wav"), "--quiet"]
    for extra in (["-p", ""], [], ["-p", "Hi."]):
        with pytest.raises(_Stop):
            main(base + extra)
    # -p "": none; no -p: None, which generate resolves to DEFAULT_SYSTEM_PROMPT
    assert seen == ["", None, "Hi."]
