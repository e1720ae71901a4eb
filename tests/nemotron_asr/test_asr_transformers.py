"""Nemotron-3.5-ASR against Hugging Face Transformers' own implementation, token for token.

Tiny random models built with Transformers' classes and written by its ``save_pretrained`` and
processor (tests/support/asr_reference.py) are loaded by ``mlx_voicechat.load`` and compared with
Transformers' greedy ``generate``: the features (within Transformers' own float32 error against
a float64 computation), the tokens, each token's frame, the language and the text, offline,
in a padded batch and live (our session on random chunk sizes against Transformers'
cache-aware streaming generate). Where tokens part, the top-two logit margin of Transformers'
step there is printed: a near tie is told apart from a bug, and every run asserts that its
smallest margin is well above float32 rounding (the seeds and the blank bias are chosen so).

Needs torch (CPU) and transformers 5.23 (``pip install -e '.[reference]'``); skipped without.
"""

import shutil

import mlx.core as mx
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the Transformers reference needs torch")
pytest.importorskip("transformers.models.nemotron3_5_asr", reason="transformers >= 5.23 needed")

import asr_reference as ref  # noqa: E402

from mlx_voicechat import load  # noqa: E402

MIN_MARGIN = 2e-5  # logits are O(1); float32 rounding moves them by about 1e-6


def noise(n, seed=0, scale=0.1):
    """Speech-like enough for random weights: a tone that jumps every 120 ms, over noise,
    under a loud-and-quiet envelope (stationary noise makes every frame decide alike)."""
    rng = np.random.default_rng(seed)
    t = np.arange(n) / 16000.0
    freq = rng.uniform(100, 4000, n // 1920 + 1)[np.arange(n) // 1920]
    tone = np.sin(2 * np.pi * np.cumsum(freq) / 16000.0)
    env = 0.2 + np.abs(np.sin(t * 3.0 + seed))
    return (scale * env * (tone + 0.5 * rng.standard_normal(n))).astype(np.float32)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Built once per configuration: name -> (folder, Transformers model, processor, ours)."""
    root, cache = tmp_path_factory.mktemp("asr-hf"), {}

    def get(name, **kw):
        if name not in cache:
            folder = root / name
            model, processor = ref.build(folder, **kw)
            cache[name] = (folder, model, processor, load(folder))
        return cache[name]

    return get


# Seeds picked (tests/support/asr_reference.py's weights) for clear margins and a few tokens.
CASES = {
    "prompt-scaled": dict(seed=17),
    "prompt-unscaled": dict(seed=14, scale_input=False),
    "english-scaled": dict(seed=14, kind="nemotron_asr_streaming"),
    "english-unscaled": dict(seed=14, kind="nemotron_asr_streaming", scale_input=False),
    "lookahead-6": dict(seed=17, lookahead=6),
    "bf16-filters": dict(seed=17, mel_filters_dtype="bfloat16"),
}


def compare(ours, theirs, where):
    """Tokens, frames, text and language equal; where the tokens part, the margin there."""
    assert min(theirs["margins"]) > MIN_MARGIN, (
        f"{where}: a near tie in Transformers' run (top-two margin "
        f"{min(theirs['margins']):.2e}); choose another seed"
    )
    if ours.tokens != theirs["tokens"]:
        i = next(
            (k for k, (a, b) in enumerate(zip(ours.tokens, theirs["tokens"])) if a != b),
            min(len(ours.tokens), len(theirs["tokens"])),
        )
        # They part at one of Transformers' steps from the one after their last common token
        # to the one that emits its token i (or its last step).
        steps, gaps = theirs["steps"], theirs["margins"]
        lo = steps[i - 1] + 1 if i else 0
        hi = steps[i] if i < len(steps) else len(gaps) - 1
        at = min(gaps[lo : hi + 1], default=float("nan"))
        print(f"{where}: tokens part at token {i}, steps {lo}..{hi}: top-two margin {at:.3e}")
    assert ours.tokens == theirs["tokens"], where
    assert ours.frames == theirs["frames"], where
    assert ours.text == theirs["text"], where
    assert ours.language == theirs["language"], where
    assert theirs["tokens"], f"{where}: a run that emits nothing tests little"


@pytest.mark.parametrize("name", ["prompt-scaled", "bf16-filters"])
def test_features_within_transformers_float32_error(models, name):
    """Our log-mel against a float64 one, about as far off as Transformers' own float32 (the
    largest error of the log at a quiet bin 4x, the RMS 2x); float32 and bfloat16 filters."""
    _, _, processor, ours = models(name, **CASES[name])
    x = noise(16000 * 2 + 123, 7)
    want = ref.log_mel64(processor.feature_extractor, x)
    theirs = ref.hf_inputs(processor, x).input_features[0].double().numpy()[: len(want)]
    mel, n = ours.frontend(mx.array(x)[None], mx.array([len(x)]))
    assert int(n[0]) == len(want)
    mine = np.array(mel[0, : len(want)]).astype(np.float64)
    err = {k: np.abs(v - want) for k, v in (("ours", mine), ("theirs", theirs))}
    rms = {k: np.sqrt(np.mean(v**2)) for k, v in err.items()}
    assert err["ours"].max() <= 4 * err["theirs"].max(), (err["ours"].max(), err["theirs"].max())
    assert rms["ours"] <= 2 * rms["theirs"], rms


@pytest.mark.parametrize("name", sorted(CASES))
def test_offline_tokens_equal_transformers(models, name):
    """One clip, the language detected and forced (the prompt kind), scale_input on and off,
    a lookahead other than the default, bfloat16 filters."""
    _, model, processor, ours = models(name, **CASES[name])
    x = noise(16000 * 3 + 517, 11)
    vocab = ours.config.vocabulary
    languages = [None, "de-DE"] if ours.has_prompt else [None]
    for lang in languages:
        r = ours.transcribe(x, language=lang)
        theirs = ref.generate(model, processor, x, lang, vocab, [r.encoder_frames])[0]
        compare(r, theirs, f"{name} language={lang}")


@pytest.mark.parametrize("name", ["prompt-scaled", "english-scaled", "lookahead-6"])
def test_padded_batch_at_chunk_edges_equals_transformers(models, name):
    """Clips of different lengths, around the edges of the encoder's chunks, in one padded
    batch on both sides. Transformers' batched generate goes on decoding a short row past its
    length while longer rows decode (tokens on padding frames, which the same clip alone never
    gets): those are left out, and each row is also compared with the clip alone."""
    _, model, processor, ours = models(name, **CASES[name])
    chunk = 1280 * (ours.config.lookahead + 1)
    lengths = [chunk - 1, chunk, chunk + 1, chunk + 159, 2 * chunk + 160, 3 * chunk - 1280 + 1]
    clips = [noise(n, 20 + i) for i, n in enumerate(lengths)]
    rs = ours.transcribe(clips)
    vocab = ours.config.vocabulary
    theirs = ref.generate(model, processor, clips, None, vocab, [r.encoder_frames for r in rs])
    for n, x, r, t in zip(lengths, clips, rs, theirs):
        if t["past"]:
            print(f"{name}: Transformers' batch decoded {t['past']} tokens past a {n}-sample clip")
        compare(r, t, f"{name} batch, clip of {n} samples")
        alone = ref.generate(model, processor, x, None, vocab, [r.encoder_frames])[0]
        compare(r, alone, f"{name} clip of {n} samples alone")


@pytest.mark.parametrize(
    "name, language", [("prompt-scaled", None), ("prompt-scaled", "en-US"),
                       ("english-scaled", None), ("lookahead-6", None)]
)
def test_session_equals_transformers_streaming_generate(models, name, language):
    """Transformers' cache-aware streaming generate on its mel chunks against our session fed
    the same samples in random chunk sizes (the clip fills whole chunks, so that the two
    streams see the same samples)."""
    _, model, processor, ours = models(name, **CASES[name])
    r_ = ours.config.lookahead
    n = 160 * (1 + 8 * r_ + 8 * (r_ + 1) * 4)
    x = noise(n, 32)
    theirs = ref.generate_streaming(model, processor, x, language, ours.config.vocabulary)
    rng = np.random.default_rng(5)
    s, events, i = ours.session(language=language), [], 0
    while i < n:
        step = int(rng.integers(1, 4000))
        events += s.feed(x[i : i + step])
        i += step
    events += s.finish()

    class Live:  # the session's events as a result
        tokens = [t for e in events for t in e.tokens]
        frames = [e.index for e in events for _ in e.tokens]
        text = "".join(e.text for e in events)
        language = events[-1].language

    compare(Live, theirs, f"{name} live, language={language}")
    compare(ours.transcribe(x, language=language), theirs, f"{name} offline, language={language}")


# Keys a config may leave out, with Transformers' class defaults (NemotronAsrStreamingEncoderConfig,
# NemotronAsrStreamingFeatureExtractor) on the model written.
DEFAULTED = ["attention_bias", "convolution_bias", "scale_input", "sliding_window", "num_mel_bins"]


@pytest.mark.parametrize("drop", [*DEFAULTED, "all", "split-bias"])
def test_folder_without_keys_loads_as_transformers(models, tmp_path, drop):
    """A Transformers-written folder with a key left out: Transformers reads its class
    default, so must we (and then transcribe as it does). ``split-bias``:
    ``attention_bias: false`` written, ``convolution_bias`` left out (so true)."""
    from transformers import AutoProcessor, Nemotron3_5AsrForRNNT

    folder = tmp_path / "m"
    over = dict(num_mel_bins=80, sliding_window=71, scale_input=True)
    if drop == "split-bias":
        over["attention_bias"] = False
    ref.build(folder, seed=17 if drop == "split-bias" else 22, **over)
    keys = DEFAULTED if drop == "all" else [drop]
    if drop == "split-bias":
        keys = ["convolution_bias"]

    def strip(d):
        for k in keys:
            d["encoder_config"].pop(k)

    ref.edit_json(folder / "config.json", strip)
    if "num_mel_bins" in keys:
        ref.edit_json(folder / "processor_config.json", lambda d: d["feature_extractor"].pop(
            "feature_size"))
    model = Nemotron3_5AsrForRNNT.from_pretrained(folder).eval()
    processor = AutoProcessor.from_pretrained(folder)
    enc = model.config.encoder_config
    assert enc.num_mel_bins == 80 and enc.sliding_window == 71 and enc.scale_input
    assert enc.convolution_bias and enc.attention_bias == (drop != "split-bias")
    ours = load(folder)
    x = noise(16000 * 3, 13)
    r = ours.transcribe(x)
    theirs = ref.generate(model, processor, x, None, ours.config.vocabulary, [r.encoder_frames])
    compare(r, theirs[0], f"without {drop}")
    shutil.rmtree(folder)


def test_text_keeps_a_trailing_word_boundary(models):
    """Transformers' decoding keeps a trailing ``▁`` as a space and takes one ``▁`` off the
    first piece only: our text (offline and live) is its ``decode`` of the same ids."""
    from mlx_voicechat.listen.events import PieceText, piece_text

    _, _, processor, ours = models("prompt-scaled", **CASES["prompt-scaled"])
    vocab = ours.config.vocabulary
    ids = {p: i for i, p in enumerate(vocab)}
    for seq in (["\u2581a", "b", "\u2581"], ["<en-US>", "\u2581", "\u2581a"], ["a", "\u2581", ","],
                ["<unk>", "\u2581a", "\u2581", "\u2581"], ["\u2581", ","]):
        tokens = [ids[p] for p in seq]
        want = processor.decode(tokens, skip_special_tokens=True)
        stream = PieceText(vocab)
        assert piece_text(tokens, vocab) == want == "".join(stream.add(t) for t in tokens), seq


def test_prediction_starts_on_the_blank_embedding(models):
    """Transformers starts the prediction network on the blank's embedding (a model trained
    in Transformers has a nonzero blank row; NeMo's conversions a zero one)."""
    _, model, _, ours = models("prompt-scaled", **CASES["prompt-scaled"])
    assert float(model.decoder.embedding.weight[ref.VOCAB].abs().max()) > 0.1
    pred, _ = ours.start(1)
    with torch.no_grad():
        want = model.decoder(torch.tensor([[ref.VOCAB]]))[0, -1].numpy()
    assert np.allclose(np.array(pred[0]), want, atol=1e-5), np.abs(np.array(pred[0]) - want).max()
