"""EAR-TTS against NeMo 3.0.0 (oracle file 03, float32, tiny random weights)."""

import json

import mlx.core as mx
import numpy as np
import pytest
from oracle_utils import ORACLE
from tokenizers import Tokenizer

from mlx_voicechat.config import VoiceChatConfig
from mlx_voicechat.nemotron_voicechat.nets.mog import MoGHead, top_p_filter
from mlx_voicechat.nemotron_voicechat.nets.tts import EarTTS
from mlx_voicechat.nemotron_voicechat.weights.sanitize import sanitize_module
from mlx_voicechat.noise import KeyNoise, ReplayNoise

TOL = 1e-4
PREFIX = "tts_model.tts_model."


def max_err(a, b):
    return float(np.max(np.abs(np.array(a, dtype=np.float64) - np.asarray(b, dtype=np.float64))))


@pytest.fixture(scope="module")
def io():
    return dict(np.load(ORACLE / "03_ear_tts_codec_io.npz"))


@pytest.fixture(scope="module")
def weights():
    return mx.load(str(ORACLE / "03_ear_tts_codec.safetensors"))


@pytest.fixture(scope="module")
def config():
    run = json.loads((ORACLE / "03_ear_tts_codec_config.json").read_text())["cfg"]
    text = json.loads((ORACLE / "tiny-Nemotron-H" / "config.json").read_text())
    return VoiceChatConfig.from_dict(
        {"model": {"stt": {"model": {}}, "speech_generation": run}, "text_config": text}
    )


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_file(str(ORACLE / "tiny-Nemotron-H" / "tokenizer.json"))


@pytest.fixture(scope="module")
def model(config, weights, tokenizer):
    vocab = config.text_args.vocab_size
    m = EarTTS(config.tts_config, vocab, config.eos_token_id, config.pad_token_id)
    w = {k[len(PREFIX):]: v for k, v in weights.items() if k.startswith(PREFIX)}
    m.load_weights(list(sanitize_module(m, w).items()), strict=True)
    m.set_vocabulary(tokenizer)
    return m


def test_mask_schedule_matches_oracle(config):
    counts = [c for c in config.tts_config.mask_schedule() if c]
    assert counts == [1, 1, 3, 4, 22]  # README convention 6: 5 MoG calls per step


def test_depthsum_embed_code_and_fusion(model, io):
    codes = mx.array(io["depthsum_codes"])
    assert (io["depthsum_codes"] == model.cfg.codebook_size).any()  # the mask index is exercised
    ds = model.depthsum(codes)
    assert max_err(ds, io["depthsum_out"]) < TOL
    emb = model.embed_codes(codes)
    assert max_err(emb, io["embed_code_out"]) < TOL
    text = mx.array(io["cas_out"][:, :5])
    fused = model.gated_fusion_audio_text(mx.array(io["embed_code_out"]), text)
    assert max_err(fused, io["fusion_out"]) < TOL


def test_prepare_init_codes(model, io):
    init = io["init_code"]
    fake = np.concatenate([init, init[:, -2:-1]], axis=1).copy()
    fake[:, 0] = 7
    fake[:, -2] = 9
    out = EarTTS.prepare_init_codes(mx.array(fake), model.cfg.codebook_size)
    np.testing.assert_array_equal(np.array(out), init)


def test_warmup_inputs(model, io):
    x = model.warmup_inputs(mx.array(io["init_audio_prompt_lantent"]), mx.array(io["init_code"]))
    assert max_err(x, io["backbone_warmup_inputs_embeds"]) < TOL


def _run_steps(model, io, host_ids, monkeypatch):
    """Warm-up then the 18 recorded steps with replayed noise; returns what to compare."""
    calls = []
    original = MoGHead.infer

    def recording_infer(self, x, guidance_scale, top_p, noise):
        feats = self.features(x)
        calls.append((x, feats, self.proj_logits(self.guided(feats, guidance_scale))))
        return original(self, x, guidance_scale, top_p, noise)

    monkeypatch.setattr(MoGHead, "infer", recording_infer)
    cache = model.make_cache()
    latent, init = mx.array(io["init_audio_prompt_lantent"]), mx.array(io["init_code"])
    warm_hidden = model.backbone(model.warmup_inputs(latent, init), cache)
    prev = init[:, -1]
    noise = ReplayNoise(io["noise_gumbel"], io["noise_randn"])
    silence = mx.array(io["codec_silence_tokens"])
    step_in, step_hidden, codes = [], [], []
    for t in io["step_text_ids"].tolist():
        text_id = t if host_ids else mx.array([t])
        x = model.step_inputs(text_id, prev, silence)
        h = model.backbone(x, cache)
        prev = model.generate_codes(h, noise)
        mx.eval(prev)
        step_in.append(x)
        step_hidden.append(h)
        codes.append(prev)
    return warm_hidden, step_in, step_hidden, codes, calls, noise


@pytest.mark.parametrize("host_ids", [True, False], ids=["host-ids", "device-ids"])
def test_warmup_and_steps_match_nemo(model, io, weights, host_ids, monkeypatch):
    from mlx_voicechat.nemotron_voicechat.nets.codec import replace_control_codes

    run = _run_steps(model, io, host_ids, monkeypatch)
    warm_hidden, step_in, step_hidden, codes, calls, noise = run
    assert max_err(warm_hidden, io["backbone_warmup_hidden"]) < TOL
    assert max_err(warm_hidden, io["warmup_hidden_states"]) < TOL
    assert max_err(mx.concatenate(step_in, axis=1), io["backbone_step_inputs_embeds"]) < TOL
    assert max_err(mx.concatenate(step_hidden, axis=1), io["backbone_step_hidden"]) < TOL

    assert len(calls) == io["mog_calls_mlp_in"].shape[0] == 90
    assert max_err(mx.stack([c[0] for c in calls]), io["mog_calls_mlp_in"]) < TOL
    assert max_err(mx.stack([c[1] for c in calls]), io["mog_calls_mlp_out"]) < TOL
    assert max_err(mx.stack([c[2] for c in calls]), io["mog_calls_raw_logits"]) < TOL
    assert noise.used == (90, 90)

    got = np.array(mx.stack(codes, axis=1))
    np.testing.assert_array_equal(got, io["gen_codes"])
    control = weights["tts_model._control_codes"]
    np.testing.assert_array_equal(np.array(control), [66, 65, 64])  # speech bos, eos, pad
    replaced = replace_control_codes(mx.array(got), control, mx.array(io["codec_silence_tokens"]))
    np.testing.assert_array_equal(np.array(replaced), io["gen_codes_after_control_replace"])


def test_step_api_reproduces_codes(model, io):
    """The public warmup/step loop gives the recorded codes (EOS step included)."""
    cache = model.make_cache()
    prev, cache = model.warmup(
        mx.array(io["init_audio_prompt_lantent"]), mx.array(io["init_code"]), cache
    )
    assert (np.array(prev) == model.cfg.codebook_size).all()
    noise = ReplayNoise(io["noise_gumbel"], io["noise_randn"])
    silence = mx.array(io["codec_silence_tokens"])
    out = []
    for t in io["step_text_ids"].tolist():
        prev, cache = model.step(mx.array(t), prev, cache, noise, silence)
        out.append(prev)
    np.testing.assert_array_equal(np.array(mx.stack(out, axis=1)), io["gen_codes"])


def test_top_p_keeps_the_largest_and_drops_the_tail():
    logits = mx.array([[0.0, 10.0, -5.0, 1.0]])
    out = np.array(top_p_filter(logits, 0.95))
    assert out[0, 1] == 10.0 and np.isinf(out[0, [0, 2, 3]]).all()
    flat = np.array(top_p_filter(mx.zeros((1, 4)), 0.95))  # cum probs .25 .5 .75 1: none <= .05
    assert np.isfinite(flat).all()


def test_key_noise_is_private_and_seeded():
    mx.random.seed(123)
    a = mx.random.uniform(shape=(4,))
    mx.random.seed(123)
    n1, n2, n3 = KeyNoise(5), KeyNoise(5), KeyNoise(6)
    g1, g2, g3 = n1.gumbel((1, 1, 8)), n2.gumbel((1, 1, 8)), n3.gumbel((1, 1, 8))
    b = mx.random.uniform(shape=(4,))
    assert np.array_equal(np.array(a), np.array(b))  # the global generator was not advanced
    assert np.array_equal(np.array(g1), np.array(g2))
    assert not np.array_equal(np.array(g1), np.array(g3))
    assert not np.array_equal(np.array(n1.normal((8,))), np.array(n1.normal((8,))))


def test_replay_noise_runs_out_with_a_clear_error():
    noise = ReplayNoise(np.zeros((1, 4), np.float32), np.zeros((1, 4), np.float32))
    noise.gumbel((1, 1, 4))
    with pytest.raises(RuntimeError, match="used up"):
        noise.gumbel((1, 1, 4))
    with pytest.raises(ValueError, match="shape"):
        noise.normal((1, 1, 5))


def test_seeded_steps_are_reproducible_per_session(model, io):
    def run(seed):
        cache = model.make_cache()
        prev, cache = model.warmup(
            mx.array(io["init_audio_prompt_lantent"]), mx.array(io["init_code"]), cache
        )
        noise, silence = KeyNoise(seed), mx.array(io["codec_silence_tokens"])
        out = []
        for t in (20, 100, 2):
            prev, cache = model.step(t, prev, cache, noise, silence)
            out.append(np.array(prev))
        return np.stack(out)

    a, b, c = run(0), run(0), run(1)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    assert a.min() >= 0 and a.max() < model.cfg.codebook_size
