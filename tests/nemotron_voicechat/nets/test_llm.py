"""The dual-head Nemotron-H on fused inputs against NeMo (oracle 02), float32."""

import json

import mlx.core as mx
import numpy as np
import pytest
from oracle_utils import ORACLE, strip_prefix

from mlx_voicechat.config import VoiceChatConfig
from mlx_voicechat.nemotron_voicechat.model import STTModel
from mlx_voicechat.nemotron_voicechat.weights.sanitize import sanitize_module

TOL = 1e-4


def _err(a, b):
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


@pytest.fixture(scope="module")
def stt():
    # 02's stt weights are 04's; the nvidia-layout config describes that model.
    cfg = VoiceChatConfig.from_dict(
        json.loads((ORACLE / "nvidia-layout" / "config.json").read_text())
    )
    model = STTModel(cfg)
    w = mx.load(str(ORACLE / "02_stt_llm.safetensors"))
    parts = {
        "perception": strip_prefix(w, "stt_model.perception."),
        "llm": strip_prefix(w, "stt_model.llm."),
        "embed_tokens": strip_prefix(w, "stt_model.embed_tokens."),
        "lm_head": strip_prefix(w, "stt_model.lm_head."),
        "function_head": strip_prefix(w, "glue.function_head."),
    }
    for name, weights in parts.items():
        module = getattr(model, name)
        module.load_weights(list(sanitize_module(module, weights).items()), strict=True)
    mx.eval(model.parameters())
    return model, cfg, dict(np.load(ORACLE / "02_stt_llm_io.npz"))


def _fused(model, io):
    E = model.embed_tokens
    return (
        E(mx.array(io["prev_text"]))
        + mx.array(io["audio_channel"])
        + 2.0 * E(mx.array(io["prev_function"]))
    )


def test_fused_embeddings(stt):
    model, _, io = stt
    assert _err(_fused(model, io), io["fused_embeds"]) < TOL


def _mask(layer):
    return "causal" if layer.block_type == "*" else None


@pytest.mark.parametrize("kind", ["-", "*"])
def test_mlp_and_attention_layers_in_isolation(stt, kind):
    """Each MLP / attention layer on NeMo's input of that layer reproduces its output."""
    model, _, io = stt
    ref = io["llm_hidden_states_per_layer"]
    checked = 0
    for i, layer in enumerate(model.llm.layers[:-1]):
        if layer.block_type == kind:
            assert _err(layer(mx.array(ref[i]), mask=_mask(layer), cache=None), ref[i + 1]) < TOL
            checked += 1
    assert checked


# Without the dt floor at time_step_min (config.text_args) the Mamba layers drift by ~3e-3.
def test_every_layer_and_heads(stt):
    model, _, io = stt
    ref = io["llm_hidden_states_per_layer"]
    h = mx.array(io["fused_embeds"])
    assert len(model.llm.layers) == ref.shape[0] - 1
    for i, layer in enumerate(model.llm.layers):
        h = layer(h, mask=_mask(layer), cache=None)
        if i < len(model.llm.layers) - 1:
            assert _err(h, ref[i + 1]) < TOL, f"layer {i}"
    hidden = model.llm(mx.array(io["fused_embeds"]))
    assert _err(hidden, ref[-1]) < TOL
    assert _err(hidden, io["llm_last_hidden_post_norm_f"]) < TOL
    assert _err(model.lm_head(hidden), io["text_logits"]) < TOL
    assert _err(model.function_head(hidden), io["function_logits_glue"]) < TOL


def test_heads_on_nemo_hidden(stt):
    model, _, io = stt
    h = mx.array(io["llm_last_hidden_post_norm_f"])
    assert _err(model.lm_head(h), io["text_logits"]) < TOL
    assert _err(model.function_head(h), io["function_logits_glue"]) < TOL


def test_cached_one_position_at_a_time_equals_full(stt):
    model, _, io = stt
    x = mx.array(io["fused_embeds"])
    full = model.llm(x)
    cache = model.llm.make_cache()
    first = model.llm(x[:, :5], cache)  # a prefilled prefix, then one position per call
    rows = [first] + [model.llm(x[:, t : t + 1], cache) for t in range(5, x.shape[1])]
    assert _err(mx.concatenate(rows, axis=1), full) < 1e-5


def test_perception_and_offline_greedy_tokens(stt):
    """NeMo's offline loop (function weight 0): prompt on the audio channel, greedy text."""
    model, cfg, io = stt
    proj, lengths, _ = model.perception(mx.array(io["wav"]))
    F = int(lengths[0])
    assert F == int(io["perception_len"][0]) == 14
    assert _err(proj[:, :F], io["perception_proj"]) < TOL

    E = model.embed_tokens
    pad = cfg.pad_token_id
    prompt = io["prompt_tokens"][0].tolist()
    cache = model.llm.make_cache()
    prefix = E(mx.array([prompt])) + E(mx.array([[pad]]))
    x = mx.concatenate([prefix, E(mx.array([[pad]])) + proj[:, :1]], axis=1)
    ids = []
    for t in range(F):
        h = model.llm(x, cache)[:, -1]
        ids.append(int(mx.argmax(model.lm_head(h), axis=-1).item()))
        if t + 1 < F:
            x = E(mx.array([[ids[-1]]])) + proj[:, t + 1 : t + 2]
    assert ids == io["offline_tokens_text"][0].tolist()
