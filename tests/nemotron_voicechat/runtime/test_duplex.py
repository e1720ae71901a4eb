"""The duplex loop: NeMo replay (oracle 04), cached vs full history, seeds, timeline shape."""

import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from oracle_utils import replay_04

from mlx_voicechat.nemotron_voicechat.runtime.framestate import open_state, warmup_codes
from mlx_voicechat.nemotron_voicechat.runtime.generate import listen
from mlx_voicechat.nemotron_voicechat.runtime.request import resolve
from mlx_voicechat.nemotron_voicechat.runtime.step import step
from mlx_voicechat.noise import KeyNoise

SPF = 1764  # samples per 80 ms frame at 22.05 kHz


@pytest.fixture(scope="module")
def replay(nvidia):
    out, noise, _ = replay_04(nvidia)
    return out, noise


def test_replay_text_codes_and_transcript(replay, io04):
    out, noise = replay
    P = io04["prompt_tokens"].shape[1]
    assert out.text_ids == io04["tokens_text"][0].tolist()
    # errata 10: our frames are NeMo's frames P.. (its prompt frames stay in its output)
    assert out.codes.shape == (14, 31)
    assert np.array_equal(out.codes, io04["gen_codes"][0, P:])
    assert noise.used == (io04["noise_gumbel"].shape[0], io04["noise_randn"].shape[0])
    assert out.user_transcript == str(io04["rnnt_text"])
    assert out.sample_rate == 22050


def test_replay_audio_on_aligned_frames(replay, nvidia, io04):
    """NeMo decodes all 19 frames (prompt included), we decode our 14. The codec's causal
    convolutions see the prompt frames' codes for the first aligned frames, so those differ;
    past that receptive field the aligned audio matches. And our codec on NeMo's full code
    sequence gives NeMo's audio everywhere."""
    out, _ = replay
    P = io04["prompt_tokens"].shape[1]
    nemo = io04["audio"][0]
    assert out.audio.shape == (14 * SPF,) and out.audio.dtype == np.float32
    codec = nvidia.tts_model.audio_codec
    ours_on_nemo_codes = np.array(codec.decode(mx.array(io04["gen_codes"][:, P:]))[0])
    assert np.max(np.abs(out.audio - ours_on_nemo_codes)) < 1e-6
    full = np.array(codec.decode(mx.array(io04["gen_codes"]))[0])
    assert np.max(np.abs(full - nemo)) < 1e-4
    per_frame = np.abs(out.audio - nemo[P * SPF :]).reshape(-1, SPF).max(axis=1)
    assert np.all(per_frame[3:] < 1e-4), per_frame


# --- tiny factory checkpoint ---------------------------------------------------------------


def _wave(seconds, seed=1):
    rng = np.random.default_rng(seed)
    return (0.1 * rng.standard_normal(int(seconds * 16000))).astype(np.float32)


def test_no_prompt_frame0_is_silence_and_length(tiny):
    out = tiny.generate(_wave(0.5), system_prompt="", extra_decoding_seconds=0.3, seed=0)
    F = len(out.text_ids)
    assert F == len(out.function_ids) == out.codes.shape[0] == out.frames
    assert out.audio.shape == (F * SPF,)
    assert np.array_equal(out.codes[0], np.array(tiny.tts_model.codec_silence_tokens))
    assert np.all(np.isfinite(out.audio))


def _full_history(model, wave, prompt, seed):
    """The timeline recomputed from scratch every frame: no LLM or TTS cache."""
    cfg = model.config
    pad, w = cfg.pad_token_id, cfg.function_channel_weight
    stt, speech = model.stt_model, model.tts_model
    tts = speech.tts_model
    E = lambda ids: stt.embed_tokens(mx.array([ids]))
    proj, _, F = listen(model, wave, 0.0)
    noise = KeyNoise(seed)
    silence = speech.codec_silence_tokens
    latent = speech.audio_prompt_latents[cfg.speaker]
    init = warmup_codes(model)
    tts_rows = [tts.warmup_inputs(latent, init)]
    prev = init[:, -1]
    rows = [E(prompt) + E([pad]) + w * E([pad])] if prompt else []

    def tts_step(text_id, prev):
        tts_rows.append(tts.step_inputs(text_id, prev, silence))
        hidden = tts.backbone(mx.concatenate(tts_rows, axis=1), None)
        return tts.generate_codes(hidden, noise)

    for _ in range(1, len(prompt)):
        prev = tts_step(pad, prev)
    text, fn, codes = pad, pad, []
    ids = []
    for i in range(F):
        rows.append(E([text]) + proj[:, i : i + 1] + w * E([fn]))
        h = stt.llm(mx.concatenate(rows, axis=1))[:, -1:]
        text = int(mx.argmax(stt.lm_head(h), axis=-1).item())
        fn = int(mx.argmax(stt.function_head(h), axis=-1).item())
        ids.append((text, fn))
        if len(prompt) + i == 0:
            codes.append(np.array(silence))
            continue
        prev = tts_step(text, prev)
        codes.append(np.array(prev[0]))
    return ids, np.stack(codes)


@pytest.mark.parametrize("prompt", [[], [1, 45, 67, 2]])
def test_cached_timeline_equals_full_history(tiny, prompt):
    wave = _wave(4.9)  # 61 frames
    out = tiny.generate(wave, prompt=prompt, extra_decoding_seconds=0.0, seed=3)
    assert out.frames >= 60
    ids, codes = _full_history(tiny, wave, prompt, seed=3)
    assert list(zip(out.text_ids, out.function_ids)) == ids
    assert np.array_equal(out.codes, codes)


def test_step_advances_one_position(tiny):
    proj, _, F = listen(tiny, _wave(0.4), 0.0)
    state = open_state(tiny, resolve(tiny, prompt=[1, 45, 2], seed=0))
    assert state.position == [3] and state.prefix is not None
    out = step(tiny, state, proj[:, :1])
    assert state.position == [4] and state.prefix is None
    assert out.codes.shape == (1, tiny.config.tts_config.num_quantizers)


def test_same_seed_same_bytes_different_seed_other_codes(tiny, tmp_path):
    wave = _wave(0.8)
    a = tiny.generate(wave, system_prompt="", extra_decoding_seconds=0.2, seed=7)
    b = tiny.generate(wave, system_prompt="", extra_decoding_seconds=0.2, seed=7)
    c = tiny.generate(wave, system_prompt="", extra_decoding_seconds=0.2, seed=8)
    a.save(tmp_path / "a.wav")
    b.save(tmp_path / "b.wav")
    assert (tmp_path / "a.wav").read_bytes() == (tmp_path / "b.wav").read_bytes()
    assert a.text_ids == b.text_ids and np.array_equal(a.codes, b.codes)
    assert not np.array_equal(a.codes[1:], c.codes[1:])


def test_same_seed_across_processes(tiny_checkpoints, tmp_path):
    import soundfile as sf

    sf.write(tmp_path / "q.wav", _wave(0.8), 16000)
    script = (
        "import sys; from mlx_voicechat import load; m = load(sys.argv[1]); "
        "r = m.generate(sys.argv[2], system_prompt='', extra_decoding_seconds=0.2, seed=5); "
        "r.save(sys.argv[3]); "
        "print(r.text_ids)"
    )
    outs = []
    for name in ("p1.wav", "p2.wav"):
        res = subprocess.run(
            [
                sys.executable,
                "-c",
                script,
                str(tiny_checkpoints["mlx-community"]),
                str(tmp_path / "q.wav"),
                str(tmp_path / name),
            ],
            capture_output=True,
            text=True,
            cwd=Path(__file__).resolve().parents[3],
            timeout=300,
        )
        assert res.returncode == 0, res.stderr
        outs.append(res.stdout)
    assert outs[0] == outs[1]
    assert (tmp_path / "p1.wav").read_bytes() == (tmp_path / "p2.wav").read_bytes()
