"""EAR-TTS's compiled sampling (``EarTTS.generate_codes``) gives the op-by-op path's codes.

The op-by-op path is the one checked against NeMo's recorded MoG calls (tests/nemotron_voicechat/nets/test_tts.py,
which wraps ``MoGHead.infer`` and so takes it); here the compiled one is held to it, bit for
bit, on the tiny random model with its CPU weight layout."""

import threading

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from fastpath_utils import set_fastpath

from mlx_voicechat import load
from mlx_voicechat.derived import reset_derived
from mlx_voicechat.nemotron_voicechat.nets.mog import CodeSampler, MoGHead
from mlx_voicechat.noise import KeyNoise, ReplayNoise, gumbel_from_uniform
from mlx_voicechat.threads import note_mlx_thread


def _hiddens(tts, n, seed=0):
    """Random backbone outputs ``[2, T, H]`` at a few scales and lengths."""
    rng = np.random.default_rng(seed)
    H = tts.cfg.hidden_size
    return [
        mx.array(rng.standard_normal((2, 1 + i % 3, H)).astype(np.float32) * (0.3, 1.0, 3.0)[i % 3])
        for i in range(n)
    ]


def _calls(tts):
    return sum(1 for c in tts.cfg.mask_schedule() if c)


def _replay(tts, draws, seed):
    """A replay source of ``draws`` MoG calls' worth of random Gumbel and normal rows."""
    rng = np.random.default_rng(seed)
    u = rng.uniform(size=(draws, tts.cfg.mog_head.num_predictions)).astype(np.float32)
    gumbel = np.array(gumbel_from_uniform(mx.array(u)))
    normal = rng.standard_normal((draws, tts.cfg.latent_size)).astype(np.float32)
    return ReplayNoise(gumbel, normal)


def _codes(tts, hidden, noise, fused, monkeypatch):
    set_fastpath(monkeypatch, "tts.sampling", fused)
    out = tts.generate_codes(hidden, noise)
    mx.eval(out)
    return np.array(out)


@pytest.mark.parametrize("source", ["key", "replay"])
def test_fused_codes_equal_op_by_op(tiny, source, monkeypatch):
    tts = tiny.tts_model.tts_model
    hiddens = _hiddens(tts, 40, seed=1)
    if source == "key":
        fast_noise, ref_noise = KeyNoise(7), KeyNoise(7)
    else:
        fast_noise, ref_noise = (_replay(tts, _calls(tts) * len(hiddens), 2) for _ in range(2))
    compiled = []
    real = CodeSampler.draw_noise  # what only the compiled path calls, once per call
    monkeypatch.setattr(
        CodeSampler, "draw_noise", lambda self, *a: compiled.append(1) or real(self, *a)
    )
    seen = set()
    for h in hiddens:
        fast = _codes(tts, h, fast_noise, True, monkeypatch)
        ref = _codes(tts, h, ref_noise, False, monkeypatch)
        np.testing.assert_array_equal(fast, ref)
        assert fast.shape == (1, tts.cfg.num_quantizers) and fast.dtype == np.int32
        seen.add(fast.tobytes())
    assert len(compiled) == len(hiddens)  # every fast call took the compiled path
    assert len(seen) == len(hiddens)  # the inputs reach different codes
    if source == "key":
        assert mx.array_equal(fast_noise.key, ref_noise.key).item()  # the same draws were taken
    else:
        assert fast_noise.used == ref_noise.used == (len(hiddens) * _calls(tts),) * 2


def test_fused_sampling_follows_weights_changed_after_first_use(tiny_checkpoints, monkeypatch):
    """After a first compiled call, one change at a time: updated head weights, replaced
    codebooks, a replaced ``embed_code`` module, quantized MLP layers. Each changes the codes,
    and the compiled path follows it."""
    tts = load(tiny_checkpoints["mlx-community"]).tts_model.tts_model
    head = tts.mog_head
    hiddens = _hiddens(tts, 8, seed=3)
    rng = np.random.default_rng(4)

    def run(fused):
        return [_codes(tts, h, KeyNoise(i), fused, monkeypatch) for i, h in enumerate(hiddens)]

    def new_embed_code():
        code = nn.Linear(tts.cfg.latent_size, tts.cfg.hidden_size, bias=False)
        code.weight = mx.array(rng.standard_normal(code.weight.shape).astype(np.float32) * 0.5)
        tts.embed_code = code

    changes = {
        "head weights": lambda: head.update({"proj_logits": {"weight": head.proj_logits.weight * 3}}),
        "codebooks": lambda: setattr(tts, "rvq_embs", tts.rvq_embs[:, ::-1] * 1.5),
        "embed_code module": new_embed_code,
        "quantized MLP": lambda: nn.quantize(
            head,
            group_size=32,
            bits=4,
            class_predicate=lambda path, m: isinstance(m, nn.Linear) and "mlp_stack" in path,
        ),
    }
    before = run(True)
    for name, change in changes.items():
        change()
        reset_derived(tts)
        after = run(True)
        for a, r in zip(after, run(False)):
            np.testing.assert_array_equal(a, r, err_msg=name)
        assert not all(np.array_equal(a, b) for a, b in zip(after, before)), name
        before = after
    assert isinstance(head.mlp_stack[0].mlp.gate_proj, nn.QuantizedLinear)


def test_fused_sampling_from_other_threads(tiny, monkeypatch):
    """MLX keeps compiled traces per thread: threads starting at once, each tracing while the
    others run the same modules, get the first caller's codes."""
    tts = tiny.tts_model.tts_model
    hiddens = _hiddens(tts, 6, seed=5)
    main = [_codes(tts, h, KeyNoise(i), True, monkeypatch) for i, h in enumerate(hiddens)]
    results, errors = {}, []
    start = threading.Barrier(3)

    def work(name):
        note_mlx_thread()
        try:
            start.wait()
            out = []
            for i, h in enumerate(hiddens):
                out.append(np.array(tts.generate_codes(h, KeyNoise(i))))
                mx.eval(tts.embed_codes(mx.array(out[-1])))  # the same modules, eagerly
            results[name] = out
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(n,)) for n in "abc"]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    for name in "abc":
        for a, b in zip(results[name], main):
            np.testing.assert_array_equal(a, b)


def test_fused_sampling_runs_bf16_weights(tiny_checkpoints, monkeypatch):
    tts = load(tiny_checkpoints["mlx-community"]).tts_model.tts_model
    tts.set_dtype(mx.bfloat16)
    assert tts.mog_head.proj_logits.weight.dtype == mx.bfloat16
    for i, h in enumerate(_hiddens(tts, 8, seed=6)):
        fast = _codes(tts, h, KeyNoise(i), True, monkeypatch)
        np.testing.assert_array_equal(fast, _codes(tts, h, KeyNoise(i), False, monkeypatch))
        assert fast.min() >= 0 and fast.max() < tts.cfg.codebook_size


def test_an_overridden_infer_sees_every_call(tiny, monkeypatch):
    """The compiled path inlines ``MoGHead.infer``; a wrapped one is called once per MoG draw
    with real arrays (what tests/nemotron_voicechat/nets/test_tts.py's recording relies on), with the same codes."""
    tts = tiny.tts_model.tts_model
    h = _hiddens(tts, 1, seed=7)[0]
    plain = _codes(tts, h, KeyNoise(1), True, monkeypatch)
    calls = []
    original = MoGHead.infer

    def recording(self, x, guidance_scale, top_p, noise):
        calls.append(np.array(x))
        return original(self, x, guidance_scale, top_p, noise)

    monkeypatch.setattr(MoGHead, "infer", recording)
    wrapped = _codes(tts, h, KeyNoise(1), True, monkeypatch)
    np.testing.assert_array_equal(wrapped, plain)
    assert len(calls) == _calls(tts)
    assert calls[0].shape == (2, 1, tts.cfg.hidden_size)
