"""The greedy transducer loop of the runtime notes, for one row or many, on the device.

The notes' loop (TensorRT Edge-LLM's, matching Transformers' greedy RNN-T): the step (joint on
the current frame and prediction, argmax) always runs; on a blank the frame cursor advances and
the prediction network's new state is discarded; on a non-blank the token is emitted, the new
state adopted and the cursor stays; after ``max_symbols`` non-blanks in a row at one frame the
cursor advances without a step; decoding stops when the cursor passes the last frame. So a
clip's steps are its tokens plus its blank steps, and ``steps + forced advances = tokens +
frames``.

Here one step is one compiled call (:meth:`GreedyDecoder.step`, the analogue of the notes' CUDA
graph) over ``B`` rows, each with its own frame cursor, symbol count, prediction and LSTM state,
all on the device: the LSTM runs for every row and is adopted by the rows that emitted (as
Transformers' batched decoder does). Nothing is read per step. A *round* queues ``N`` steps and
reads their codes at once (one host read): per row and step, the token emitted, -1 for a blank
step, -2 once the row had no frame left; the host replays the cursor rule on them to place each
token on its frame. A round sized to the frames left plus half as many tokens settles a chunk of
speech in one read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

import mlx.core as mx
import numpy as np

from ..nets.compiled import FrozenCompile

BLANK_STEP, IDLE = -1, -2
MAX_ROUND_STEPS = 256  # steps queued before one read, at most


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


class GreedyDecoder:
    """Greedy RNN-T over ``B`` rows of projected encoder frames (``net.joint_frames``)."""

    def __init__(self, net, batch: int = 1):
        self.net = net
        self.blank = net.config.blank_id
        self.max_symbols = net.config.max_symbols
        self.batch = batch
        self._frozen = FrozenCompile(self._build, lambda: [net.decoder, net.joint])
        self.reset()

    def reset(self) -> None:
        B = self.batch
        self.rows = [RowState() for _ in range(B)]
        self._pred, (self._h, self._c) = self.net.start(B)
        self._t = mx.zeros((B,), mx.int32)
        self._sym = mx.zeros((B,), mx.int32)
        self._frames: Optional[mx.array] = None  # [B, T, J]: frames from _start on
        self._start = 0

    def arrays(self) -> List[mx.array]:
        return [
            a
            for a in (self._pred, self._h, self._c, self._t, self._sym, self._frames)
            if a is not None
        ]

    # -- the compiled step ---------------------------------------------------------------------

    def _build(self):
        decoder, joint = self.net.decoder, self.net.joint
        blank, max_symbols = self.blank, self.max_symbols

        def step(e, pred, h, c, t, sym, length, base, last):
            active = t < length
            x = e + pred
            for layer in joint.joint_net:
                x = layer(x)
            k = mx.argmax(x, axis=-1).astype(mx.int32)
            emit = active & (k != blank)
            out, (h2, c2) = decoder(k[:, None], (h, c))
            pred2 = joint.project_prediction(out[:, -1])
            keep = emit[None, :, None]
            h, c = mx.where(keep, h2, h), mx.where(keep, c2, c)
            pred = mx.where(emit[:, None], pred2, pred)
            sym = mx.where(emit, sym + 1, 0)
            advance = active & (mx.logical_not(emit) | (sym >= max_symbols))
            t = t + advance.astype(mx.int32)
            sym = mx.where(advance, 0, sym)
            code = mx.where(emit, k, mx.where(active, BLANK_STEP, IDLE))
            index = base + mx.minimum(t, last)  # where the next step reads its frame
            return code, pred, h, c, t, sym, index

        return mx.compile(step)

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

    def round(self, lengths: List[int], steps: Optional[int] = None) -> None:
        """Queue ``steps`` steps (default: sized to the frames left) over rows whose frames
        before ``lengths[b]`` are pushed, read their codes (one host read) and replay them."""
        B = self.batch
        left = max(n - r.frame for r, n in zip(self.rows, lengths))
        if left <= 0:
            return
        if steps is None:
            steps = min(left + left // 2 + 2, MAX_ROUND_STEPS)
        T = self._frames.shape[1]
        flat = self._frames.reshape(B * T, -1)
        base = mx.arange(B, dtype=mx.int32) * T - self._start
        last = mx.array([self._start + T - 1] * B, dtype=mx.int32)
        length = mx.array(lengths, dtype=mx.int32)
        fn = self._frozen.get((B, self.blank, self.max_symbols))
        index = base + mx.minimum(self._t, last)
        pred, h, c, t, sym = self._pred, self._h, self._c, self._t, self._sym
        codes = []
        for _ in range(steps):
            e = mx.take(flat, index, axis=0)
            code, pred, h, c, t, sym, index = fn(e, pred, h, c, t, sym, length, base, last)
            codes.append(code)
        self._pred, self._h, self._c, self._t, self._sym = pred, h, c, t, sym
        read = np.array(mx.stack(codes, axis=1).tolist(), dtype=np.int64)  # the round's read
        mx.async_eval(self.arrays())
        for r, row in zip(self.rows, read):
            self._replay(r, row)
        self._drop_consumed()

    def _replay(self, r: RowState, codes: np.ndarray) -> None:
        for code in codes:
            if code == IDLE:
                break
            r.steps += 1
            if code == BLANK_STEP:
                r.frame, r.symbols = r.frame + 1, 0
                continue
            r.tokens.append(int(code))
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
