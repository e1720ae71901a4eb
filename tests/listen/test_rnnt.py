"""Listening path back half: RNNT prediction / joint networks, greedy loop, pieces, transcribe."""

import argparse
import json

import mlx.core as mx
import numpy as np
import pytest
from oracle_utils import ORACLE, load_module, strip_prefix

from mlx_voicechat.audio.io import AudioError
from mlx_voicechat.cli import transcribe as transcribe_verb
from mlx_voicechat.config import AudioConfig, VoiceChatConfig
from mlx_voicechat.derived import reset_derived
from mlx_voicechat.listen.greedy import GreedyDecoder, greedy_decode, transducer
from mlx_voicechat.listen.rnnt import RNNTDecoder, RNNTJoint, decode_pieces
from mlx_voicechat.listen.transcribe import TranscriptResult, transcribe
from mlx_voicechat.nemotron_voicechat.nets.perception import Perception

NVIDIA = ORACLE / "nvidia-layout"


@pytest.fixture(scope="module")
def rnnt01():
    cfg = json.loads((ORACLE / "01_perception_rnnt_config.json").read_text())
    audio = AudioConfig.from_dict({"decoder": cfg["rnnt_decoder"], "joint": cfg["rnnt_joint"]})
    weights = mx.load(str(ORACLE / "01_perception_rnnt.safetensors"))
    decoder = load_module(RNNTDecoder(audio.decoder), strip_prefix(weights, "rnnt_decoder."))
    joint = load_module(
        RNNTJoint(audio.joint), strip_prefix(weights, "rnnt_joint.")
    )  # joint_net.1 -> .2
    io = dict(np.load(ORACLE / "01_perception_rnnt_io.npz"))
    encoded = mx.array(io["encoder_out_bdt"].transpose(0, 2, 1))
    return decoder, joint, encoded, io


@pytest.fixture(scope="module")
def nvidia():
    cfg = VoiceChatConfig.from_dict(json.loads((NVIDIA / "config.json").read_text()))
    weights = mx.load(str(NVIDIA / "model.safetensors"))
    perception = load_module(
        Perception(cfg.audio_config), strip_prefix(weights, "stt_model.perception.")
    )
    decoder = load_module(
        RNNTDecoder(cfg.audio_config.decoder), strip_prefix(weights, "stt_model.rnnt_decoder.")
    )
    joint = load_module(
        RNNTJoint(cfg.audio_config.joint), strip_prefix(weights, "stt_model.rnnt_joint.")
    )
    vocab = json.loads((NVIDIA / "rnnt_tokenizer" / "vocab.json").read_text())
    return cfg, perception, decoder, joint, vocab, dict(np.load(ORACLE / "04_voicechat_e2e_io.npz"))


class CountingDecoder:
    """Wraps a prediction network and counts its calls."""

    def __init__(self, decoder):
        self.decoder, self.calls = decoder, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.decoder(*args, **kwargs)


def reference_greedy(decoder, joint, encoded, blank, max_symbols):
    """NeMo's GreedyRNNTInfer loop as written: the prediction reruns at every step."""
    enc = encoded[0]
    tokens, frames, state, last = [], [], None, None
    for t in range(enc.shape[0]):
        for _ in range(max_symbols):
            y = None if last is None else mx.array([[last]])
            out, new_state = decoder(y, state)
            k = int(mx.argmax(joint(enc[None, t : t + 1], out)[0, 0, 0]).item())
            if k == blank:
                break
            tokens.append(k)
            frames.append(t)
            state, last = new_state, k
    return tokens, frames


def test_greedy_matches_nemo_01(rnnt01):
    decoder, joint, encoded, io = rnnt01
    assert joint.blank_id == 40  # errata 15: the joint's last output
    tokens, frames = greedy_decode(decoder, joint, encoded, int(io["encoder_len"][0]), 40, 10)
    assert tokens == io["rnnt_greedy_tokens"].tolist()
    assert frames == io["rnnt_greedy_timestamps"].tolist()
    assert max(np.bincount(frames)) == 10  # the max-symbols bound is exercised


def test_prediction_network_matches_nemo(rnnt01):
    decoder, _, _, io = rnnt01
    out, (h, c) = decoder.predict(mx.array(io["rnnt_tf_labels"]))
    assert out.shape == io["rnnt_pred_seq"].shape
    assert float(mx.abs(out - mx.array(io["rnnt_pred_seq"])).max()) < 1e-5
    assert h.shape == c.shape == (2, 1, 32)
    # Step by step with the carried state gives the same sequence.
    state, steps = None, []
    for label in [None] + io["rnnt_tf_labels"][0].tolist():
        step, state = decoder(None if label is None else mx.array([[label]]), state)
        steps.append(step)
    assert float(mx.abs(mx.concatenate(steps, axis=1) - out).max()) < 1e-5


def test_joint_matches_nemo(rnnt01):
    decoder, joint, encoded, io = rnnt01
    pred = mx.array(io["rnnt_pred_seq"])
    raw = joint(encoded, pred)
    assert raw.shape == io["rnnt_joint_raw"].shape
    assert float(mx.abs(raw - mx.array(io["rnnt_joint_raw"])).max()) < 1e-4
    logp = raw - mx.logsumexp(raw, axis=-1, keepdims=True)
    assert float(mx.abs(logp - mx.array(io["rnnt_joint_logprobs"])).max()) < 1e-4


def _decoded_row(decoder, joint, encoded, max_symbols):
    """One utterance through the device decoder: its row (tokens, frames, steps, forced)."""
    T = encoded.shape[1]
    d = GreedyDecoder(transducer(decoder, joint, 40, max_symbols), 1)
    d.push(joint.project_encoder(encoded))
    (row,) = d.run([T])
    return row, T


def test_decoder_takes_nemos_steps(rnnt01):
    """The device decoder's steps (joint evaluations that count) are NeMo's loop's, one per
    prediction-network call there: its tokens plus one blank per frame not ended by the cap."""
    decoder, joint, encoded, _ = rnnt01
    for max_symbols in (10, 3):
        row, T = _decoded_row(decoder, joint, encoded, max_symbols)
        counted = CountingDecoder(decoder)
        want = reference_greedy(counted, joint, encoded, 40, max_symbols)
        assert (row.tokens, row.frames) == want
        assert row.steps == counted.calls
        assert row.steps + row.forced == len(row.tokens) + T
        assert row.forced == int((np.bincount(row.frames) == max_symbols).sum()) > 0


@pytest.mark.parametrize("max_symbols", [1, 2, 5, 10])
def test_greedy_equals_reference_loop(rnnt01, max_symbols):
    decoder, joint, encoded, _ = rnnt01
    want = reference_greedy(decoder, joint, encoded, 40, max_symbols)
    for window in (1, 4, 16):
        assert greedy_decode(decoder, joint, encoded, None, 40, max_symbols, window) == want
    assert max(np.bincount(want[1])) <= max_symbols


def test_blank_only_frames_emit_nothing(rnnt01):
    decoder, joint, encoded, _ = rnnt01
    bias = joint.joint_net[-1].bias
    try:
        joint.joint_net[-1].bias = bias + mx.where(mx.arange(41) == 40, 1e4, 0.0)
        reset_derived(joint)
        assert greedy_decode(decoder, joint, encoded, None, 40, 10) == ([], [])
        row, T = _decoded_row(decoder, joint, encoded, 10)
        assert row.tokens == [] and row.steps == T and row.forced == 0
    finally:
        joint.joint_net[-1].bias = bias
        reset_derived(joint)


def test_length_limits_decoded_frames(rnnt01):
    decoder, joint, encoded, io = rnnt01
    tokens, frames = greedy_decode(decoder, joint, encoded[0], 5, 40, 10)  # [T, D] input too
    ref_frames = io["rnnt_greedy_timestamps"]
    assert frames == ref_frames[ref_frames < 5].tolist()
    assert tokens == io["rnnt_greedy_tokens"][ref_frames < 5].tolist()


def test_rnnt_04_from_nvidia_layout(nvidia):
    cfg, _, decoder, joint, vocab, io = nvidia
    assert cfg.load_rnnt_vocabulary(NVIDIA) == vocab
    tokens, frames = greedy_decode(
        decoder,
        joint,
        mx.array(io["asr_encoder_btd"]),
        int(io["asr_encoder_len"][0]),
        joint.blank_id,
        cfg.audio_config.max_symbols,
    )
    assert tokens == io["rnnt_greedy_tokens"].tolist()
    assert frames == io["rnnt_greedy_timestamps"].tolist()
    text, language = decode_pieces(tokens, vocab)
    assert text == str(io["rnnt_text"]) and language is None


def test_decode_pieces_filters_and_joins():
    vocab = [
        "<unk>",
        "<pad>",
        "<s>",
        "</s>",
        "<en-US>",
        "\u2581hel",
        "lo",
        "\u2581world",
        "<de-DE>",
        "\u2581",
    ]
    text, language = decode_pieces([4, 2, 5, 6, 0, 1, 7, 3, 9, 40], vocab)
    assert text == "hello world"
    assert language == "en-US"
    assert decode_pieces([8, 5, 4, 6], vocab) == ("hello", "en-US")  # the last tag wins
    assert decode_pieces([], vocab) == ("", None)


def test_transcribe_04_wave(nvidia):
    cfg, perception, decoder, joint, vocab, io = nvidia
    with pytest.warns(UserWarning, match="blank id 1024"):
        result = transcribe(perception, decoder, joint, vocab, 1024, 10, io["wav"][0], chunk_size=3)
    assert isinstance(result, TranscriptResult)
    assert result.tokens == io["rnnt_greedy_tokens"].tolist()
    assert result.frames == io["rnnt_greedy_timestamps"].tolist()
    assert result.text == str(io["rnnt_text"])
    t = result.timings
    assert t.audio_seconds == pytest.approx(1.0) and t.encoder_frames == 14
    assert min(t.mel_ms, t.encoder_ms, t.decode_ms) > 0 and t.rtf == pytest.approx(
        t.total_ms / 1000
    )


def test_transcribe_cli_helpers(nvidia, tmp_path, capsys):
    import soundfile as sf

    cfg, perception, decoder, joint, vocab, io = nvidia
    wav = tmp_path / "speech.wav"
    sf.write(wav, io["wav"][0], 16000, subtype="FLOAT")

    class Model:
        def transcribe(self, audio, chunk_size=None):
            return transcribe(
                perception, decoder, joint, vocab, None, 10, audio, chunk_size=chunk_size
            )

    parser = argparse.ArgumentParser(prog="mlx-voicechat")
    transcribe_verb.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["transcribe", "--model", "m", "--audio", str(wav), "--benchmark"])
    loaded = []
    assert transcribe_verb.run(args, lambda path: loaded.append(path) or Model()) == 0
    out = capsys.readouterr().out.splitlines()
    assert loaded == ["m"] and out[0] == str(io["rnnt_text"])
    for label in ("audio:", "mel:", "encoder:", "decode:", "RTF:"):
        assert any(line.startswith(label) for line in out), label

    args = parser.parse_args(
        ["transcribe", "--model", "m", "--audio", str(tmp_path / "missing.wav")]
    )
    # The CLI's main() turns the AudioError into one line and exit code 2 (tests/cli/test_cli.py).
    with pytest.raises(AudioError, match="audio file not found"):
        transcribe_verb.run(args, lambda path: pytest.fail("loads no model for bad audio"))
