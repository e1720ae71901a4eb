"""Nemotron-3.5-ASR: loading both layouts, the greedy loop of the runtime notes, prompts, CLI."""

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_voicechat import load
from mlx_voicechat.cli import main
from mlx_voicechat.derived import reset_derived
from mlx_voicechat.errors import CheckpointError
from mlx_voicechat.nemotron_asr.config import ASRConfig
from mlx_voicechat.nemotron_asr.factory import make_recognizer_checkpoint
from mlx_voicechat.nemotron_asr.layout import sanitize_recognizer
from mlx_voicechat.nemotron_asr.recognizer import Recognizer, RecognizerError
from mlx_voicechat.nemotron_voicechat.weights.loading import read_weights, weight_files


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("asr")
    out = {}
    for name, kw in {
        "mlx-audio": dict(seed=2),
        "transformers": dict(layout="transformers", seed=2),
        "mlx-audio-3": dict(seed=3),
        "bf16": dict(seed=2, dtype="bfloat16"),
        "8bit": dict(seed=2, quantize=8, group_size=32),
        "english": dict(layout="transformers", seed=3, prompt=False),
    }.items():
        kw.setdefault("layout", "mlx-audio")
        out[name] = make_recognizer_checkpoint(root / name, "tiny", **kw)
    return out


@pytest.fixture(scope="module")
def asr(ckpts):
    return load(ckpts["mlx-audio"])


def noise(n, seed=0, scale=0.1):
    return (scale * np.random.default_rng(seed).standard_normal(n)).astype(np.float32)


# --- loading ------------------------------------------------------------------------------


def test_both_layouts_load_the_same_weights(ckpts, asr):
    hf = load(ckpts["transformers"])
    assert isinstance(asr, Recognizer) and isinstance(hf, Recognizer)
    assert (asr.config.layout, hf.config.layout) == ("mlx-audio", "transformers")
    assert (
        hf.config.model_type == "nemotron3_5_asr" and hf.config.vocabulary == asr.config.vocabulary
    )
    assert hf.config.prompt.prompt_dictionary == asr.config.prompt.prompt_dictionary
    a, b = dict(tree_flatten(asr.parameters())), dict(tree_flatten(hf.parameters()))
    assert a.keys() == b.keys()
    for k in a:
        assert mx.array_equal(a[k], b[k]), k
    x = noise(40000)
    assert hf.transcribe(x).tokens == asr.transcribe(x).tokens


def test_sanitize_twice_changes_nothing(ckpts, asr):
    raw = read_weights(weight_files(ckpts["transformers"]))
    once = sanitize_recognizer(asr, raw)
    twice = sanitize_recognizer(asr, once)
    assert once.keys() == twice.keys()
    assert all(mx.array_equal(once[k], twice[k]) for k in once)
    assert "decoder.prediction.dec_rnn.lstm.1.bias" in once and "joint.enc.weight" in once


@pytest.mark.parametrize(
    "change, message",
    [
        ("drop", "missing tensor 'joint.enc.weight'"),
        ("extra", "unexpected tensor 'joint.extra.weight'"),
        ("shape", "tensor 'joint.enc.weight' has shape"),
    ],
)
def test_loading_is_strict(ckpts, tmp_path, change, message):
    folder = tmp_path / change
    shutil.copytree(ckpts["mlx-audio"], folder)
    w = dict(mx.load(str(folder / "model.safetensors")))
    if change == "drop":
        del w["joint.enc.weight"]
    elif change == "extra":
        w["joint.extra.weight"] = mx.zeros((2, 2))
    else:
        w["joint.enc.weight"] = w["joint.enc.weight"][:, :-1]
    mx.save_safetensors(str(folder / "model.safetensors"), w)
    with pytest.raises(CheckpointError, match=message):
        load(folder)


def test_bf16_and_8bit(ckpts):
    bf = load(ckpts["bf16"])
    assert bf.joint.enc.weight.dtype == mx.bfloat16
    q = load(ckpts["8bit"])
    assert type(q.joint.enc).__name__ == "QuantizedLinear"
    x = noise(30000, 1)
    for m in (bf, q):
        r = m.transcribe(x)
        assert (
            r.encoder_frames == (30000 // 160 + 6) // 8 + 1
            and r.steps >= r.encoder_frames - r.forced_advances
        )


def test_cpu_layout_comes_with_load_only(ckpts, asr):
    """The float weights' CPU layout (fastpaths/layout.py) is applied by load; a lazily loaded
    recognizer keeps the checkpoint's layout through transcribe and sessions (as a lazy
    VoiceChat model does), and hears the same tokens."""
    from mlx_voicechat.fastpaths import on_cpu

    assert getattr(asr, "_cpu_layout_done", False) == on_cpu()
    lazy = load(ckpts["mlx-audio"], lazy=True)
    x = noise(20000, 4)
    a, b = asr.transcribe(x), lazy.transcribe(x)
    live = lazy.session()
    live.feed(x)
    live.finish()
    assert not getattr(lazy, "_cpu_layout_done", False)
    assert a.tokens == b.tokens and a.text == b.text


def test_info_describes_a_recognizer(ckpts, capsys):
    assert main(["info", str(ckpts["8bit"])]) == 0
    out = capsys.readouterr().out
    assert "Nemotron-3.5-ASR (nemotron_asr)" in out and "lookahead    13 frames" in out
    assert "8-bit, group 32" in out and "prompts      16" in out
    assert main(["info", "--json", str(ckpts["english"])]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["model_type"] == "nemotron_asr_streaming" and info["prompts"] == 0


def test_transformers_config_parses_processor_files(ckpts):
    folder = ckpts["transformers"]
    raw = json.loads((folder / "config.json").read_text())
    proc = json.loads((folder / "processor_config.json").read_text())
    tok = json.loads((folder / "tokenizer.json").read_text())
    cfg = ASRConfig.from_dict(raw, tokenizer=tok, processor=proc)
    assert cfg.blank_id == raw["blank_token_id"] == len(cfg.vocabulary)
    assert cfg.encoder.att_context_size == (raw["encoder_config"]["sliding_window"] - 1, 13)
    assert cfg.lookaheads == (13, 6, 1, 0) and cfg.prompt.default_prompt_id == 15


# --- the loop of the notes ------------------------------------------------------------------


def mlx_audio_tokens(path, x, language):
    """mlx-audio's own generate on the same checkpoint (its zero-padded STFT, errata 1)."""
    from mlx_audio.stt.models.nemotron_asr import tokenizer
    from mlx_audio.stt.utils import load_model

    model = load_model(str(path))
    model.preprocessor_config.pad_mode = "constant"
    result = model.generate(mx.array(x), language=language)
    return [t.id for s in result.sentences for t in s.tokens], model.vocabulary, tokenizer


@pytest.mark.parametrize("name", ["mlx-audio", "mlx-audio-3", "english"])
def test_tokens_equal_mlx_audio_generate(ckpts, name):
    """Ours (``edge="mlx-audio"``) and mlx-audio's generate on the same weights and audio, with
    the language detected and forced; mlx-audio leaves the special pieces (the language tag)
    out of its tokens. The checkpoints are those where mlx-audio agrees with Transformers (which
    decides where they differ, tests/nemotron_asr/test_asr_transformers.py): the factory's blank embedding
    row is zero (mlx-audio starts the prediction network on a zero vector, Transformers on that
    row), ``scale_input`` / ``xscaling`` is written out (a missing one is false to mlx-audio,
    true to Transformers) and false, and only tokens are compared (not the text)."""
    ours = load(ckpts[name])
    assert not np.array(ours.decoder.prediction["embed"].weight[ours.config.blank_id]).any()
    languages = [None, "de-DE"] if ours.has_prompt else [None]
    for i, n in enumerate([48333, 36960, 64320]):
        x = noise(n, 10 + i)
        for lang in languages:
            theirs, vocab, tok = mlx_audio_tokens(ckpts[name], x, lang)
            r = ours.transcribe(x, language=lang, edge="mlx-audio")
            kept = [t for t in r.tokens if not tok.is_special_token(t, vocab)]
            assert kept == theirs, (n, lang)
            assert len(r.tokens) > 0 or not theirs


def reference_loop(model, x, prompt_id, edge="nemo"):
    """The runtime notes' loop, one step at a time, on the host."""
    mel, mel_len = model.frontend(mx.array(x)[None], mx.array([len(x)]), edge)
    T = int(model.encoder.output_lengths(mel_len)[0].item())
    enc = model.joint_frames(model.encoder.encode(mel, mel_len, T), mx.array([prompt_id]))[0]
    pred, state = model.start(1)
    out, new = model.decoder(None, None)
    tokens, frames, steps, t, symbols = [], [], 0, 0, 0
    blank = model.config.blank_id
    while t < T:
        k = int(mx.argmax(model.joint.logits(enc[t], pred[0])).item())
        steps += 1
        if k == blank:
            t, symbols = t + 1, 0
            continue
        tokens.append(k)
        frames.append(t)
        state = new
        out, new = model.decoder(mx.array([[k]]), state)
        pred = model.joint.project_prediction(out[:, -1])
        symbols += 1
        if symbols >= model.config.max_symbols:
            t, symbols = t + 1, 0
    return tokens, frames, steps, T


def set_last(model, weight, bias):
    """The joint's last layer replaced (and the compiled steps made from it dropped)."""
    n = len(model.joint.joint_net)
    model.joint.update({"joint_net": [{} for _ in range(n - 1)] + [{"weight": weight, "bias": bias}]})
    reset_derived(model)


def craft(model, bias):
    w = model.joint.joint_net[-1]
    old = (w.weight, w.bias)
    set_last(model, mx.zeros_like(w.weight), mx.array(bias, dtype=w.bias.dtype))
    return old


def test_step_counts_follow_the_notes(asr):
    x = noise(42000, 5)
    blank, V, S = asr.config.blank_id, asr.config.blank_id + 1, asr.config.max_symbols
    w = asr.joint.joint_net[-1]
    bias = np.zeros(V, np.float32)
    bias[blank] = 5.0  # every step blank
    old = craft(asr, bias)
    try:
        T = (42000 // 160 + 6) // 8 + 1  # causal subsampling of floor(n / 160) mel frames
        r = asr.transcribe(x)
        assert r.tokens == [] and r.steps == r.encoder_frames == T
        bias = np.zeros(V, np.float32)
        bias[7] = 5.0  # never blank: max_symbols per frame, then a forced advance
        set_last(asr, w.weight, mx.array(bias))
        r = asr.transcribe(x)
        assert r.tokens == [7] * (T * S) and r.steps == T * S
        assert r.forced_advances == T and r.frames == [t for t in range(T) for _ in range(S)]
    finally:
        set_last(asr, *old)
    for seed, lang in [(5, None), (6, "en-US"), (7, "fr-FR")]:  # mixed: the random joint
        x = noise(42000, seed)
        r = asr.transcribe(x, language=lang)
        pid = asr.resolve_prompt(lang)[0]
        tokens, frames, steps, T = reference_loop(asr, x, pid)
        assert (r.tokens, r.frames, r.steps, r.encoder_frames) == (tokens, frames, steps, T)
        assert r.steps + r.forced_advances == len(r.tokens) + T
        assert 0 < len(r.tokens) < S * T


def test_language_prompt(asr):
    x = noise(30000, 3)
    assert asr.resolve_prompt() == (15, None)
    assert asr.resolve_prompt("en-US") == (0, "en-US")
    assert asr.resolve_prompt(prompt_id=2) == (2, "de-DE")
    assert asr.transcribe(x, prompt_id=0).tokens == asr.transcribe(x, language="en").tokens
    for kw, message in [
        (dict(language="xx-YY"), "unknown language 'xx-YY'"),
        (dict(prompt_id=16), r"prompt_id must be an integer in \[0, 16\)"),
        (dict(language="en-US", prompt_id=3), "is prompt 0, not prompt_id 3"),
    ]:
        with pytest.raises(RecognizerError, match=message):
            asr.transcribe(x, **kw)
    # The detected language is the first tag the model emits; a forced one is reported too.
    r = asr.transcribe(x)
    tags = [asr.vocabulary[t][1:-1] for t in r.tokens if asr.vocabulary[t].startswith("<")]
    assert r.language == (tags[0] if tags else None)
    r = asr.transcribe(x, language="fr-FR")
    assert r.language is not None


def test_english_model_has_no_prompt(ckpts):
    m = load(ckpts["english"])
    with pytest.raises(RecognizerError, match="has no language prompt"):
        m.transcribe(noise(20000), language="en-US")


def test_cli(ckpts, tmp_path, capsys):
    import soundfile as sf

    a, b = tmp_path / "a.wav", tmp_path / "b.wav"
    sf.write(a, noise(40000, 1), 16000)
    sf.write(b, noise(24000, 2), 16000)
    model = str(ckpts["mlx-audio"])
    asr = load(model)
    assert main(["transcribe", "--model", model, "--language", "de-DE", "--benchmark", str(a)]) == 0
    out = capsys.readouterr().out.splitlines()
    solo = asr.transcribe(str(a), language="de-DE")
    assert out[0] == solo.text and out[1] == "language: de-DE"
    assert any(f"{solo.steps} steps, {len(solo.tokens)} tokens" in line for line in out)
    assert main(["transcribe", "--model", model, "--prompt-id", "2", str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert f"{a}: {asr.transcribe(str(a), prompt_id=2).text}" in out
    assert f"{b}: {asr.transcribe(str(b), prompt_id=2).text}" in out
    assert main(["transcribe", "--model", model, "--language", "xx", str(a)]) == 2
    assert "unknown language 'xx'" in capsys.readouterr().err
    # stream: the file through a live transcription session, the words as they come.
    assert main(["stream", "--model", model, "--audio", str(a), "--language", "de-DE"]) == 0
    out = capsys.readouterr().out
    assert f"[user] {solo.text}" in out and "language: de-DE" in out
    assert "lookahead: 13 frames" in out and "RTF" in out


def test_generate_with_a_recognizer_is_one_clear_error(ckpts, tmp_path, capsys):
    import soundfile as sf

    a = tmp_path / "a.wav"
    sf.write(a, noise(16000), 16000)
    code = main(
        [
            "generate",
            "--model",
            str(ckpts["mlx-audio"]),
            "--audio",
            str(a),
            "--output-audio",
            str(tmp_path / "o.wav"),
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "needs a NemotronLabs VoiceChat checkpoint" in err[0]
    with pytest.raises(RecognizerError, match="needs a NemotronLabs VoiceChat"):
        load(ckpts["mlx-audio"]).generate(str(a))


def test_make_checkpoint_cli(tmp_path, capsys):
    out = tmp_path / "c"
    assert main(["make-checkpoint", str(out), "--model", "asr", "--layout", "transformers"]) == 0
    assert (out / "processor_config.json").exists() and "transformers" in capsys.readouterr().out
    assert main(["make-checkpoint", str(out), "--model", "asr", "--force"]) == 0
    assert json.loads((out / "config.json").read_text())["model_type"] == "nemotron_asr"
    assert main(["make-checkpoint", str(tmp_path / "d"), "--layout", "transformers"]) == 2


# --- Transformers' rules (tests/nemotron_asr/test_asr_transformers.py checks them against Transformers) --


def test_transformers_config_defaults_are_its_class_defaults(ckpts):
    """Keys a Transformers config leaves out take NemotronAsrStreamingEncoderConfig's and the
    feature extractor's defaults (5.23), the vocabulary size and blank per model type."""
    folder = ckpts["transformers"]
    raw = json.loads((folder / "config.json").read_text())
    tok = json.loads((folder / "tokenizer.json").read_text())
    for k in ("attention_bias", "convolution_bias", "scale_input", "sliding_window"):
        raw["encoder_config"].pop(k)
    raw["encoder_config"]["num_mel_bins"] = 80
    mels80 = {"feature_extractor": {"feature_size": 80}}
    c = ASRConfig.from_dict(raw, tokenizer=tok, processor=mels80)
    assert c.encoder.use_bias and not c.zero_biases and c.encoder.xscaling
    assert c.encoder.att_context_size == (70, 13) and c.preprocessor.features == 80
    raw["encoder_config"]["attention_bias"] = False
    c = ASRConfig.from_dict(raw, tokenizer=tok, processor=mels80)
    assert c.encoder.use_bias and c.zero_biases == ("attention",)
    with pytest.raises(Exception, match="feature_size 128 differs"):
        ASRConfig.from_dict(raw, tokenizer=tok, processor={"feature_size": 128})


def test_scale_input_multiplies_the_subsampled_frames(asr):
    x = mx.array(noise(8 * 40 * 128, 4).reshape(1, -1, 128))
    plain = asr.encoder.subsample(x)
    asr.encoder.cfg.xscaling = True
    try:
        scaled = asr.encoder.subsample(x)
    finally:
        asr.encoder.cfg.xscaling = False
    assert np.allclose(np.array(scaled), np.array(plain) * np.sqrt(asr.encoder.cfg.d_model))


def test_text_is_the_metaspace_decoding():
    """What Transformers' tokenizer decodes (seen in tests/nemotron_asr/test_asr_transformers.py)."""
    from mlx_voicechat.listen.events import piece_text

    vocab = ["<unk>", "\u2581", "<en-US>", "a", "b", "\u2581a", ","]
    for ids, want in [([5, 4, 1], "ab "), ([2, 1, 5], " a"), ([3, 1, 6], "a ,"), ([0, 5], "a"),
                      ([1, 6], ",")]:
        assert piece_text(ids, vocab) == want, ids
