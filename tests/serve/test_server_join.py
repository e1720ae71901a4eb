"""A conversation that joins the server with a long new prompt stalls the live ones by at most
one unit of work between two of their frames (one slice of its prompt, or one round they are
not in), and hears exactly what it hears alone.

The server's stepper is driven here with the worker's job queue run by hand, one "tick" (80 ms
of real time) at a time: the audio of every client arrives while the worker is in a job, each
client's push (one in flight each, as a connection has) joins the queue, and the jobs queued
by then are run, as a worker that keeps up would run them while the next audio arrives. What ran
(rounds and prompt slices, in order) is recorded; nothing is timed."""

from concurrent.futures import Future

import numpy as np
import pytest

from mlx_voicechat.serve import stepper as stepper_module
from mlx_voicechat.serve.stepper import Stepper

FRAME = 1280


class HandWorker:
    """A worker whose jobs run when the test says."""

    def __init__(self):
        self.jobs = []

    def submit(self, fn, *args):
        self.jobs.append((fn, args))

    def run_queued(self):
        jobs, self.jobs = self.jobs, []
        for fn, args in jobs:
            fn(*args)

    def run_one(self, arrivals):
        """Run the next job with ``arrivals()`` (what comes in meanwhile) queued behind it."""
        if not self.jobs:
            arrivals()
            return
        fn, args = self.jobs.pop(0)
        arrivals()
        fn(*args)


class NowLoop:
    def call_soon_threadsafe(self, fn, *args):
        fn(*args)


def _push(stepper, handle, samples):
    """What ``Stepper.feed`` does: the push is a job of the worker's."""
    future = Future()
    stepper.worker.submit(stepper._push, handle, samples, future, NowLoop())
    return future


def _wave(frames, seed):
    rng = np.random.default_rng(seed)
    return (0.1 * rng.standard_normal((frames - 1) * FRAME + 199)).astype(np.float32)


def _tape(stepper):
    """Record what the worker runs: ("round", handles in it) and ("slice", rows)."""
    batch, log = stepper.batch, []
    step, prefill = batch.step, batch.prefill

    def logged_step(max_rounds=None):
        rows = max([h.prefill_rows for h in batch.sessions if h.ready], default=0)
        out = step(max_rounds)
        if batch.last_rounds:
            log.append(("round", frozenset(h for h, ev in out.items() if ev)))
            log.append(("with prompt rows", rows))
        return out

    def logged_prefill(rows, steps=None):
        log.append(("slice", rows))
        return prefill(rows, steps)

    batch.step, batch.prefill = logged_step, logged_prefill
    return log


@pytest.mark.parametrize("prompt_rows", [400])
def test_a_join_with_a_long_prompt_stalls_the_live_ones_at_most_one_unit(
    tiny, prompt_rows, monkeypatch
):
    monkeypatch.setattr(stepper_module, "SLICE_ROWS_MIN", 48)  # slices of 48 rows, not timed
    monkeypatch.setattr(stepper_module, "SLICE_ROWS_MAX", 48)
    worker = HandWorker()
    stepper = Stepper(tiny, worker, max_sessions=4)
    stepper.slice_rows = 48
    live = [stepper.open("", seed=s) for s in range(3)]
    waves = [_wave(200, seed=s) for s in range(3)]
    # The live ones' first frames (and their rounds traced), then the join.
    futures = [_push(stepper, h, w[:199]) for h, w in zip(live, waves)]
    worker.run_queued()
    worker.run_queued()
    assert all(len(f.result()[0]) == 1 for f in futures)
    log = _tape(stepper)
    prompt = [5 + (7 * i) % 50 for i in range(prompt_rows)]
    joining = stepper.open(prompt=prompt, seed=9)
    assert joining.prefilling
    join_wave = _wave(40, seed=9)
    got = {h: [] for h in live + [joining]}
    waves = {h: w for h, w in zip(live, waves)}
    waves[joining] = join_wave
    pushed = {h: 0 if h is joining else 199 for h in got}  # one push in flight each
    flight = {}

    def arrive():
        log.append(("arrive", None))
        for h in got:
            ahead = 0 if h is joining else 1  # the live ones had their first frame
            sent = min(len(waves[h]), 199 + (tick + ahead) * FRAME)
            f = flight.get(h)
            if f is not None and f.done():
                got[h] += f.result()[0]
                f = flight[h] = None
            if f is None and sent > pushed[h]:
                flight[h] = _push(stepper, h, waves[h][pushed[h] : sent])
                pushed[h] = sent

    for tick in range(80):
        worker.run_one(arrive)  # this tick's audio arrives while the worker is in a job
        worker.run_queued()
        if len(got[joining]) == 40:
            break
    while worker.jobs:
        worker.run_queued()
    assert max(rows for kind, rows in log if kind == "with prompt rows") <= 48
    log = [(kind, what) for kind, what in log if kind != "with prompt rows"]
    assert sum(kind == "round" for kind, _ in log) >= 40
    slices = [rows for kind, rows in log if kind == "slice"]
    kinds = {kind for kind, _ in stepper.slices}
    assert kinds == {"steps", "rows"}  # the seed's chain grew in slices too, then the LLM rows
    assert len(slices) >= (prompt_rows - 48) // 48 and max(slices) == 48  # in slices
    # From the moment a live conversation's audio arrives to its next round, the worker ran at
    # most one unit of other work (a slice, or a round it is not in): the job it arrived in.
    for h in live:
        after = None
        for kind, what in log:
            if kind == "arrive":
                after = 0 if after is None else after
            elif kind == "round" and h in what:
                assert after is None or after <= 1, [(k, w if k == "slice" else "") for k, w in log]
                after = None
            elif after is not None:
                after += 1
    # Every live conversation kept its frames coming, one per tick.
    assert all(len(got[h]) >= 0.9 * tick for h in live)
    # The joiner hears what it hears alone, bit for bit.
    alone = tiny.session(prompt=prompt, seed=9).feed(join_wave)
    assert len(got[joining]) == len(alone) == 40
    assert [e.text_id for e in got[joining]] == [e.text_id for e in alone]
    assert all(np.array_equal(a.audio, b.audio) for a, b in zip(got[joining], alone))


def test_the_warm_up_runs_a_round_at_every_batch_size(tiny, monkeypatch):
    """So that no join waits for the compiled steps of a batch size the process has not run."""
    from mlx_voicechat.nemotron_voicechat.runtime.batch import SessionBatch

    sizes = []
    real = SessionBatch._queue_round

    def spy(self, ready):
        sizes.append(sum(h.joined for h in ready))
        return real(self, ready)

    monkeypatch.setattr(SessionBatch, "_queue_round", spy)
    stepper = Stepper(tiny, HandWorker(), max_sessions=3)
    stepper.warm_up(lambda: stepper.open("Be brief.", seed=0), FRAME, frames=2)
    assert {1, 2, 3} <= set(sizes)
    assert len(stepper.batch) == 0  # its sessions are closed again
