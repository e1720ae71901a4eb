"""Offline duplex generation: mlx-voicechat against the other MLX ports, same checkpoint, same run.

    python benchmarks/bench_peers.py [--dir DIR] [--scales small,medium] [--seconds 16]
        [--long-seconds 36] [--profile-seconds 4] [--repeats 1] [--out BENCHMARKS.md]

Writes random-weight ``small`` / ``medium`` checkpoints with the factory (cached in ``--dir``),
then runs, each configuration in its own subprocess and alternating between them:
ours (``generate.generate``), mlx-vlm (mlx-community layout) and mlx-audio (mlx-audio layout),
the peers with and without their language cache (``use_language_cache``).

Per-frame ms is the median time between consecutive LLM calls (peers) or frames (ours) over a
plain run. The split into perception / LLM / TTS backbone / character encoder / MoG / codec
comes from a second, shorter run in which each piece is wrapped with an ``mx.eval`` barrier
(so it adds syncs the plain run does not have); perception and codec run once per input and
are reported per frame. Host syncs are counted by wrapping ``mx.eval`` and the ``mx.array``
methods that read values to the host (``item``, ``tolist``, ``__array__``, ``__int__``,
``__float__``, ``__bool__``, ``__index__``) during our frame loop.

Peers are driven through their public entry points with small, documented shims for what
they cannot read from our random checkpoints (see ``_peer_view``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "You are a helpful assistant. Answer briefly and kindly."
INPUT_RATE = 16000
EXTRA_SECONDS = 0.0  # trailing silence; the input already ends where we want it

LONG_WINDOW = 25  # frame i's cost: the median of frames i - 25 .. i + 24 (noise on a shared CPU)

PEER_LAYOUT = {"ours": "mlx-community", "mlx-vlm": "mlx-community", "mlx-audio": "mlx-audio"}


# --- worker side ---------------------------------------------------------------------------


def _arrays(obj):
    import mlx.core as mx

    if isinstance(obj, mx.array):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [a for o in obj for a in _arrays(o)]
    if isinstance(obj, dict):
        return [a for o in obj.values() for a in _arrays(o)]
    if dataclasses.is_dataclass(obj):
        return [a for f in dataclasses.fields(obj) for a in _arrays(getattr(obj, f.name))]
    return []


def _wrap_timed(cls, name, label, acc):
    """Wrap ``cls.name`` so each call is evaluated and timed into ``acc[label]``."""
    import mlx.core as mx

    orig = getattr(cls, name)

    def timed(*a, **k):
        t = time.perf_counter()
        out = orig(*a, **k)
        mx.eval(_arrays(out))
        acc.setdefault(label, []).append(time.perf_counter() - t)
        return out

    setattr(cls, name, timed)


class SyncCounter:
    NAMES = ("item", "tolist", "__array__", "__int__", "__float__", "__bool__", "__index__")

    def __init__(self):
        import mlx.core as mx

        self.count = 0
        self.active = False
        for n in self.NAMES:
            self._patch(mx.array, n)
        orig_eval = mx.eval

        def ev(*a, **k):
            if self.active:
                self.count += 1
            return orig_eval(*a, **k)

        mx.eval = ev

    def _patch(self, cls, n):
        orig = getattr(cls, n)

        def f(arr, *a, **k):
            if self.active:
                self.count += 1
            return orig(arr, *a, **k)

        setattr(cls, n, f)


def _load_audio(path):
    import numpy as np

    return np.load(path)


def _ms(xs):
    return 1000 * statistics.median(xs) if xs else float("nan")


def worker_ours(args) -> dict:
    import mlx.core as mx
    import numpy as np

    sys.path.insert(0, str(ROOT))
    import mlx_voicechat

    model = mlx_voicechat.load(args.ckpt)
    audio = _load_audio(args.audio)
    mode = args.mode
    if mode == "profile":
        return _profile_ours(model, audio)
    counter = SyncCounter() if mode == "plain" else None
    stamps, syncs = [], []

    def progress(done, total):
        stamps.append(time.perf_counter())
        if counter is not None:
            syncs.append(counter.count)
            if done == 1:
                counter.active = True  # frame 1's sync happened before the loop's first stamp
            if done == total:
                counter.active = False

    mx.reset_peak_memory()
    t = time.perf_counter()
    res = model.generate(audio, system_prompt=PROMPT, extra_decoding_seconds=EXTRA_SECONDS,
                         seed=0, progress=progress)
    wall = time.perf_counter() - t
    diffs = np.diff(stamps)
    out = {"frames": res.frames, "wall_s": wall, "frame_ms": 1000 * float(np.median(diffs)),
           "peak_mib": mx.get_peak_memory() / 2**20}
    if counter is not None and len(syncs) > 1:
        out["syncs_per_frame"] = (syncs[-1] - syncs[0]) / (len(syncs) - 1)
    if mode == "long":
        w = LONG_WINDOW
        out["frame_ms_at"] = {
            str(i): 1000 * float(np.median(diffs[max(0, i - w) : i + w]))
            for i in (50, 400) if i + w <= len(diffs)
        }
    return out


def _profile_ours(model, audio) -> dict:
    """The offline frame loop (the one frame step) with an eval barrier after each piece: the
    step's own functions wrapped with timers, so the profile runs the real step."""
    import mlx.core as mx

    from mlx_voicechat.nemotron_voicechat.nets.tts import EarTTS
    from mlx_voicechat.nemotron_voicechat.nets.tts_backbone import Backbone
    from mlx_voicechat.nemotron_voicechat.runtime import generate as offline
    from mlx_voicechat.nemotron_voicechat.runtime import step as frame_step
    from mlx_voicechat.nemotron_voicechat.runtime.framestate import open_state
    from mlx_voicechat.nemotron_voicechat.runtime.request import resolve

    acc = {}

    def timed(label, fn):
        def wrapped(*a, **k):
            t = time.perf_counter()
            out = fn(*a, **k)
            mx.eval(_arrays(out))
            acc.setdefault(label, []).append(time.perf_counter() - t)
            return out

        return wrapped

    projected, _, F = timed("perception", offline.listen)(model, audio, EXTRA_SECONDS)
    state = open_state(model, resolve(model, PROMPT, seed=0))
    mx.eval(state.arrays())
    tts = model.tts_model.tts_model
    hooks = [
        (frame_step, "_think", "llm"),
        (tts.embed_subword.__class__, "__call__", "char_encoder"),
        (EarTTS, "step_inputs", "tts_inputs"),
        (Backbone, "__call__", "tts_backbone"),
        (EarTTS, "generate_codes", "mog"),
    ]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in hooks]
    try:
        for owner, name, label in hooks:
            setattr(owner, name, timed(label, getattr(owner, name)))
        _, codes, _ = offline.run_frames(model, state, projected)
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)
    all_codes = mx.concatenate(codes, axis=0)[None]
    timed("codec", model.tts_model.audio_codec.decode)(all_codes)
    # the character encoder runs inside step_inputs: count it there once
    acc["tts_inputs"] = [a - b for a, b in zip(acc.get("tts_inputs", []), acc.get("char_encoder", []))]
    return _split(acc, F)


def _split(acc, frames) -> dict:
    per = lambda k: 1000 * sum(acc.get(k, [])) / frames  # noqa: E731
    out = {
        "perception": per("perception"),
        "llm": per("llm"),
        "char_encoder": per("char_encoder"),
        "mog": per("mog"),
        "codec": per("codec"),
    }
    if "tts_step" in acc:  # peers: the backbone is what the step spends outside the two
        out["tts_backbone"] = per("tts_step") - out["char_encoder"] - out["mog"]
    else:
        out["tts_backbone"] = per("tts_backbone") + per("tts_inputs")
    return out


def _peer_view(peer: str, src: Path, dst: Path) -> Path:
    """A folder the peer can read: links to the checkpoint's files plus shims, each for a
    reason found by running the peer on factory checkpoints:

    - mlx-audio looks the LLM config and tokenizer up by ``pretrained_llm`` (a hub id, offline
      here): point it at a local folder holding them. It also wraps ``att_context_size`` in one
      more list than NeMo's ``[[70, 0]]``, so give it the inner ``[70, 0]``.
    - mlx-vlm requires ``audio_prompt_projection_W`` (unused at inference; the factory's
      mlx-community layout omits it) and transposes every codec conv, including the decoder's
      last 1x1 conv that the factory writes in MLX layout: add / fix those tensors.
    """
    import mlx.core as mx

    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    cfg = json.loads((src / "config.json").read_text())
    for f in src.iterdir():
        if f.name not in ("config.json", "model.safetensors.index.json"):
            os.symlink(f.resolve(), dst / f.name)
    if "model" in cfg:  # NeMo-nested config (mlx-audio)
        llm = dst / "llm"
        llm.mkdir()
        (llm / "config.json").write_text(json.dumps(cfg["text_config"]))
        for n in ("tokenizer.json", "tokenizer_config.json"):
            os.symlink((src / n).resolve(), llm / n)
        stt = cfg["model"]["stt"]["model"]
        stt["pretrained_llm"] = str(llm)
        enc = stt["perception"]["encoder"]
        if enc["att_context_size"] and isinstance(enc["att_context_size"][0], list):
            enc["att_context_size"] = enc["att_context_size"][0]
        cfg.setdefault("model_type", "nemotron_voicechat")
    index = src / "model.safetensors.index.json"
    if index.exists():
        full = json.loads(index.read_text())
        wmap = full["weight_map"]
        fix = {}
        if peer == "mlx-vlm":
            key = "tts_model.tts_model.audio_prompt_projection_W"
            if key not in wmap:
                h = cfg["tts_config"]["hidden_size"]
                fix[key] = mx.zeros((h, h))
            for shard in sorted(set(wmap.values())):
                for k, v in mx.load(str(src / shard)).items():
                    if ("audio_codec" in k and "dwconv" not in k and v.ndim == 3
                            and v.shape[1] == 1 and v.shape[2] != 1):
                        fix[k] = v.swapaxes(1, 2)
        if fix:
            mx.save_safetensors(str(dst / "model-zzfix.safetensors"), fix)
            for k in fix:
                wmap[k] = "model-zzfix.safetensors"
        (dst / "model.safetensors.index.json").write_text(json.dumps(full))
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def worker_peer(args) -> dict:
    import mlx.core as mx
    import numpy as np

    peer = args.config.split(":")[0]
    view = _peer_view(peer, Path(args.ckpt), Path(args.view))
    if peer == "mlx-vlm":
        from mlx_vlm import load

        model, processor = load(str(view))
        session = model.create_session(processor)
        import mlx_vlm.models.nemotron_voicechat.tts as ptts
        stt_cls, tts_cls, step = type(model.stt_model), ptts.RVQEARTTSModel, "step"
        mog = "generate_codes"
    else:
        from mlx_audio.sts.utils import load_model

        model = load_model(str(view))
        session = model.create_session()
        import mlx_audio.sts.models.nemotron_voicechat.tts as ptts
        stt_cls, tts_cls, step = type(model.stt_model), ptts.EARTTSModel, "generate_step"
        mog = "_generate_codes"
    use_cache = args.config.endswith(":cache")
    audio = mx.array(_load_audio(args.audio))
    stamps = []
    if args.mode == "profile":
        acc = {}
        _wrap_timed(type(model.stt_model.perception), "__call__", "perception", acc)
        _wrap_timed(stt_cls, "__call__", "llm", acc)
        _wrap_timed(tts_cls, step, "tts_step", acc)
        _wrap_timed(ptts.CharAwareSubwordEncoder, "__call__", "char_encoder", acc)
        _wrap_timed(tts_cls, mog, "mog", acc)
        _wrap_timed(type(model.tts_model.audio_codec), "decode", "codec", acc)
    else:
        orig = stt_cls.__call__
        log = open(_stamps_path(args.view), "w")  # noqa: SIM115 (read by the driver on timeout)

        def stamped(*a, **k):
            stamps.append(time.perf_counter())
            log.write(f"{stamps[-1]}\n")
            log.flush()
            return orig(*a, **k)

        stt_cls.__call__ = stamped
    mx.reset_peak_memory()
    t = time.perf_counter()
    res = session.generate(audio, system_prompt=PROMPT, extra_decoding_seconds=EXTRA_SECONDS,
                           seed=0, use_language_cache=use_cache)
    wall = time.perf_counter() - t
    frames = int(res.text_tokens.shape[0])
    if args.mode == "profile":
        return _split(acc, frames)
    return {"frames": frames, "wall_s": wall,
            "frame_ms": 1000 * float(np.median(np.diff(stamps))),
            "peak_mib": mx.get_peak_memory() / 2**20}


# --- driver side ---------------------------------------------------------------------------


def _stamps_path(view) -> Path:
    return Path(str(view) + ".stamps")


def _partial(view, timeout) -> dict:
    """What a run stopped by its timeout had done: frames and the cost of its last frames (the
    peers' default configuration gets slower every frame, so this is a lower bound)."""
    import numpy as np

    try:
        stamps = [float(x) for x in _stamps_path(view).read_text().split()]
    except (OSError, ValueError):
        stamps = []
    out = {"error": f"timed out after {timeout} s", "frames_done": max(len(stamps) - 1, 0)}
    if len(stamps) > 2:
        out["frame_ms_last"] = 1000 * float(np.median(np.diff(stamps)[-5:]))
    return out


def _run_worker(config, scale, mode, ckpt, audio, view, timeout) -> dict:
    _stamps_path(view).unlink(missing_ok=True)
    cmd = [sys.executable, __file__, "--worker", config, "--mode", mode, "--ckpt", str(ckpt),
           "--audio", str(audio), "--view", str(view)]
    env = dict(os.environ, MLX_VOICECHAT_OVERRIDE="0", PYTHONPATH=str(ROOT))
    if config == "ours":
        env.pop("MLX_VOICECHAT_OVERRIDE")
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return _partial(view, timeout)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode or not lines:
        tail = (p.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": tail[:300]}
    return json.loads(lines[-1])


def _machine() -> str:
    cpu = platform.processor() or "?"
    try:
        for ln in Path("/proc/cpuinfo").read_text().splitlines():
            if ln.startswith("model name"):
                cpu = ln.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = "?"
    try:
        kb = int(Path("/proc/meminfo").read_text().split()[1])
        mem = f"{kb / 2**20:.0f} GiB"
    except (OSError, ValueError, IndexError):
        pass
    import mlx.core as mx

    return (f"{os.cpu_count()} CPUs ({cpu}), {mem} RAM, {platform.system()} "
            f"{platform.machine()}, mlx {mx.__version__} ({mx.default_device()})")


def _write_audio(path: Path, seconds: float):
    import numpy as np

    rng = np.random.default_rng(0)
    n = int(seconds * INPUT_RATE)
    t = np.arange(n) / INPUT_RATE
    # A little speech-like energy (a few harmonics, amplitude-modulated) over faint noise.
    x = sum(np.sin(2 * np.pi * f * t) / (k + 1) for k, f in enumerate((140, 280, 420, 700)))
    x = 0.1 * x * (0.5 + 0.5 * np.sin(2 * np.pi * 3 * t)) + 0.01 * rng.standard_normal(n)
    np.save(path, x.astype(np.float32))


def _fmt(v, nd=1):
    return "—" if v is None or v != v else f"{v:.{nd}f}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default=str(Path.home() / ".cache" / "mlx-voicechat-bench"),
                    help="checkpoint / input cache (about 1.5 GB for small + medium)")
    ap.add_argument("--scales", default="small,medium")
    ap.add_argument("--seconds", type=float, default=16.0, help="input audio (16 s = 200 frames)")
    ap.add_argument("--long-seconds", type=float, default=36.0,
                    help="input for the frame-50 / frame-400 figure (ours only); 0 skips it")
    ap.add_argument("--profile-seconds", type=float, default=4.0,
                    help="input of the barrier run that splits the frame; 0 skips it")
    ap.add_argument("--repeats", type=int, default=1, help="alternating rounds of plain runs")
    ap.add_argument("--peers", default="mlx-vlm,mlx-audio")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per subprocess")
    ap.add_argument("--default-timeout", type=int, default=900,
                    help="seconds for a peer's default configuration (it re-runs the whole "
                         "history every frame); a run stopped here reports its last frames")
    ap.add_argument("--out", default=None, help="also write the table to this markdown file")
    # worker mode
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="plain", help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", help=argparse.SUPPRESS)
    ap.add_argument("--audio", help=argparse.SUPPRESS)
    ap.add_argument("--view", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.worker:
        fn = worker_ours if args.worker == "ours" else worker_peer
        args.config = args.worker
        print(json.dumps(fn(args)))
        return

    sys.path.insert(0, str(ROOT))
    from mlx_voicechat.factory import make_checkpoint

    d = Path(args.dir)
    d.mkdir(parents=True, exist_ok=True)
    peers = [p for p in args.peers.split(",") if p]
    configs = ["ours"] + [f"{p}:{c}" for c in ("cache", "default") for p in peers]
    inputs = {}
    for name, secs in (("main", args.seconds), ("long", args.long_seconds),
                       ("profile", args.profile_seconds)):
        if secs > 0:
            inputs[name] = d / f"input-{secs:g}s.npy"
            if not inputs[name].exists():
                _write_audio(inputs[name], secs)
    lines = []

    def emit(s=""):
        print(s, flush=True)
        lines.append(s)

    t_all = time.perf_counter()

    def limit_s(config):  # the peers' default configuration gets its own, shorter limit
        return args.default_timeout if config.endswith(":default") else args.timeout

    results = {}
    for scale in args.scales.split(","):
        ckpts = {}
        for layout in sorted(set(PEER_LAYOUT.values())):
            ck = d / f"{scale}-{layout}"
            if not (ck / "config.json").exists():
                make_checkpoint(ck, scale, layout)
            ckpts[layout] = ck
        runs = {c: [] for c in configs}
        for _ in range(args.repeats):
            for c in configs:  # alternating: one run of each configuration per round
                peer = c.split(":")[0]
                ck = ckpts[PEER_LAYOUT[peer]]
                r = _run_worker(c, scale, "plain", ck, inputs["main"], d / "views" / f"{peer}-{scale}",
                                limit_s(c))
                print(f"  {scale} {c}: {r}", file=sys.stderr, flush=True)
                runs[c].append(r)
        prof = {}
        if "profile" in inputs:
            for c in configs:
                if any("error" in r for r in runs[c]):
                    continue
                peer = c.split(":")[0]
                prof[c] = _run_worker(c, scale, "profile", ckpts[PEER_LAYOUT[peer]],
                                      inputs["profile"], d / "views" / f"{peer}-{scale}",
                                      args.timeout)
        long = None
        if "long" in inputs:
            long = _run_worker("ours", scale, "long", ckpts["mlx-community"], inputs["long"],
                               d / "views" / "ours", args.timeout)
        results[scale] = (runs, prof, long)

        med = lambda rs, k: statistics.median([r[k] for r in rs if k in r]) if any(k in r for r in rs) else None  # noqa: E731
        ours_ms = med(runs["ours"], "frame_ms")
        emit(f"### {scale}: {args.seconds:g} s input + system prompt")
        emit()
        emit("| configuration | frames | per-frame ms (median) | perception | LLM | TTS backbone "
             "| char encoder | MoG | codec | wall s | peak MiB | ours / this |")
        emit("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for c in configs:
            rs = runs[c]
            errs = [r["error"] for r in rs if "error" in r]
            last = [r["frame_ms_last"] for r in rs if "frame_ms_last" in r]
            if last:  # stopped by its timeout: its last frames bound the per-frame cost
                ms, done = max(last), max(r.get("frames_done", 0) for r in rs)
                ratio = f"< {ours_ms / ms:.3f}" if ours_ms else "—"
                emit(f"| {c} | {done} LLM calls | > {_fmt(ms)} (calls {done - 5}-{done}; "
                     f"{errs[0]}) | | | | | | | > {limit_s(c)} | | {ratio} |")
                continue
            if errs:
                emit(f"| {c} | — | failed: {errs[0]} | | | | | | | | | |")
                continue
            p = prof.get(c, {})
            ms = med(rs, "frame_ms")
            ratio = f"{ours_ms / ms:.3f}" if ours_ms and ms else "—"
            emit(f"| {c} | {rs[0]['frames']} | {_fmt(ms)} | {_fmt(p.get('perception'))} "
                 f"| {_fmt(p.get('llm'))} | {_fmt(p.get('tts_backbone'))} "
                 f"| {_fmt(p.get('char_encoder'))} | {_fmt(p.get('mog'))} | {_fmt(p.get('codec'))} "
                 f"| {_fmt(med(rs, 'wall_s'))} | {_fmt(med(rs, 'peak_mib'), 0)} | {ratio} |")
        emit()
        sy = med(runs["ours"], "syncs_per_frame")
        emit(f"- ours: host syncs per frame in the offline loop: {_fmt(sy, 2)}")
        if long and "frame_ms_at" in long:
            at = long["frame_ms_at"]
            f50, f400 = at.get("50"), at.get("400")
            rel = f" ({f400 / f50:.2f}x)" if f50 and f400 else ""
            emit(f"- ours, {args.long_seconds:g} s input ({long['frames']} frames; frame i = "
                 f"median of frames i-{LONG_WINDOW}..i+{LONG_WINDOW - 1}): frame 50 "
                 f"{_fmt(f50)} ms, frame 400 {_fmt(f400)} ms{rel}")
        elif long:
            emit(f"- ours, long input: {long.get('error', 'fewer than 425 frames')}")
        emit()
    emit(f"Machine: {_machine()}. Total benchmark time {time.perf_counter() - t_all:.0f} s.")
    if args.out:
        cmd = "python benchmarks/bench_peers.py " + " ".join(
            a for a in (argv if argv is not None else sys.argv[1:]))
        Path(args.out).write_text(
            "# Benchmarks\n\nOffline generation, random-weight checkpoints from the factory, every "
            "configuration in its own process, alternating.\n\n"
            f"Command: `{cmd}`\n\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
