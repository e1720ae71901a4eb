"""The package's one greedy RNN-T decoder (NeMo's ``GreedyRNNTInfer`` rule), for one row or many,
on the device: the recognizer's and offline transcription's; a live frame unrolls the same step
(``listen.rnnt.frame_greedy``).

Each compiled call (:func:`build_step`) settles a run of blank steps and the token after it for
every row from its own cursor; a *round* queues calls and reads their codes at once (one host
read), and the host replays the cursor rule on them (``steps + forced advances = tokens +
frames``). ``net`` has ``decoder``, ``joint``, ``start(batch)`` and ``config.blank_id`` /
``config.max_symbols``; VoiceChat's RN-T head is wrapped by :func:`transducer`.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import List, Optional, Tuple

import mlx.core as mx
import numpy as np

from ..derived import compiled, derived
from ..errors import is_int
from .rnnt import NO_TOKEN, greedy_step, predict_step, start_state

WINDOW = 8  # frames whose joint one call evaluates under one prediction (sized rounds)
WIDE = 16  # frames of a one-call round, at most
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


def build_step(net):
    """The compiled call for ``net``'s decoder and joint (one trace per window size)."""
    blank, max_symbols = net.config.blank_id, net.config.max_symbols
    predict = functools.partial(predict_step, net.decoder)

    def step(e, pred, h, c, t, sym, length, base, last):
        """``e`` [B, W, J]: the frames from each row's cursor on."""
        jump, token, pred, h, c, t, sym = greedy_step(
            predict, net.joint, e, pred, h, c, t, sym, length, blank, max_symbols
        )
        w = mx.arange(e.shape[1], dtype=mx.int32)
        index = base[:, None] + mx.minimum(t[:, None] + w[None, :], last[:, None])
        return mx.stack([jump, token], axis=-1), pred, h, c, t, sym, index

    return compiled(step)


class GreedyDecoder:
    """Greedy RNN-T over ``B`` rows of projected encoder frames (``net.joint_frames``)."""

    def __init__(self, net, batch: int = 1, window: int = WINDOW):
        if not is_int(window) or window < 1:
            raise ValueError(f"window must be an int >= 1, got {window!r}")
        self.net = net
        self.blank = net.config.blank_id
        self.max_symbols = net.config.max_symbols
        self.batch = batch
        self.window = window
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
        state = (self._pred, self._h, self._c, self._t, self._sym, self._frames)
        return [a for a in state if a is not None]

    # -- frames ---------------------------------------------------------------------------------

    def push(self, frames: mx.array) -> None:
        """Append projected encoder frames [B, n, J] (the next ``n`` frames of every row)."""
        old = self._frames
        self._frames = frames if old is None else mx.concatenate([old, frames], axis=1)

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

    def round(self, lengths: List[int], reads_left: Optional[int] = None) -> None:
        """Queue calls over each row's pushed frames before ``lengths[b]``, read their codes
        (one host read) and replay them. ``reads_left``: the reads a live session may still
        take (None: offline); with more than one, one call that stops at the first token,
        else enough calls for the frames left at the clip's token rate (:meth:`_rate`)."""
        B = self.batch
        left = max(n - r.frame for r, n in zip(self.rows, lengths))
        if left <= 0:
            return
        if reads_left is not None and reads_left > 1:
            calls, W = 1, min(left, WIDE)
        else:
            W = self.window
            calls = min(-(-left // W) + math.ceil(self._rate() * left) + 2, MAX_ROUND_CALLS)
        T = self._frames.shape[1]
        flat = self._frames.reshape(B * T, -1)
        base = mx.arange(B, dtype=mx.int32) * T - self._start
        last = mx.array([self._start + T - 1] * B, dtype=mx.int32)
        length = mx.array(lengths, dtype=mx.int32)
        # One compiled step per model and batch size, shared by its decoders (sessions).
        key = (B, self.blank, self.max_symbols)
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

    def _rate(self) -> float:
        """Tokens per frame so far (speech's 0.25 until there is a history), to size rounds."""
        frames = sum(r.frame for r in self.rows)
        tokens = sum(len(r.tokens) for r in self.rows)
        return 0.25 if frames < 2 * self.window else min(max(tokens / frames, 0.05), 2.0)

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


class Transducer:
    """A prediction / joint network pair (VoiceChat's RN-T head) as :class:`GreedyDecoder`'s
    ``net``, its start symbol a zero input (NeMo's blank-as-pad); made by :func:`transducer`."""

    def __init__(self, decoder, joint, blank: int, max_symbols: int):
        self.decoder, self.joint = decoder, joint
        self.config = SimpleNamespace(blank_id=blank, max_symbols=max_symbols)

    def start(self, batch: int):
        return start_state(self.decoder, self.joint, batch)


def transducer(decoder, joint, blank: int, max_symbols: Optional[int]) -> Transducer:
    """The :class:`Transducer` of ``decoder`` and ``joint``, kept on the joint with its compiled
    steps until its weights change. ``max_symbols`` None: no bound per frame."""
    cap = 2**30 if max_symbols is None else int(max_symbols)
    if cap < 1:
        raise ValueError(f"max_symbols must be >= 1 or None, got {max_symbols!r}")
    # The pair holds the decoder, so its id names no other object while the entry lives.
    key = (id(decoder), int(blank), cap)
    return derived(joint, "rnnt.transducer", lambda: Transducer(decoder, joint, *key[1:]), key)


def greedy_decode(
    decoder,
    joint,
    encoded: mx.array,
    length: Optional[int] = None,
    blank_id: Optional[int] = None,
    max_symbols: Optional[int] = 10,
    window: int = WINDOW,
) -> Tuple[List[int], List[int]]:
    """Greedy RN-T on one utterance: ``encoded`` [T, D] or [1, T, D] (its first ``length``
    frames) -> (token ids, encoder frame of each). ``window``: frames per call (any gives the
    same tokens)."""
    if encoded.ndim == 3:
        if encoded.shape[0] != 1:
            raise ValueError(f"greedy_decode takes one utterance, got a batch of {len(encoded)}")
        encoded = encoded[0]
    T = encoded.shape[0] if length is None else max(0, min(int(length), encoded.shape[0]))
    blank = joint.blank_id if blank_id is None else int(blank_id)
    decoder = GreedyDecoder(transducer(decoder, joint, blank, max_symbols), 1, window)
    if T == 0:
        return [], []
    decoder.push(joint.project_encoder(encoded[None, :T]))
    (row,) = decoder.run([T])
    return row.tokens, row.frames
