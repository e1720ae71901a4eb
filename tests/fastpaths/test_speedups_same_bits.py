"""Speed-ups of a loaded (tiny) checkpoint give the plain path's bits: the CPU weight layout
(column-major float32 weights), the LLM's and the TTS backbone's single-position steps in
float32, bfloat16 and 4-bit and after the weights change, and the pipelined offline loop on
two streams. (``test_fastpaths.py`` checks each entry of the fast-path registry against its
mlx-lm / mlx-audio anchor at the medium scale.)"""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from fastpath_utils import set_fastpath
from mlx.utils import tree_flatten
from mlx_lm.models.cache import ArraysCache

from mlx_voicechat import load
from mlx_voicechat.derived import reset_derived
from mlx_voicechat.fastpaths import layout
from mlx_voicechat.nemotron_voicechat.nets.llm import FusedNemotronH
from mlx_voicechat.nemotron_voicechat.runtime import generate as offline
from mlx_voicechat.nemotron_voicechat.runtime import step as frame_step
from mlx_voicechat.nemotron_voicechat.runtime.framestate import open_state
from mlx_voicechat.nemotron_voicechat.runtime.generate import generate
from mlx_voicechat.nemotron_voicechat.runtime.request import resolve


def _params(model):
    return dict(tree_flatten(model.parameters()))


def _plain(path):
    """The model as loaded, before any layout change."""
    return load(path, lazy=True)


def _wave(seconds, seed=0):
    rng = np.random.default_rng(seed)
    return (0.1 * rng.standard_normal(int(seconds * 16000))).astype(np.float32)


@pytest.fixture(scope="module")
def tiny_pair(tiny_checkpoints):
    return load(tiny_checkpoints["mlx-community"]), _plain(tiny_checkpoints["mlx-community"])


def test_cpu_layout_keeps_every_parameter(tiny_pair):
    fast, plain = tiny_pair
    assert getattr(fast, "_cpu_layout_done", False)
    assert not getattr(plain, "_cpu_layout_done", False)
    a, b = _params(fast), _params(plain)
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].shape == b[k].shape and a[k].dtype == b[k].dtype, k
        assert mx.array_equal(a[k], b[k]).item(), k


def test_cpu_layout_moves_float_linears_once(tiny_checkpoints):  # and LSTMs
    model = _plain(tiny_checkpoints["mlx-community"])
    linears = [
        m for _, m in model.named_modules()
        if type(m) is nn.Linear and not getattr(m, "_keep_row_major", False)
    ]
    # and the pointwise convolutions multiplied as matrices (nets.conv_products)
    pointwise = [m for _, m in model.named_modules() if getattr(m, "_cpu_layout_matrix", False)]
    assert pointwise and all(isinstance(m, (nn.Conv1d, nn.Conv2d)) for m in pointwise)
    lstms = [m for _, m in model.named_modules() if type(m) is nn.LSTM]  # Wx and Wh each
    assert lstms
    assert layout.use_cpu_layout(model) == len(linears) + len(pointwise) + 2 * len(lstms) > 10
    assert layout.use_cpu_layout(model) == 0  # once


def test_cpu_layout_turns_the_marked_convs_into_product_convs(tiny_checkpoints):
    """The encoders' convolutions run as products because the layout swapped their class at
    load; nothing else is swapped, and the network's code calls the layer plainly."""
    from mlx_voicechat.fastpaths import conv_products

    model = _plain(tiny_checkpoints["mlx-community"])
    marked = [m for _, m in model.named_modules() if getattr(m, conv_products.PRODUCTS, False)]
    assert len(marked) > 4 and all(type(m) in (nn.Conv1d, nn.Conv2d) for m in marked)
    layout.use_cpu_layout(model)
    swapped = [m for _, m in model.named_modules() if type(m).__name__.startswith("ProductConv")]
    assert {id(m) for m in swapped} == {id(m) for m in marked}
    assert all(type(m) in (conv_products.ProductConv1d, conv_products.ProductConv2d) for m in marked)


def test_cpu_layout_leaves_quantized_and_half_precision(tiny_checkpoints):
    q = _plain(tiny_checkpoints["mlx-community-4bit"])
    float_linears = [
        m for _, m in q.named_modules() if type(m) is nn.Linear and m.weight.dtype == mx.float32
        and not getattr(m, "_keep_row_major", False)
        or getattr(m, "_cpu_layout_matrix", False) and m.weight.dtype == mx.float32
    ]
    lstms = [m for _, m in q.named_modules() if type(m) is nn.LSTM and m.Wx.dtype == mx.float32]
    assert layout.use_cpu_layout(q) == len(float_linears) + 2 * len(lstms)
    half = _plain(tiny_checkpoints["mlx-community"])
    half.set_dtype(mx.bfloat16)
    assert layout.use_cpu_layout(half) == 0


def test_cpu_layout_saves_the_same_tensors(tiny_pair, tmp_path):
    fast, plain = tiny_pair
    mx.save_safetensors(str(tmp_path / "fast.safetensors"), _params(fast))
    back = mx.load(str(tmp_path / "fast.safetensors"))
    for k, v in _params(plain).items():
        assert mx.array_equal(back[k], v).item(), k


def test_cpu_layout_generates_the_same_bytes(tiny_pair):
    fast, plain = tiny_pair
    wave = _wave(1.2)
    a = generate(fast, wave, "Hi there.", extra_decoding_seconds=0.4, seed=5)
    plain_before = getattr(plain, "_cpu_layout_done", False)
    object.__setattr__(plain, "_cpu_layout_done", True)  # keep it row-major for this run
    try:
        b = generate(plain, wave, "Hi there.", extra_decoding_seconds=0.4, seed=5)
    finally:
        object.__setattr__(plain, "_cpu_layout_done", plain_before)
    assert a.text_ids == b.text_ids and a.function_ids == b.function_ids
    assert np.array_equal(a.codes, b.codes)
    assert np.array_equal(a.audio, b.audio)


@pytest.mark.parametrize("variant", ["float32", "bfloat16", "4bit"])
def test_llm_step_equals_mlx_lm_scan(tiny_checkpoints, variant, monkeypatch):
    """One token at a time through FusedNemotronH.step: the same bits as mlx-lm's SSD scan,
    outputs and every cache entry."""
    path = tiny_checkpoints["mlx-community-4bit" if variant == "4bit" else "mlx-community"]
    model = load(path)
    if variant == "bfloat16":
        model.set_dtype(mx.bfloat16)
    llm = model.stt_model.llm
    H = model.config.text_args.hidden_size
    dtype = mx.bfloat16 if variant == "bfloat16" else mx.float32
    x = mx.random.normal((1, 9, H), key=mx.random.key(7)).astype(dtype)

    def run(use_step):
        set_fastpath(monkeypatch, "llm.step", use_step)
        cache = llm.make_cache()
        outs = [llm(x[:, :4], cache)] + [llm(x[:, t : t + 1], cache) for t in range(4, 9)]
        mx.eval(outs)
        states = []
        for c in cache:
            if isinstance(c, ArraysCache):
                states += c.cache
            else:
                states += [c.keys[..., : c.offset, :], c.values[..., : c.offset, :]]
        return outs, states

    (o1, s1), (o2, s2) = run(False), run(True)
    assert len(s1) == len(s2) > 0
    for a, b in zip(o1 + s1, o2 + s2):
        assert a.shape == b.shape and mx.array_equal(a, b).item()


def test_llm_step_waits_for_a_filled_cache(tiny_checkpoints, monkeypatch):
    """Without a prompt the first frame meets empty Mamba states: mlx-lm's path runs it."""
    model = load(tiny_checkpoints["mlx-community"])
    llm = model.stt_model.llm
    calls = []
    orig = FusedNemotronH.step
    monkeypatch.setattr(FusedNemotronH, "step", lambda *a: calls.append(1) or orig(*a))
    x = mx.random.normal((1, 3, model.config.text_args.hidden_size), key=mx.random.key(2))
    cache = llm.make_cache()
    for t in range(3):
        llm(x[:, t : t + 1], cache)
    assert len(calls) == 2


def test_pipelined_loop_without_prompt_equals_unpipelined(tiny_pair, monkeypatch):
    """Lookahead 2 with the TTS on its own stream against lookahead 1 on one stream."""
    fast, _ = tiny_pair
    frames = mx.random.normal((1, 7, fast.config.text_args.hidden_size), key=mx.random.key(4))
    def state():
        return open_state(fast, resolve(fast, prompt=[], seed=1))

    a_ids, a_codes, _ = offline.run_frames(fast, state(), frames)
    monkeypatch.setattr(offline, "LOOKAHEAD", 1)
    monkeypatch.setattr(frame_step, "speech_stream", lambda: mx.default_stream(mx.default_device()))
    b_ids, b_codes, _ = offline.run_frames(fast, state(), frames)
    assert a_ids == b_ids
    for x, y in zip(a_codes, b_codes):
        assert np.array_equal(np.array(x), np.array(y))


def test_llm_step_follows_weights_changed_after_first_use(tiny_checkpoints, monkeypatch):
    """The compiled segments read the blocks' current parameters: quantizing the LLM after a
    first step changes the step's result, and it still equals mlx-lm's path."""
    model = load(tiny_checkpoints["mlx-community"])
    llm = model.stt_model.llm
    x = mx.random.normal((1, 6, model.config.text_args.hidden_size), key=mx.random.key(3))

    def run(use_step):
        set_fastpath(monkeypatch, "llm.step", use_step)
        cache = llm.make_cache()
        outs = [llm(x[:, :3], cache)] + [llm(x[:, t : t + 1], cache) for t in range(3, 6)]
        mx.eval(outs)
        return outs

    before = run(True)
    nn.quantize(
        llm, group_size=32, bits=4,
        class_predicate=lambda _, m: isinstance(m, nn.Linear) and m.weight.shape[-1] % 32 == 0,
    )
    reset_derived(llm)
    after, scan = run(True), run(False)
    assert not all(mx.array_equal(a, b).item() for a, b in zip(before, after))
    assert all(mx.array_equal(a, b).item() for a, b in zip(after, scan))


def _tts_steps(model, steps=12, seed=5):
    """The TTS backbone over its warm-up and ``steps`` single positions: outputs and caches."""
    tts = model.tts_model.tts_model
    H = model.config.tts_config.hidden_size
    x = mx.random.normal((2, 6 + steps, H), key=mx.random.key(seed))
    x = x.astype(tts.backbone.norm.weight.dtype)
    cache = tts.make_cache()
    outs = [tts.backbone(x[:, :6], cache)]
    outs += [tts.backbone(x[:, t : t + 1], cache) for t in range(6, 6 + steps)]
    states = [a for c in cache for a in (c.keys[..., : c.offset, :], c.values[..., : c.offset, :])]
    mx.eval(outs, states)
    return outs, states


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_tts_backbone_step_equals_layer_by_layer(tiny_checkpoints, dtype, monkeypatch):
    """Backbone.step (compiled segments between the caches, RoPE offset as an array): the same
    bits as the layers one by one, past the tiny model's sliding window (16)."""
    from mlx_voicechat.nemotron_voicechat.nets.tts_backbone import Backbone

    model = load(tiny_checkpoints["mlx-community"])
    model.set_dtype(dtype)
    calls = []
    orig = Backbone.step
    monkeypatch.setattr(Backbone, "step", lambda *a: calls.append(1) or orig(*a))
    fast = _tts_steps(model, steps=24)
    assert len(calls) == 24
    set_fastpath(monkeypatch, "tts.backbone_step", False)
    plain = _tts_steps(model, steps=24)
    assert len(calls) == 24
    for a, b in zip(fast[0] + fast[1], plain[0] + plain[1]):
        assert a.shape == b.shape and mx.array_equal(a, b).item()


def test_tts_backbone_step_follows_weights_changed_after_first_use(tiny_checkpoints, monkeypatch):
    model = load(tiny_checkpoints["mlx-community"])
    before = _tts_steps(model)[0]
    bb = model.tts_model.tts_model.backbone
    bb.layers[2].update({"mlp": {"down_proj": {"weight": bb.layers[2].mlp.down_proj.weight * 2}}})
    reset_derived(bb)
    after = _tts_steps(model)[0]
    set_fastpath(monkeypatch, "tts.backbone_step", False)
    plain = _tts_steps(model)[0]
    assert not mx.array_equal(before[-1], after[-1]).item()
    assert all(mx.array_equal(a, b).item() for a, b in zip(after, plain))
