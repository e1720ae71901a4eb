"""The timeline picture of a conversation: user audio, user words, assistant words, function
channel and assistant audio on one time axis, the assistant's turns shaded. Drawn with
matplotlib's object API and the Agg canvas (no pyplot state touched); the ``[plot]`` extra.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Sequence, Tuple

import numpy as np

from ...errors import VoiceChatError
from ...files import write_file

PLOT_EXTRA = "pip install 'mlx-voicechat[plot]'"
INCHES_PER_SECOND = 2.0  # 80 ms frames are 0.16 in apart: room for a short word on 4 levels
MIN_WIDTH, MAX_WIDTH = 10.0, 60.0  # inches
WORD_LEVELS = 4  # neighbouring words are staggered over this many heights
MAX_WORD_CHARS = 16  # a longer run without spaces (random weights) is cut at the next frame
MAX_WAVE_POINTS = 20000  # per waveform: min / max envelope beyond this
DPI = 110

Words = List[Tuple[int, str]]  # (frame, text) deltas in order


class PlotError(VoiceChatError, RuntimeError):
    """A timeline picture that cannot be drawn (matplotlib missing)."""


def check_available() -> None:
    """Raise a PlotError now, before any long work, when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise PlotError(f"--plot needs matplotlib: {PLOT_EXTRA}") from None


@dataclass
class Timeline:
    input_audio: np.ndarray  # float32 mono at input_rate: what the model heard
    input_rate: int
    output_audio: np.ndarray  # float32 mono at output_rate: what it said
    output_rate: int
    frame_seconds: float
    frames: int
    user: Words = field(default_factory=list)
    assistant: Words = field(default_factory=list)
    function: Words = field(default_factory=list)
    speaking: List[Tuple[int, int]] = field(default_factory=list)  # turns, [start, end) frames
    title: str = ""

    @classmethod
    def from_events(cls, events, input_audio, input_rate, output_rate, frame_seconds, title=""):
        """From a session's FrameEvents (their deltas are already per frame)."""
        audio = np.concatenate([e.audio for e in events]) if events else np.zeros(0, np.float32)
        return cls(
            np.asarray(input_audio, np.float32),
            int(input_rate),
            audio,
            int(output_rate),
            float(frame_seconds),
            len(events),
            user=[(e.index, e.transcript) for e in events if e.transcript],
            assistant=[(e.index, e.text) for e in events if e.text],
            function=[(e.index, e.function_text) for e in events if e.function_text],
            speaking=_spans([e.index for e in events if e.speaking]),
            title=title,
        )

    @classmethod
    def from_result(cls, model, result, input_audio, user: Words, title=""):
        """From an offline GenerationResult: its per-frame ids decoded one at a time."""
        from ...listen.textstream import TextStream

        cfg = model.config

        def deltas(ids) -> Words:
            stream = TextStream(model, cfg)
            return [(i, d) for i, d in ((i, stream.add(int(t))) for i, t in enumerate(ids)) if d]

        return cls(
            np.asarray(input_audio, np.float32),
            cfg.input_sample_rate,
            result.audio,
            result.sample_rate,
            cfg.frame_duration,
            result.frames,
            user=user,
            assistant=deltas(result.text_ids),
            function=deltas(result.function_ids),
            title=title,
        )


def _spans(frames: Sequence[int]) -> List[Tuple[int, int]]:
    """Sorted frame indices as [start, end) runs."""
    out: List[List[int]] = []
    for f in frames:
        if out and out[-1][1] == f:
            out[-1][1] = f + 1
        else:
            out.append([f, f + 1])
    return [(a, b) for a, b in out]


def transcript_by_frame(model, samples: np.ndarray, extra_decoding_seconds: float = 0.0) -> Words:
    """The user's words of offline perception over ``samples`` and the trailing silence, each
    at its encoder frame (what ``generate`` heard, with the frame of each word)."""
    from ...listen.textstream import TranscriptStream
    from . import generate as offline

    _, encoded, F = offline.listen(model, samples, extra_decoding_seconds)
    tokens, frames = offline.rnnt_tokens(model, encoded, F)
    stream = TranscriptStream(model.rnnt_vocabulary)
    pairs = ((f, stream.add(t)) for t, f in zip(tokens, frames, strict=True))
    return [(f, d) for f, d in pairs if d]


def words(deltas: Sequence[Tuple[int, str]]) -> List[Tuple[int, str]]:
    """Deltas joined into words, each at the frame where its first character came."""
    out: List[List] = []
    open_word = False
    for frame, delta in deltas:
        if open_word and len(out[-1][1]) >= MAX_WORD_CHARS:
            open_word = False
        for ch in delta:
            if ch.isspace():
                open_word = False
                continue
            if not ch.isprintable():  # random weights decode to control bytes
                ch = "\ufffd"
            if not open_word:
                out.append([frame, ""])
                open_word = True
            out[-1][1] += ch
    return [(f, w) for f, w in out]


def _envelope(x: np.ndarray, rate: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(time, low, high) of a waveform, reduced to at most MAX_WAVE_POINTS columns."""
    n = len(x)
    if n <= MAX_WAVE_POINTS:
        t = np.arange(n) / rate
        return t, x, x
    step = int(np.ceil(n / MAX_WAVE_POINTS))
    m = n // step
    cols = x[: m * step].reshape(m, step)
    t = (np.arange(m) * step + step / 2) / rate
    return t, cols.min(axis=1), cols.max(axis=1)


def _wave_row(ax, x, rate, color, label):
    t, lo, hi = _envelope(np.asarray(x, np.float32), rate)
    if len(t):
        ax.fill_between(t, lo, hi, color=color, linewidth=0.6)
        peak = float(np.max(np.abs(x))) if len(x) else 0.0
        ax.set_ylim(-max(peak, 1e-3) * 1.1, max(peak, 1e-3) * 1.1)
    ax.set_ylabel(label, rotation=0, ha="right", va="center", fontsize=9)
    ax.set_yticks([])
    ax.axhline(0, color="0.8", linewidth=0.5)


def _word_row(ax, items, frame_seconds, color, label, empty):
    ax.set_ylim(0, 1)
    ax.set_yticks([])
    ax.set_ylabel(label, rotation=0, ha="right", va="center", fontsize=9)
    ws = words(items)
    if not ws:
        ax.text(
            0.5,
            0.5,
            empty,
            transform=ax.transAxes,
            ha="center",
            va="center",
            fontsize=8,
            color="0.55",
            style="italic",
        )
        return
    for n, (frame, word) in enumerate(ws):
        x = frame * frame_seconds
        y = (n % WORD_LEVELS + 0.5) / WORD_LEVELS
        ax.plot([x, x], [0, y - 0.08], color=color, linewidth=0.5, alpha=0.5)
        ax.text(x, y, word, fontsize=7.5, color=color, ha="left", va="center", clip_on=True)


def draw(timeline: Timeline):
    """The picture as a matplotlib Figure."""
    check_available()
    from matplotlib.figure import Figure

    tl = timeline
    seconds = max(
        tl.frames * tl.frame_seconds,
        len(tl.input_audio) / tl.input_rate,
        len(tl.output_audio) / tl.output_rate,
        tl.frame_seconds,
    )
    width = float(np.clip(INCHES_PER_SECOND * seconds, MIN_WIDTH, MAX_WIDTH))
    fig = Figure(figsize=(width, 6.2), dpi=DPI)
    grid = fig.add_gridspec(
        5,
        1,
        height_ratios=[1.6, 1.1, 1.1, 0.7, 1.6],
        hspace=0.08,
        left=1.3 / width,
        right=1 - 0.25 / width,
        top=0.9,
        bottom=0.1,
    )
    axes = [fig.add_subplot(grid[0])]
    axes += [fig.add_subplot(grid[i], sharex=axes[0]) for i in range(1, 5)]
    user_c, assistant_c, function_c = "#1f6fb4", "#c0392b", "#7d3c98"
    _wave_row(axes[0], tl.input_audio, tl.input_rate, user_c, "user audio")
    _word_row(axes[1], tl.user, tl.frame_seconds, user_c, "user words", "(no words heard)")
    _word_row(
        axes[2], tl.assistant, tl.frame_seconds, assistant_c, "assistant words", "(no words said)"
    )
    _word_row(axes[3], tl.function, tl.frame_seconds, function_c, "function", "(no calls)")
    _wave_row(axes[4], tl.output_audio, tl.output_rate, assistant_c, "assistant audio")
    axes[0].set_xlim(0, seconds)
    for start, end in tl.speaking:  # the assistant's turns, behind its words and audio
        for ax in axes[2:]:
            ax.axvspan(
                start * tl.frame_seconds,
                end * tl.frame_seconds,
                color=assistant_c,
                alpha=0.07,
                linewidth=0,
                zorder=0,
            )
    step = 1.0 if seconds <= 30 else 5.0
    for ax in axes:
        for s in np.arange(0, seconds + 1e-9, step):
            ax.axvline(s, color="0.88", linewidth=0.6, zorder=0)
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
        ax.tick_params(labelbottom=False)
    axes[-1].tick_params(labelbottom=True)
    if seconds <= 12:  # frame ticks while they stay readable
        axes[-1].set_xticks(np.arange(0, seconds + 1e-9, tl.frame_seconds), minor=True)
    axes[-1].set_xlabel(
        f"time (s); one frame = {tl.frame_seconds * 1000:.0f} ms, {tl.frames} frames", fontsize=9
    )
    if tl.title:
        fig.suptitle(tl.title, fontsize=10, x=1.3 / width, ha="left")
    return fig


def save(timeline: Timeline, path) -> Path:
    """Draw the timeline to a PNG at ``path``, with the output checks of ``save_wav``: a
    regular file is written beside the target and renamed over it, never truncated in place."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from ...audio.io import check_output

    path = Path(os.fsdecode(path))
    target = check_output(path)
    fig = draw(timeline)
    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    write_file(target, buf.getvalue(), PlotError, path)
    return path
