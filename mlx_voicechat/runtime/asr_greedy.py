"""The greedy transducer loop of the runtime notes, for one row or many, on the device.

The notes' loop (TensorRT Edge-LLM's, matching Transformers' greedy RNN-T): the step (joint on
the current frame and prediction, argmax) always runs; on a blank the frame cursor advances and
the prediction network's new state is discarded; on a non-blank the token is emitted, the new
state adopted and the cursor stays; after ``max_symbols`` non-blanks in a row at one frame the
cursor advances without a step; decoding stops when the cursor passes the last frame. So a
clip's steps are its tokens plus its blank steps, and ``steps + forced advances = tokens +
frames``.

While the prediction is unchanged the labels of the next frames are independent, so one
compiled call (:func:`build_step`, the analogue of the notes' CUDA graph) runs the
joint over a window of ``WINDOW`` frames from each row's cursor and takes the first non-blank:
it settles a run of blank steps and the token after it (the notes' steps, exactly), runs the
LSTM on that token and adopts its state where a row emitted, as Transformers' batched decoder
does. Every row has its own cursor, symbol count, prediction and LSTM state, on the device, and
nothing is read per call. A *round* queues ``N`` calls and reads them at once (one host read):
per row and call, the blank steps taken and the token emitted (or -1); the host replays the
cursor rule on them to place each token on its frame and count the steps. An offline round is
sized to the frames left and the tokens expected, so a clip takes few reads.

A live (``lean``, one row) decoder reads after every call while the session's reads allow it
(a call after the last token would be wasted work, a read is cheap), so the host knows the
cursor and whether a token came at every call, and the device runs only what the notes' loop
needs: a round is the joint over every frame left (up to ``WIDE``) under the current
prediction, its labels read (:func:`build_scan`); the host takes the first non-blank, and the
next round first runs the prediction network on that token. Short of reads, a round is the
calls above, sized as offline without the slack.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import List, Optional

import mlx.core as mx
import numpy as np

from ..nets import fastpaths
from ..nets.derived import derived

NO_TOKEN = -1
WINDOW = 8  # frames whose joint one call evaluates under one prediction (offline rounds)
WIDE = 16  # frames of a live round's one call, at most
MAX_ROUND_CALLS = 64  # calls queued before one read, at most


@dataclass
class RowState:
    """The host's view of one row: its cursor and symbol count (mirroring the device's),
    and what it has decoded."""

    frame: int = 0
    symbols: int = 0
    steps: int = 0
    forced: int = 0  # advances after max_symbols non-blanks
    tokens: List[int] = field(default_factory=list)
    frames: List[int] = field(default_factory=list)  # the frame of each token


def _predict(net, y: mx.array, h: mx.array, c: mx.array):
    """The prediction network's step on tokens ``y`` [B]: (projected prediction, h, c)."""
    out, (h, c) = net.decoder.step(y, (h, c))
    return net.joint.project_prediction(out), h, c


def build_step(net):
    """The compiled call (see the module docstring) for ``net``'s decoder and joint; its window
    is the frames ``e`` holds (one trace per window size)."""
    joint = net.joint
    blank, max_symbols = net.config.blank_id, net.config.max_symbols

    def step(e, pred, h, c, t, sym, length, base, last):
        """``e`` [B, W, J]: the frames from each row's cursor on."""
        w = mx.arange(e.shape[1], dtype=mx.int32)
        valid = (t[:, None] + w[None, :]) < length[:, None]
        labels = mx.argmax(joint.logits(e, pred[:, None, :]), axis=-1).astype(mx.int32)  # [B, W]
        token = valid & (labels != blank)
        emit = mx.any(token, axis=-1)
        j = mx.argmax(token.astype(mx.int32), axis=-1).astype(mx.int32)  # the first one
        k = mx.take_along_axis(labels, j[:, None], axis=-1)[:, 0]
        jump = mx.where(emit, j, mx.sum(valid.astype(mx.int32), axis=-1))  # blank steps
        t = t + jump
        sym = mx.where(jump > 0, 0, sym)
        pred2, h2, c2 = _predict(net, mx.where(emit, k, 0), h, c)
        keep = emit[None, :, None]
        h, c = mx.where(keep, h2, h), mx.where(keep, c2, c)
        pred = mx.where(emit[:, None], pred2, pred)
        sym = mx.where(emit, sym + 1, sym)
        forced = emit & (sym >= max_symbols)
        t = t + forced.astype(mx.int32)
        sym = mx.where(forced, 0, sym)
        code = mx.stack([jump, mx.where(emit, k, NO_TOKEN)], axis=-1)
        index = base[:, None] + mx.minimum(t[:, None] + w[None, :], last[:, None])
        return code, pred, h, c, t, sym, index

    return mx.compile(step)


def build_scan(net):
    """The live round's compiled calls for ``net``: ``scan(e, pred)`` -> the joint's labels
    [1, W] of the frames ``e`` [1, W, J] under ``pred``; ``predict_scan(e, y, h, c)`` -> the
    prediction network's step on the tokens ``y`` [1] first, then the labels under its
    prediction, and the new ``pred``, ``h``, ``c``."""
    def scan(e, pred):
        return mx.argmax(net.joint.logits(e, pred[:, None, :]), axis=-1).astype(mx.int32)

    def predict_scan(e, y, h, c):
        pred, h, c = _predict(net, y, h, c)
        return scan(e, pred), pred, h, c

    return mx.compile(scan), mx.compile(predict_scan)


class GreedyDecoder:
    """Greedy RNN-T over ``B`` rows of projected encoder frames (``net.joint_frames``)."""

    def __init__(self, net, batch: int = 1, lean: bool = False):
        """``lean``: rounds of one call while reads allow (a live session, whose reads are
        cheap but whose wasted calls are not, see :meth:`round`); otherwise rounds with
        slack, so that a clip takes few reads."""
        self.net = net
        self.lean = lean
        self.blank = net.config.blank_id
        self.max_symbols = net.config.max_symbols
        self.batch = batch
        self.reset()

    def reset(self) -> None:
        B = self.batch
        self.rows = [RowState() for _ in range(B)]
        self._pred, (self._h, self._c) = self.net.start(B)
        self._t = mx.zeros((B,), mx.int32)
        self._sym = mx.zeros((B,), mx.int32)
        self._frames: Optional[mx.array] = None  # [B, T, J]: frames from _start on
        self._start = 0
        self._next: Optional[int] = None  # a live row's token not yet through the prediction

    def arrays(self) -> List[mx.array]:
        return [
            a
            for a in (self._pred, self._h, self._c, self._t, self._sym, self._frames)
            if a is not None
        ]

    # -- the compiled step ---------------------------------------------------------------------

    # -- frames ---------------------------------------------------------------------------------

    def push(self, frames: mx.array) -> None:
        """Append projected encoder frames [B, n, J] (the next ``n`` frames of every row)."""
        if self._frames is None:
            self._frames = frames
        else:
            self._frames = mx.concatenate([self._frames, frames], axis=1)

    @property
    def available(self) -> int:
        return self._start + (0 if self._frames is None else self._frames.shape[1])

    def _drop_consumed(self) -> None:
        low = min(r.frame for r in self.rows)
        if self._frames is not None and low > self._start:
            self._frames = self._frames[:, low - self._start :]
            self._start = low

    # -- rounds ---------------------------------------------------------------------------------

    def pending(self, lengths: List[int]) -> bool:
        """Whether some row has a frame left before its length (in frames)."""
        return any(r.frame < n for r, n in zip(self.rows, lengths))

    def round(
        self, lengths: List[int], calls: Optional[int] = None, reads_left: Optional[int] = None
    ) -> None:
        """Queue ``calls`` calls (default: see :meth:`_plan`) over rows whose frames before
        ``lengths[b]`` are pushed, read their codes (one host read) and replay them.
        ``reads_left``: the reads a lean decoder may still take for these frames (None: as
        many as it needs)."""
        B = self.batch
        left = max(n - r.frame for r, n in zip(self.rows, lengths))
        if left <= 0:
            return
        W = WINDOW
        if calls is None:
            calls, W = self._plan(left, reads_left)
            if self.lean and calls == 1 and B == 1:
                return self._scan(W)
        self._predict_next()
        if self.lean:  # the host's cursors, which scans move without the device's
            self._t = mx.array([r.frame for r in self.rows], dtype=mx.int32)
            self._sym = mx.array([r.symbols for r in self.rows], dtype=mx.int32)
        T = self._frames.shape[1]
        flat = self._frames.reshape(B * T, -1)
        base = mx.arange(B, dtype=mx.int32) * T - self._start
        last = mx.array([self._start + T - 1] * B, dtype=mx.int32)
        length = mx.array(lengths, dtype=mx.int32)
        lstm = fastpaths.enabled("rnnt.lstm_step")  # traced into the step
        # One compiled step per model and batch size, shared by its decoders (sessions).
        key = (B, self.blank, self.max_symbols, lstm)
        fn = derived(self.net, ("asr.greedy_step", B), lambda: build_step(self.net), key)
        w = mx.arange(W, dtype=mx.int32)
        index = base[:, None] + mx.minimum(self._t[:, None] + w[None, :], last[:, None])
        pred, h, c, t, sym = self._pred, self._h, self._c, self._t, self._sym
        codes = []
        for _ in range(calls):
            code, pred, h, c, t, sym, index = fn(
                mx.take(flat, index, axis=0), pred, h, c, t, sym, length, base, last
            )
            codes.append(code)
        self._pred, self._h, self._c, self._t, self._sym = pred, h, c, t, sym
        codes = mx.stack(codes, axis=1)
        mx.async_eval(codes, *self.arrays())  # one pass over the graph, the state kept on
        read = np.array(codes.tolist(), dtype=np.int64)  # the round's read
        for r, row in zip(self.rows, read):
            self._replay(r, row)
        self._drop_consumed()

    def _scan(self, W: int) -> None:
        """A live round (see the module docstring): the labels of the next ``W`` frames under
        the prediction (after the pending token's step), read; the first non-blank is the
        notes' next step, its token the next round's prediction input."""
        row = self.rows[0]
        a = row.frame - self._start
        e = self._frames[:, a : a + W]
        lstm = fastpaths.enabled("rnnt.lstm_step")
        build = lambda: build_scan(self.net)  # noqa: E731
        scan, predict_scan = derived(self.net, "asr.greedy_scan", build, lstm)
        if self._next is None:
            labels = scan(e, self._pred)
        else:
            y = mx.array([self._next], dtype=mx.int32)
            labels, self._pred, self._h, self._c = predict_scan(e, y, self._h, self._c)
            self._next = None
        mx.async_eval(labels, self._pred, self._h, self._c)
        read = labels.tolist()[0]  # the round's read
        j = next((i for i, k in enumerate(read) if k != self.blank), None)
        self._replay(row, [(W, NO_TOKEN)] if j is None else [(j, read[j])])
        if j is not None:
            self._next = read[j]
        self._drop_consumed()

    def _predict_next(self) -> None:
        """The pending token through the prediction network (no read)."""
        if self._next is not None:
            y = mx.array([self._next], dtype=mx.int32)
            self._pred, self._h, self._c = _predict(self.net, y, self._h, self._c)
            self._next = None

    def _plan(self, left: int, reads_left: Optional[int]):
        """``(calls, window)`` of a round over ``left`` frames. Lean, with a read to spare: one
        call over every frame left (nothing is computed past the round's first token, and no
        call runs after the last one). On its last read, enough calls for the frames and the
        tokens at the recent rate, one a frame at most (more wait for the next read). Offline:
        the same with the clip's rate and some slack, so a clip takes few reads."""
        if self.lean and (reads_left is None or reads_left > 1):
            return 1, min(left, WIDE)
        if self.lean:
            calls = -(-left // WINDOW) + max(1, math.ceil(min(self._recent_rate(), 1.0) * left))
        else:
            calls = -(-left // WINDOW) + math.ceil(self._rate() * left) + 2
        return min(calls, MAX_ROUND_CALLS), WINDOW

    def _recent_rate(self) -> float:
        """Tokens per frame over the last ``2 * WIDE`` frames (of the busiest row)."""
        best = 0.0
        for r in self.rows:
            since = r.frame - 2 * WIDE
            n = next((i for i, f in enumerate(reversed(r.frames)) if f < since), len(r.frames))
            best = max(best, n / max(min(r.frame, 2 * WIDE), 1))
        return best

    def _rate(self) -> float:
        """Tokens per frame so far (speech's 0.25 until there is a history), to size rounds:
        a call past the last token is wasted work, one too few costs another read."""
        frames = sum(r.frame for r in self.rows)
        tokens = sum(len(r.tokens) for r in self.rows)
        return 0.25 if frames < 2 * WINDOW else min(max(tokens / frames, 0.05), 2.0)

    def _replay(self, r: RowState, codes: np.ndarray) -> None:
        for jump, token in codes:
            if jump:
                r.steps += int(jump)
                r.frame, r.symbols = r.frame + int(jump), 0
            if token == NO_TOKEN:
                continue
            r.steps += 1
            r.tokens.append(int(token))
            r.frames.append(r.frame)
            r.symbols += 1
            if r.symbols >= self.max_symbols:
                r.frame, r.symbols = r.frame + 1, 0
                r.forced += 1

    def run(self, lengths: List[int]) -> List[RowState]:
        """Decode every row to its length (offline)."""
        while self.pending(lengths):
            self.round(lengths)
        return self.rows
