"""Every fast path of ``fastpaths/`` against its anchor, bit for bit, at the factory's
medium scale (random weights), for a batch of rows that each match the row alone.

The anchors are the installed mlx-lm / mlx-audio modules (or, where the fast path replaces
our own general path, that path); ``fastpaths.CHECKED_AGAINST`` names the versions they were
checked against, and pyproject.toml bounds each to that version's minor series."""

import importlib.metadata
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from fastpath_utils import set_fastpath
from mlx.utils import tree_map
from mlx_lm.models.cache import ArraysCache
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from mlx_voicechat import fastpaths
from mlx_voicechat.caches import RowCaches
from mlx_voicechat.derived import reset_derived
from mlx_voicechat.fastpaths import heads
from mlx_voicechat.fastpaths.layout import use_cpu_layout
from mlx_voicechat.listen.greedy import greedy_decode
from mlx_voicechat.nemotron_voicechat import Model
from mlx_voicechat.nemotron_voicechat.weights.random_init import random_weights
from mlx_voicechat.nemotron_voicechat.weights.scales import build_tokenizer, scale_config
from mlx_voicechat.noise import KeyNoise, RowNoise


def _same(a, b):
    assert len(a) == len(b) > 0
    for x, y in zip(a, b):
        assert x.shape == y.shape and x.dtype == y.dtype
        assert mx.array_equal(x, y).item()


@pytest.fixture(scope="module")
def medium():
    cfg = scale_config("medium")
    tokenizer = build_tokenizer(cfg.text_args.vocab_size)
    model = Model(cfg)
    model.load_weights(list(random_weights(model, cfg, tokenizer, seed=1).items()))
    mx.eval(model.parameters())
    model.setup_tokenizer(tokenizer)
    use_cpu_layout(model)  # as a loaded model
    return model


def test_every_fast_path_is_covered():
    tested = {
        "llm.step", "llm.row_attention", "tts.backbone_step", "tts.sampling", "encoder.frame",
        "codec.step", "heads.split", "rnnt.frame",
        # tests/nemotron_asr/test_asr_session.py: compiled chunk against op by op, bit for bit
        "asr.chunk",
        "encoder.convs", "asr.mel", "rnnt.lstm_step",
        "offline.encoder", "offline.codec",  # tests/test_offline_fastpaths.py
    }
    assert set(fastpaths.PATHS) == tested


def _pyproject_bounds():
    """pyproject.toml's requirements on the packages of ``CHECKED_AGAINST``, every one of them
    (a package may be listed per platform and per extra): name -> [specifiers]."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    text = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    project = tomllib.loads(text)["project"]
    lines = project["dependencies"] + [r for rs in project["optional-dependencies"].values() for r in rs]
    bounds = {}
    for req in map(Requirement, lines):
        if req.name in fastpaths.CHECKED_AGAINST:
            bounds.setdefault(req.name, []).append(req.specifier)
    return bounds


def test_the_installed_anchors_are_in_the_checked_minor_series():
    """The policy of ``fastpaths/__init__.py``: each anchor package is required from the version
    checked up to the next minor release, and the installed one lies in that range."""
    bounds = _pyproject_bounds()
    assert set(bounds) == set(fastpaths.CHECKED_AGAINST)
    for package, checked in fastpaths.CHECKED_AGAINST.items():
        v = Version(checked)
        series = SpecifierSet(f">={checked},<{v.major}.{v.minor + 1}")
        for spec in bounds[package]:
            assert spec == series, f"pyproject.toml requires {package}{spec}, not {package}{series}"
        installed = importlib.metadata.version(package)
        assert series.contains(installed, prereleases=True), (package, installed, str(series))


def test_llm_step_and_row_attention_equal_mlx_lm_per_row(medium, monkeypatch):
    """Two rows with different histories stepped together (recurrent Mamba steps, compiled
    segments, attention row by row) against each row alone on mlx-lm's own path."""
    llm = medium.stt_model.llm
    H = medium.config.text_args.hidden_size
    x = mx.random.normal((2, 9, H), key=mx.random.key(3))

    def alone(b, prefill, steps):
        set_fastpath(monkeypatch, "llm.step", False)
        cache = llm.make_cache()
        outs = [llm(x[b : b + 1, :prefill], cache)[:, -1:]]
        outs += [llm(x[b : b + 1, t : t + 1], cache) for t in range(prefill, prefill + steps)]
        return outs, cache

    (a_out, _), (b_out, _) = alone(0, 3, 5), alone(1, 5, 3)
    # the batch: both rows' states after their prefills, then three steps together
    set_fastpath(monkeypatch, "llm.step", True)
    rows = []
    for b, prefill in ((0, 3), (1, 5)):
        c = llm.make_cache()
        llm(x[b : b + 1, :prefill], c)
        rows.append(c)
    batch = [
        RowCaches.merge([r[i] for r in rows]) if isinstance(rows[0][i], RowCaches)
        else _stack([r[i] for r in rows])
        for i in range(len(rows[0]))
    ]
    outs = [llm(mx.concatenate([x[0:1, 3 + t : 4 + t], x[1:2, 5 + t : 6 + t]]), batch) for t in range(3)]
    _same([o[0:1] for o in outs], a_out[1:4])
    _same([o[1:2] for o in outs], b_out[1:4])


def _stack(caches):
    c = ArraysCache(len(caches[0].cache))
    c.cache = [mx.concatenate(parts) for parts in zip(*(x.cache for x in caches))]
    return c


def test_tts_backbone_step_equals_mlx_lm_blocks_per_conversation(medium, monkeypatch):
    """Two conversations (four guidance rows) at different offsets stepped together against
    each one through mlx-lm's Gemma-3 blocks."""
    backbone = medium.tts_model.tts_model.backbone
    H = medium.config.tts_config.hidden_size
    x = mx.random.normal((4, 12, H), key=mx.random.key(5))

    def warm(b, T):
        cache = backbone.make_cache()
        backbone(x[2 * b : 2 * b + 2, :T], cache)
        return cache

    ref = []
    for b, T in ((0, 6), (1, 8)):
        cache = warm(b, T)
        ref.append([backbone._layers(x[2 * b : 2 * b + 2, T + t : T + t + 1], cache) for t in range(3)])
    caches = [warm(0, 6), warm(1, 8)]
    batch = [RowCaches.merge([c[i] for c in caches]) for i in range(len(caches[0]))]
    outs = []
    for t in range(3):
        h = mx.concatenate([x[0:2, 6 + t : 7 + t], x[2:4, 8 + t : 9 + t]])
        outs.append(backbone(h, batch))
    _same([o[0:2] for o in outs], ref[0])
    _same([o[2:4] for o in outs], ref[1])


def test_tts_sampling_compiled_equals_op_by_op_per_row(medium, monkeypatch):
    tts = medium.tts_model.tts_model
    H = medium.config.tts_config.hidden_size
    hidden = mx.random.normal((4, 1, H), key=mx.random.key(6))

    def codes(fast, h, seeds):
        set_fastpath(monkeypatch, "tts.sampling", fast)
        return tts.generate_codes(h, RowNoise([KeyNoise(s) for s in seeds]))

    both = codes(True, hidden, [1, 2])
    _same([both], [codes(False, hidden, [1, 2])])
    _same([both[0:1]], [codes(False, hidden[0:2], [1])])
    _same([both[1:2]], [codes(False, hidden[2:4], [2])])


def test_encoder_frame_compiled_equals_op_by_op_per_row(medium, monkeypatch):
    """Two streams past their 70-frame context, at different frames, stepped together
    (compiled) against each alone op by op."""
    enc = medium.stt_model.perception.encoder
    D = enc.cfg.d_model
    x = mx.random.normal((2, 76, D), key=mx.random.key(7)).astype(enc.pre_encode.out.weight.dtype)

    set_fastpath(monkeypatch, "encoder.frame", False)
    starts = (71, 73)
    warm = [enc.step(x[b : b + 1, :t0], enc.make_cache())[1] for b, t0 in enumerate(starts)]

    def alone(b):
        cache, outs = warm[b], []
        for t in range(starts[b], starts[b] + 2):
            y, cache = enc.step(x[b : b + 1, t : t + 1], cache)
            outs.append(y)
        return outs, cache

    (ref0, c0), (ref1, c1) = alone(0), alone(1)
    set_fastpath(monkeypatch, "encoder.frame", True)
    rows, outs = list(warm), []
    for t in range(2):
        y, rows = enc.step_rows(mx.concatenate([x[0:1, 71 + t : 72 + t], x[1:2, 73 + t : 74 + t]]), rows)
        outs.append(y)
    _same([o[0:1] for o in outs], ref0)
    _same([o[1:2] for o in outs], ref1)
    _same(rows[0].arrays(), c0.arrays())
    _same(rows[1].arrays(), c1.arrays())


def test_codec_step_equals_the_general_path_per_row(medium, monkeypatch):
    codec = medium.tts_model.audio_codec
    cfg = medium.config.tts_config
    rng = np.random.default_rng(8)
    codes = mx.array(rng.integers(0, cfg.codebook_size, (2, 5, cfg.num_quantizers)), mx.int32)

    def run(fast, rows):
        set_fastpath(monkeypatch, "codec.step", fast)
        cache = codec.make_decode_cache()
        waves = [codec.decode_step(codes[rows, :1], cache)[0]]
        waves += [codec.decode_step(codes[rows, t : t + 1], cache)[0] for t in range(1, 5)]
        return waves + [cache.ola_tail, *cache.conv_tails]

    both = run(True, slice(0, 2))
    _same(both, run(False, slice(0, 2)))
    for b in range(2):
        _same([a[b : b + 1] for a in both], run(False, slice(b, b + 1)))


@pytest.mark.parametrize("bits", [None, 4])
def test_split_head_equals_one_call(medium, monkeypatch, bits):
    head = nn.Linear(256, 131072, bias=False)
    head.weight = mx.random.normal(head.weight.shape, key=mx.random.key(9)) * 0.05
    if bits:
        head = nn.QuantizedLinear.from_linear(head, group_size=64, bits=bits)
    else:
        head.weight = head.weight.astype(mx.bfloat16)
    assert heads.should_split(head)
    h = mx.random.normal((2, 1, 256), key=mx.random.key(10)).astype(mx.bfloat16 if not bits else mx.float32)
    split = heads.greedy_id(head, h, mx.new_stream(mx.default_device()))
    _same([split], [mx.argmax(head(h), axis=-1).reshape(-1).astype(mx.int32)])


def _frames_greedy(frames, project, enc, rows=2):
    """Each row's (tokens, frames) from ``frames`` (a ``FrameDecoder``) run frame by frame."""
    h, c, pred = frames.start()
    h, c = (mx.concatenate([a] * rows, axis=1) for a in (h, c))
    pred = mx.concatenate([pred] * rows)
    got = [([], []) for _ in range(rows)]
    for t in range(enc.shape[1]):
        labels, h, c, pred = frames(project(enc[:, t]), h, c, pred)
        for b, row in enumerate(labels.tolist()):
            for k in row:
                if k != frames.blank:
                    got[b][0].append(k)
                    got[b][1].append(t)
    return [tuple(g) for g in got]


def test_rnnt_frame_equals_greedy_decode_per_row(medium, monkeypatch):
    """The device loop, frame by frame for two utterances at once, gives each utterance's
    tokens of the offline greedy loop on the medium random RNNT (mlx-audio's prediction and
    joint networks): frames that emit up to the cap, and (a blank bias added) blank frames."""
    stt = medium.stt_model
    frames = medium.rnnt_frames
    D = medium.config.audio_config.encoder.d_model
    enc = mx.random.normal((2, 12, D), key=mx.random.key(11))
    joint = stt.rnnt_joint
    bias = joint.joint_net[-1].bias

    def with_blank_bias(shift):
        b = mx.where(mx.arange(bias.shape[0]) == frames.blank, bias + shift, bias)
        joint.update({"joint_net": [{} for _ in joint.joint_net[:-1]] + [{"bias": b}]})
        reset_derived(medium)

    try:
        for shift, expect in ((0.0, "emits"), (8.0, "blank")):
            with_blank_bias(shift)
            want = [
                tuple(greedy_decode(stt.rnnt_decoder, joint, enc[b], None, frames.blank, frames.steps))
                for b in range(2)
            ]
            assert any(w[0] for w in want) == (expect == "emits")
            for fast in (True, False):
                set_fastpath(monkeypatch, "rnnt.frame", fast)
                assert _frames_greedy(frames, joint.project_encoder, enc) == want
    finally:
        joint.update({"joint_net": [{} for _ in joint.joint_net[:-1]] + [{"bias": bias}]})
        reset_derived(medium)


class _CountingDecoder:
    """A prediction network whose state counts the tokens emitted so far."""

    def __call__(self, y, state):
        if state is None:
            h = mx.zeros((1, 1, 1))
        else:
            h = state[0] + (0.0 if y is None else 1.0)
        return h.transpose(1, 0, 2), (h, state[1] if state is not None else mx.zeros((1, 1, 1)))


class _TargetJoint:
    """A joint whose encoder frame holds how many tokens should have been emitted by its end:
    token 0 while fewer were, else blank (index 2)."""

    blank_id = 2

    def project_encoder(self, enc):
        return enc

    def project_prediction(self, pred):
        return pred

    def logits(self, enc, pred):
        more = enc[..., :1] - pred[..., :1] - 0.5
        return mx.concatenate([more, mx.full(more.shape, -1.0), mx.zeros(more.shape)], axis=-1)


@pytest.mark.parametrize(
    "targets",
    [
        [[0] * 8, [0] * 8],  # all blank
        [[100 * (t + 1) for t in range(8)], [7 * (t + 1) for t in range(8)]],  # to the cap
        [[0, 1, 1, 4, 4, 4, 20, 21], [2, 2, 3, 3, 3, 9, 9, 10]],  # mixed
    ],
)
def test_rnnt_frame_follows_the_greedy_rule(targets, monkeypatch):
    """Crafted prediction / joint networks: per frame blank, one token, several, the cap
    (max_symbols 5); the device loop (compiled and op by op) steps exactly as the offline
    greedy loop, prediction state adopted only on emit."""
    from mlx_voicechat.listen.rnnt import FrameDecoder

    decoder, joint = _CountingDecoder(), _TargetJoint()
    frames = FrameDecoder(decoder, joint, 5)
    frames.start = lambda: (*decoder(None, None)[1], decoder(None, None)[0][:, -1])
    enc = mx.array(targets, dtype=mx.float32)[..., None]
    want = [tuple(greedy_decode(decoder, joint, enc[b], None, 2, 5)) for b in range(2)]
    for fast in (True, False):
        set_fastpath(monkeypatch, "rnnt.frame", fast)
        assert _frames_greedy(frames, joint.project_encoder, enc) == want
    counts = [np.bincount(w[1], minlength=8) for w in want]
    assert all(c.max() <= 5 for c in counts)


# --- the recognizer's (and the VoiceChat encoder's) convolutions, mel and LSTM step -----------


@pytest.fixture(scope="module")
def recognizer(tmp_path_factory):
    """The factory's small Nemotron-3.5-ASR (64 subsampling channels, width 192), as loaded."""
    from mlx_voicechat import load
    from mlx_voicechat.nemotron_asr.factory import make_recognizer_checkpoint

    root = tmp_path_factory.mktemp("asr-fastpaths")
    return load(make_recognizer_checkpoint(root / "small", "small", seed=1))


def _convs(encoder):
    layers = [l for l in encoder.pre_encode.conv if isinstance(l, nn.Conv2d)]
    for layer in encoder.layers:
        layers += [layer.conv.pointwise_conv1, layer.conv.pointwise_conv2]
    return layers


@pytest.mark.parametrize("which", ["asr", "voicechat"])
def test_asr_encoder_convs_equal_the_conv_layers(recognizer, medium, monkeypatch, which):
    """Each subsampling conv and pointwise conv as products, against the layer itself (the
    weights column-major where marked, as loaded); then the whole subsampling and a layer's
    convolution module on two rows."""
    from mlx_voicechat.fastpaths import conv_products

    enc = recognizer.encoder if which == "asr" else medium.stt_model.perception.encoder
    set_fastpath(monkeypatch, "encoder.convs", True)
    convs = _convs(enc)
    assert all(conv_products.applies(c) for c in convs) and len(convs) > 6
    key = mx.random.key(12)
    mel = mx.random.normal((2, 8 * 9 + 1, enc.cfg.feat_in), key=key)
    x = mel[..., None]
    sub = enc.pre_encode
    for i, layer in enumerate(sub.conv):
        if i in sub._strided_idx:
            pad = (sub.pad_left, sub.pad_right)
            x = mx.pad(x, [(0, 0), pad, pad, (0, 0)])
        _same([conv_products.conv(layer, x)], [conv_products.plain(layer, x)])
        x = layer(x)

    def both(fn):
        set_fastpath(monkeypatch, "encoder.convs", True)
        fast = fn()
        set_fastpath(monkeypatch, "encoder.convs", False)
        plain = fn()
        set_fastpath(monkeypatch, "encoder.convs", True)
        _same(fast, plain)

    both(lambda: [sub(mel)[0]])
    h = mx.random.normal((2, 14, enc.cfg.d_model), key=mx.random.key(13))
    both(lambda: list(enc.layers[0].conv(h)))
    if which == "asr":
        mel_len = mx.array([mel.shape[1], mel.shape[1] - 21])
        both(lambda: [enc.subsample(mel, 0, mel_len)])


def test_asr_mel_bands_equal_the_filterbank_product(recognizer, monkeypatch):
    """The banded filterbank products against the whole product (power @ fb), bit for bit,
    for a live chunk's frames, one frame and an offline block; and a batch of clips."""
    front = recognizer.frontend
    rng = np.random.default_rng(14)
    for frames in (112, 1, 409):
        n = front.hop * (frames - 1) + front.n_fft
        seg = mx.array((0.1 * rng.standard_normal(n)).astype(np.float32))
        set_fastpath(monkeypatch, "asr.mel", True)
        fast = front.frames(seg)
        set_fastpath(monkeypatch, "asr.mel", False)
        _same([fast], [front.frames(seg)])
    wave = mx.array((0.1 * rng.standard_normal((2, 9000))).astype(np.float32))
    lengths = mx.array([9000, 7001])
    set_fastpath(monkeypatch, "asr.mel", True)
    fast = front(wave, lengths)
    set_fastpath(monkeypatch, "asr.mel", False)
    _same(list(fast), list(front(wave, lengths)))


@pytest.mark.parametrize("which", ["asr", "voicechat"])
def test_asr_lstm_step_equals_mlx_audio_lstm_per_row(recognizer, medium, which):
    """One token per row through the prediction network: its LSTM as a loaded model has it
    (``fastpaths.layout.ColumnLSTM``, column-major weights) against mlx-audio's LSTM on the same
    weights row-major, outputs and both states, for three rows from different states, and
    each row alone; and a sequence (teacher forcing)."""
    from mlx_voicechat.fastpaths.layout import ColumnLSTM
    from mlx_voicechat.listen.rnnt import RNNTDecoder

    decoder = recognizer.decoder if which == "asr" else medium.stt_model.rnnt_decoder
    rnn = decoder.prediction["dec_rnn"]
    L, H = rnn.num_layers, rnn.hidden_size
    assert all(type(layer) is ColumnLSTM for layer in rnn.lstm)  # as loaded
    plain = RNNTDecoder(recognizer.config.decoder if which == "asr" else medium.config.audio_config.decoder)
    copies = tree_map(lambda a: mx.array(np.ascontiguousarray(a)), decoder.parameters())  # row-major
    plain.update(copies)
    assert all(type(layer) is nn.LSTM for layer in plain.prediction["dec_rnn"].lstm)
    h = mx.random.normal((L, 3, H), key=mx.random.key(15))
    c = mx.random.normal((L, 3, H), key=mx.random.key(16))
    y = mx.array([3, 0, 11], dtype=mx.int32)
    out, (h2, c2) = decoder.step(y, (h, c))
    ref, (h3, c3) = plain.step(y, (h, c))
    _same([out, h2, c2], [ref, h3, c3])
    for b in range(3):
        one, (h4, c4) = decoder.step(y[b : b + 1], (h[:, b : b + 1], c[:, b : b + 1]))
        _same([one, h4, c4], [out[b : b + 1], h2[:, b : b + 1], c2[:, b : b + 1]])
    labels = mx.array([[3, 0, 11, 5, 7]], dtype=mx.int32)
    seq, (h5, c5) = decoder.predict(labels)
    ref, (h6, c6) = plain.predict(labels)
    _same([seq, h5, c5], [ref, h6, c6])
