"""The streaming session: exact to offline for any chunking, minimal latency, one read per
frame, fast open, threads, bad input, long sessions, barge-in."""

import threading

import mlx.core as mx
import numpy as np
import pytest

from mlx_voicechat import load
from mlx_voicechat.errors import VoiceChatError
from mlx_voicechat.fastpaths import heads
from mlx_voicechat.nemotron_voicechat.runtime import framestate, step
from mlx_voicechat.nemotron_voicechat.runtime.generate import listen as generate_listen
from mlx_voicechat.nemotron_voicechat.runtime.session import SessionError
from mlx_voicechat.noise import ReplayNoise


def _noise(io):
    return ReplayNoise(io["noise_gumbel"], io["noise_randn"])


@pytest.fixture(scope="module")
def offline04(nvidia, io04):
    return nvidia.generate(
        io04["wav"][0],
        prompt=io04["prompt_tokens"][0].tolist(),
        extra_decoding_seconds=0.0,
        noise=_noise(io04),
    )


def _run(session, wave, chunks, extra=0.0, rate=None):
    events, i = [], 0
    for n in chunks:
        events += session.feed(wave[i : i + n], sample_rate=rate)
        i += n
    assert i >= len(wave)
    events += session.finish(extra)
    return events


def _chunks(total, size):
    return [size] * (total // size + 1)


def _random_chunks(total, seed):
    rng = np.random.default_rng(seed)
    out = []
    while sum(out) < total:
        out.append(int(rng.choice([0, 1, 7, 160, 999, 1280, 3001, 6000])))
    return out


def _same_as_offline(events, off):
    frames = [e for e in events if not e.remainder]
    assert all(e.remainder for e in events[len(frames) :])  # only the very last one may be
    assert [e.index for e in frames] == list(range(len(off.text_ids)))
    assert [e.text_id for e in frames] == off.text_ids
    assert [e.function_id for e in frames] == off.function_ids
    assert np.array_equal(np.stack([e.codes for e in frames]), off.codes)
    assert "".join(e.transcript for e in events) == off.user_transcript
    assert "".join(e.text for e in events) == off.text
    assert "".join(e.function_text for e in events) == off.function_text
    audio = np.concatenate([e.audio for e in events])
    assert all(e.audio.shape == (1764,) for e in events[:-1])
    assert audio.shape == (off.audio.shape[0] + 6,)  # the codec's fixed delay
    assert np.max(np.abs(audio[6:] - off.audio)) <= 1e-6
    assert np.all(audio[:6] == 0)


@pytest.mark.parametrize("size", [1, 160, 1279, 1280, 1281, 4000])
def test_oracle04_any_chunking_equals_offline(nvidia, io04, offline04, size):
    wave = io04["wav"][0]
    s = nvidia.session(prompt=io04["prompt_tokens"][0].tolist(), noise=_noise(io04))
    _same_as_offline(_run(s, wave, _chunks(len(wave), size)), offline04)


def _int16(wave):
    return np.clip(np.round(wave * 32768), -32768, 32767).astype(np.int16)


@pytest.fixture(scope="module")
def offline04_int16(nvidia, io04):
    """Oracle 04 on an int16 copy of its audio, given to generate as the floats it stands for."""
    return nvidia.generate(
        _int16(io04["wav"][0]).astype(np.float32) / 32768,
        prompt=io04["prompt_tokens"][0].tolist(),
        extra_decoding_seconds=0.0,
        noise=_noise(io04),
    )


@pytest.mark.parametrize("seed, int16", [(0, False), (1, True)])
def test_oracle04_random_chunks_and_int16(nvidia, io04, offline04, offline04_int16, seed, int16):
    wave = io04["wav"][0]
    if int16:  # fed as int16 samples: the session scales them by 1/32768
        wave, offline04 = _int16(wave), offline04_int16
        assert wave.dtype == np.int16
    s = nvidia.session(prompt=io04["prompt_tokens"][0].tolist(), noise=_noise(io04))
    _same_as_offline(_run(s, wave, _random_chunks(len(wave), seed)), offline04)


# --- tiny factory model ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tiny_checkpoints):
    return load(tiny_checkpoints["mlx-community"])


def _wave(seconds, seed=1):
    rng = np.random.default_rng(seed)
    return (0.1 * rng.standard_normal(int(seconds * 16000))).astype(np.float32)


@pytest.fixture(scope="module")
def tiny_offline(tiny):
    return tiny.generate(_wave(1.3), system_prompt="Be brief.", extra_decoding_seconds=0.5, seed=3)


def test_tiny_prompt_seed_and_trailing_silence_equal_offline(tiny, tiny_offline):
    wave = _wave(1.3)
    s = tiny.session("Be brief.", seed=3)
    _same_as_offline(_run(s, wave, _random_chunks(len(wave), 5), extra=0.5), tiny_offline)
    s.reset()  # a new conversation from the post-prompt state gives the same again
    _same_as_offline(_run(s, wave, _chunks(len(wave), 1280), extra=0.5), tiny_offline)


def test_split_text_head_gives_the_same_frames(tiny_checkpoints, monkeypatch):
    """The session's text head split across two streams (as on the CPU for a 131072-row
    quantized head) changes nothing: the session still equals offline, whose head is one call."""
    model = load(tiny_checkpoints["mlx-community-4bit"])
    wave = _wave(1.3)
    off = model.generate(wave, system_prompt="Be brief.", extra_decoding_seconds=0.5, seed=3)
    monkeypatch.setattr(heads, "SPLIT_MIN_ROWS", 1)
    splits = []
    real = heads.greedy_id
    monkeypatch.setattr(
        step, "greedy_id", lambda lin, h, split=None: splits.append(split) or real(lin, h, split)
    )
    s = model.session("Be brief.", seed=3)
    _same_as_offline(_run(s, wave, _chunks(len(wave), 1280), extra=0.5), off)
    assert any(sp is not None for sp in splits)


def test_second_session_starts_from_the_first_ones_state(tiny, tiny_offline, monkeypatch):
    calls = []
    real = framestate.chain_state
    monkeypatch.setattr(framestate, "chain_state", lambda *a, **k: calls.append(1) or real(*a, **k))
    wave = _wave(1.3)
    for _ in range(2):
        s = tiny.session("Be brief.", seed=3)
        _same_as_offline(_run(s, wave, _chunks(len(wave), 4000), extra=0.5), tiny_offline)
    assert calls == []  # the fixture's session already computed this prompt's state
    tiny.session("Another prompt.", seed=3)
    tiny.session("Be brief.", seed=4)
    assert len(calls) == 2


def test_frame_k_comes_out_once_1280k_plus_199_samples_are_in(tiny):
    wave = _wave(0.5)
    for size in (1, 32):
        s = tiny.session("", seed=0)
        assert s.ready_before_slot_end == 1081 and s.samples_needed(2) == 2759
        seen = {}
        for i in range(0, len(wave), size):
            for e in s.feed(wave[i : i + size]):
                seen[e.index] = i + size  # samples in when the frame came out
        assert len(seen) == 7
        for k, n in seen.items():
            need = 1280 * k + 199
            assert need <= n < need + size, (k, n, size)


def test_one_host_read_per_frame(tiny, sync_count):
    wave = _wave(2.0)
    s = tiny.session("Hi there.", seed=0)
    s.feed(wave[:1280])  # frame 0 (the prompt's prefill)
    count = sync_count
    count[0] = 0
    before = s.frames
    events = s.feed(wave[1280 : 1280 * 12])
    n = s.frames - before
    assert len(events) == n >= 9
    # One read per frame: its decisions with the previous frame's audio, the last frame's
    # read also its own, so that feed hands out every frame's speech.
    assert count[0] == n
    count[0] = 0
    one = s.feed(wave[1280 * 12 : 1280 * 13])
    assert len(one) == 1 and count[0] == 1
    assert one[0].audio.shape == (1764,)
    count[0] = 0
    assert s.feed(wave[1280 * 13 : 1280 * 13 + 100]) == [] and count[0] == 0


@pytest.mark.parametrize("split", [False, True])
def test_a_fresh_model_reads_once_per_frame_from_its_first_frame(
    tiny_checkpoints, sync_count, monkeypatch, split
):
    """Nothing the first frames prepare (compiled steps, the codec's step weights) makes a
    host sync of its own once the session is open, with or without a split text head."""
    if split:
        monkeypatch.setattr(heads, "SPLIT_MIN_ROWS", 1)
    model = load(tiny_checkpoints["mlx-community-4bit" if split else "mlx-community"])
    wave = _wave(0.6)
    s = model.session("Hi there.", seed=0)
    sync_count[0] = 0
    for k in range(6):
        assert len(s.feed(wave[1280 * k : 1280 * (k + 1)])) == 1
        assert sync_count[0] == k + 1


def test_bad_input_is_one_clear_error_and_the_session_goes_on(tiny):
    s = tiny.session("", seed=0)
    wave = _wave(0.3)
    bad = [
        (np.array([0.1, np.nan]), None, "finite"),
        (np.array([0.0, np.inf]), None, "finite"),
        (np.zeros((3, 400)), None, "1-D"),
        (np.array(["a"]), None, "numbers"),
        (wave, 0, "sample_rate"),
        (wave, -16000, "sample_rate"),
        (wave, 1.5, "sample_rate"),
    ]
    for samples, rate, word in bad:
        with pytest.raises(SessionError, match=word):
            s.feed(samples, sample_rate=rate)
    with pytest.raises(SessionError, match="frames"):
        s.silence(-1)
    with pytest.raises(SessionError, match="extra_decoding_seconds"):
        s.finish(float("nan"))
    assert len(s.feed(wave)) == 4  # still usable
    assert issubclass(SessionError, VoiceChatError)
    s.close()
    with pytest.raises(SessionError, match="closed"):
        s.feed(wave)


def test_silence_and_other_rates(tiny):
    s = tiny.session("", seed=0)
    assert len(s.silence(4)) == 4  # frame 3 is final 1081 samples before its slot ends
    s = tiny.session("", seed=0)
    x16 = (np.clip(_wave(0.6), -1, 1) * 32767).astype(np.int16)
    a = _run(s, x16, [len(x16)])
    b = _run(tiny.session("", seed=0), x16.astype(np.float32) / 32768.0, [len(x16)])
    assert [e.text_id for e in a] == [e.text_id for e in b]
    # 24 kHz in: a stateful resampler, so chunk joins leave no seam
    x24 = _wave(0.9, seed=4)
    one = _run(tiny.session("", seed=0), x24, [len(x24)], rate=24000)
    many = _run(tiny.session("", seed=0), x24, _random_chunks(len(x24), 2), rate=24000)
    assert [e.text_id for e in one] == [e.text_id for e in many]
    assert np.array_equal(np.stack([e.codes for e in one]), np.stack([e.codes for e in many]))
    assert len(one) == 9  # 0.6 s: 7 frames in time, 2 more at the end of input


def test_max_seconds_ends_the_session_cleanly(tiny):
    s = tiny.session("", seed=0, max_seconds=0.4)  # 5 frames
    events = s.feed(_wave(2.0))
    assert len(events) == 5 and events[-1].end == "max_seconds"
    assert all(e.end is None for e in events[:-1])
    assert events[-1].audio.shape == (1764 + 6,)
    with pytest.raises(SessionError, match="max_seconds"):
        s.feed(_wave(0.1))
    s.reset()
    assert len(s.feed(_wave(0.3))) == 4
    per_minute = s.memory_per_minute()
    assert per_minute["llm_kv"] > 0 and per_minute["tts_global_kv"] > 0


def test_cancel_feeds_silence_until_a_new_turn(tiny):
    cfg = tiny.config
    s = tiny.session("", seed=0)
    s.feed(_wave(0.3))
    s.cancel()
    events = s.feed(_wave(0.5, seed=2))
    assert events and all(e.forced for e in events)
    assert all(e.text_id in (cfg.silence_token_id, cfg.bos_token_id) for e in events)
    assert all(e.text == "" for e in events)
    # forced ids are what the next frame's LLM reads back
    s.force(text_id=cfg.pad_token_id, function_id=5)
    (e,) = s.feed(_wave(0.08, seed=3))
    assert e.forced and e.function_id == 5 and e.text_id in (cfg.pad_token_id, cfg.bos_token_id)
    with pytest.raises(SessionError, match="forced ids"):
        s.force(text_id=cfg.text_args.vocab_size)


def test_two_sessions_in_two_threads_equal_alone(tiny, tiny_offline):
    """Each thread's session has its own input, prompt and seed and equals its own offline
    run: a session that used the other's state would not."""
    jobs = {"a": (_wave(1.3), "Be brief.", 3), "b": (_wave(1.1, seed=5), "Say more.", 8)}
    offline = {"a": tiny_offline}
    offline["b"] = tiny.generate(
        jobs["b"][0], system_prompt="Say more.", extra_decoding_seconds=0.5, seed=8
    )
    assert offline["a"].codes.shape[1:] == offline["b"].codes.shape[1:]
    assert not np.array_equal(offline["a"].codes[:5], offline["b"].codes[:5])
    results, errors = {}, []

    def work(name):
        wave, prompt, seed = jobs[name]
        try:
            s = tiny.session(prompt, seed=seed)
            results[name] = _run(s, wave, _chunks(len(wave), 1280), extra=0.5)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(n,)) for n in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    for name in jobs:
        _same_as_offline(results[name], offline[name])
    wave = jobs["a"][0]
    # a session made here and fed from another thread
    s = tiny.session("Be brief.", seed=3)
    box = []
    t = threading.Thread(target=lambda: box.append(_run(s, wave, [len(wave)], extra=0.5)))
    t.start()
    t.join(timeout=120)
    _same_as_offline(box[0], tiny_offline)


def test_pending_samples_and_argument_checks(tiny):
    s = tiny.session("", seed=0)
    assert s.pending_samples == 0
    s.feed(np.zeros(2600, np.float32))  # frames 0 and 1 (1280 k + 199 <= 2600)
    assert s.frames == 2 and s.pending_samples == 2600 - 2 * 1280
    s.feed(np.zeros(200, np.float32))  # frame 2 is final before its slot ends
    assert s.frames == 3 and s.pending_samples == 0
    with pytest.raises(SessionError, match="forced ids"):
        s.force(text_id=True)
    with pytest.raises(SessionError, match="max_seconds"):
        tiny.session("", max_seconds=True)


@pytest.mark.parametrize("extra", [0, 1])
def test_end_of_input_that_makes_no_new_frame(tiny, extra):
    """When the end of input adds no frame (about one length in ten), finish() still hands out
    the codec's last samples and the held-back transcript and text, on a remainder event."""
    n = 1280 * 9 + 199 + extra * 100  # every frame is final before finish()
    wave = _wave(n / 16000, seed=7)[:n]
    off = tiny.generate(wave, system_prompt="", extra_decoding_seconds=0.0, seed=1)
    s = tiny.session("", seed=1)
    events = s.feed(wave)
    assert len(events) == off.frames
    tail = s.finish(0.0)
    assert len(tail) == 1 and tail[0].remainder and tail[0].index == off.frames - 1
    assert tail[0].codes.shape == (0,) and tail[0].audio.shape == (6,)
    _same_as_offline(events + tail, off)



def test_barge_in_across_frames_queued_before_a_read_equals_one_frame_per_feed(tiny, sync_count):
    """A feed of several frames queues each one before reading the one before: a barge-in is
    a device flag, so it ends (BOS fed back) at the same frame as when every frame is read
    before the next is queued; one host read per frame either way."""
    cfg = tiny.config
    wave = _wave(1.6, seed=4)
    marks = (5120, 10240, 15360)

    def run(size):
        s = tiny.session("Hi.", seed=1)
        events, at = [], 0
        sync_count[0] = 0
        for end, action in zip(marks + (len(wave),), ("cancel", "bos", "cancel", None)):
            for i in range(at, end, size):
                events += s.feed(wave[i : min(i + size, end)])
            at = end
            if action == "cancel":
                s.cancel()
            elif action == "bos":
                s.force(text_id=cfg.bos_token_id)  # ends the barge-in
        assert sync_count[0] == len(events)
        events += s.finish(0.2)
        return [(e.index, e.text_id, e.function_id, e.forced, e.turn) for e in events]

    one, many = run(1280), run(5120)
    assert one == many
    quiet = [e for e in one if 4 <= e[0] < 8]
    assert quiet and all(e[3] and e[1] in (cfg.silence_token_id, cfg.bos_token_id) for e in quiet)
    assert one[8][1] == cfg.bos_token_id and one[8][3]


def test_fed_from_two_threads_in_turn(tiny, tiny_offline):
    """Every array a call leaves for the next is scheduled, the Mamba layers' states too (an
    array left lazy belongs to the streams of the thread that made it)."""
    wave = _wave(1.3)
    s = tiny.session("Be brief.", seed=3)
    events, errors = [], []

    def feed(part):
        try:
            events.extend(s.feed(part))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    for i, n in enumerate(_chunks(len(wave), 1280)):
        part = wave[1280 * i : 1280 * i + n]
        if i % 2:
            t = threading.Thread(target=feed, args=(part,))
            t.start()
            t.join()
        else:
            events += s.feed(part)
    assert not errors, errors
    events += s.finish(0.5)
    s.close()
    _same_as_offline(events, tiny_offline)


def test_a_burst_of_rnnt_tokens_comes_out_with_its_frame(tiny_checkpoints, sync_count):
    """A joint crafted to emit a token at every step: each frame has max_symbols tokens, and
    all of them come out with the frame's own event, read from the device once per frame (the
    frame's greedy symbols run there), equal to the offline transcript's frames."""
    from mlx_voicechat.listen.greedy import greedy_decode

    model = load(tiny_checkpoints["mlx-community"])
    joint = model.stt_model.rnnt_joint
    last = joint.joint_net[-1]
    bias = mx.zeros(last.bias.shape).at[3].add(50.0)
    joint.update({"joint_net": [{} for _ in joint.joint_net[:-1]] + [{"bias": bias}]})
    wave = _wave(0.9, seed=9)
    s = model.session("", seed=0)
    per_frame = []
    for i in range(0, len(wave), 1280):
        before = len(s.transcript_tokens)
        sync_count[0] = 0
        events = s.feed(wave[i : i + 1280])
        assert sync_count[0] == len(events)  # one read per frame, however many tokens
        for e in events:
            per_frame.append((e.index, len(s.transcript_tokens) - before))
            before = len(s.transcript_tokens)
    _, encoded, F = generate_listen(model, wave)
    tokens, frames = greedy_decode(
        model.stt_model.rnnt_decoder, joint, encoded, F, joint.blank_id, model.config.audio_config.max_symbols
    )
    cap = model.config.audio_config.max_symbols
    assert cap > 1 and all(n == cap for _, n in per_frame)
    assert s.transcript_tokens == tokens[: len(s.transcript_tokens)]
    assert [k for k, n in per_frame for _ in range(n)] == frames[: len(s.transcript_tokens)]
