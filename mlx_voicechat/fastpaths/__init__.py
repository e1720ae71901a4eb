"""The fast paths: where a network runs code of ours instead of its anchor's (an mlx-lm /
mlx-audio block, or our own general path), listed in :data:`PATHS`.

Each computes the anchor's values in the same order, so bit-identical on the CPU (MLX's x86-64
CPU kernels have no FMA); ``tests/fastpaths/test_fastpaths.py`` checks each against its anchor.
The code that takes one asks :func:`enabled`; :func:`disabled` turns them off (tests,
debugging). Compiled ones hold their weights as trace constants, rebuilt when the weights change
(:mod:`.derived`). :data:`CHECKED_AGAINST` is what they were checked against; pyproject.toml
admits each one's minor series, and the test holds the bounds and the table together.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Dict, Iterator

import mlx.core as mx

#: The versions the anchors were checked against; pyproject.toml admits each one's minor series.
CHECKED_AGAINST = {"mlx": "0.32.4", "mlx-lm": "0.32.2", "mlx-audio": "0.6.2"}


@dataclass(frozen=True)
class FastPath:
    name: str
    does: str
    anchor: str
    applies: str


PATHS: Dict[str, FastPath] = {
    p.name: p
    for p in (
        FastPath(
            "llm.step",
            "one token through the Nemotron-H layers: each Mamba mixer as a one-step "
            "recurrence, each run of Mamba / MLP blocks between attention layers compiled",
            "mlx_lm.models.nemotron_h.NemotronHModel (its SSD scan at length 1)",
            "a single position on caches whose Mamba states are filled, off Metal (mlx-lm has "
            "a Metal kernel for this step)",
        ),
        FastPath(
            "llm.row_attention",
            "an attention layer over rows that each keep their own KV cache (rows of a batch "
            "at different lengths): projections for all rows at once, attention row by row",
            "mlx_lm.models.nemotron_h.NemotronHAttention with each row's own cache",
            "always (a batch of one is one row)",
        ),
        FastPath(
            "tts.backbone_step",
            "one position through the Gemma-3 backbone: everything between two layers' "
            "key / value caches compiled, RoPE at the rows' offsets as an array input",
            "mlx_lm.models.gemma3_text.TransformerBlock (with our offset RMSNorms)",
            "a single position on filled caches",
        ),
        FastPath(
            "tts.sampling",
            "the mask schedule of the MoG head and the RVQ refinement compiled, on 2-D rows, "
            "the noise drawn first in the op-by-op order",
            "EarTTS._sample on the op-by-op MoGHead.infer",
            "a MoG head whose infer is not overridden",
        ),
        FastPath(
            "encoder.frame",
            "one encoder frame on a full left context compiled (every shape is then fixed)",
            "the FastConformer layers op by op (mlx-audio's ConformerBlock modules)",
            "one frame, no padding, every layer's context full, on the CPU",
        ),
        FastPath(
            "encoder.convs",
            "the speech encoders' convolutions as matrix products and sums of strided slices "
            "(fastpaths.conv_products)",
            "mlx.nn.Conv1d / Conv2d (mlx-audio's subsampling and conformer convolution)",
            "float32 weights on the CPU",
        ),
        FastPath(
            "codec.step",
            "one code frame of the decoder as a compiled function: codebook gathers as one, "
            "depthwise convs as shifted sums, k1 / transposed convs as matmuls",
            "AudioCodec.decode_step's general path",
            "one frame per row on a cache that has decoded a frame",
        ),
        FastPath(
            "heads.split",
            "a big text head's rows in two halves on two streams (the CPU's two cores)",
            "mlx.nn.Linear / QuantizedLinear over all rows",
            "on the CPU, heads of 16384 rows or more whose halves are views (quantized or "
            "half precision), in a live frame",
        ),
        FastPath(
            "asr.chunk",
            "one 14-frame chunk of the Nemotron-3.5-ASR encoder on a full left context compiled "
            "with its subsampling, the language prompt and the joint's projection",
            "the FastConformer layers op by op (mlx-audio's ConformerBlock modules)",
            "a whole chunk at a chunk boundary, every layer's context full",
        ),
        FastPath(
            "asr.mel",
            "the recognizer's mel filterbank product summed over each mel bin's band of FFT "
            "bins (in bin order, the bands' zeros left out), with the log, compiled",
            "audio.mel.LogMel's power @ fb (the filterbank mlx-audio computes)",
            "on the CPU",
        ),
        FastPath(
            "rnnt.lstm_step",
            "the prediction network's LSTM layers on column-major weights "
            "(fastpaths.layout.ColumnLSTM)",
            "mlx.nn.LSTM (the layers of mlx_audio.stt.models.nemotron_asr.rnnt.LSTM)",
            "float32 weights on the CPU, from load (fastpaths.layout.use_cpu_layout)",
        ),
        FastPath(
            "rnnt.frame",
            "one encoder frame of greedy transducer decoding on the device: up to "
            "max_symbols joint / prediction steps, unrolled and compiled",
            "listen.greedy.greedy_decode (mlx-audio's PredictNetwork / JointNetwork)",
            "always in a live frame",
        ),
        FastPath(
            "offline.encoder",
            "offline generation's listening as one encoder pass over the whole input (with its "
            "trailing silence), each frame's rows handed to the frame step, and the RNNT's "
            "symbols decoded after the loop (listen.greedy.greedy_decode)",
            "the frame step's listening: each frame's mel window on the encoder's context and "
            "its RNNT symbols",
            "runtime.generate, always",
        ),
        FastPath(
            "offline.codec",
            "offline generation's speech decoded by one codec pass over all code frames after "
            "the loop (the same codes; the audio within 1e-6 of the streamed codec's)",
            "the frame step's codec frame (AudioCodec.decode_step), the stream's delay removed",
            "runtime.generate, always",
        ),
    )
}

_off = threading.local()
_global_off: set = set()


def on_cpu() -> bool:
    """Whether MLX runs on the CPU (the condition most fast paths apply under)."""
    return mx.default_device().type == mx.DeviceType.cpu


def enabled(name: str) -> bool:
    """Whether the fast path ``name`` may be taken (it is on unless :func:`disabled`)."""
    if name not in PATHS:
        raise KeyError(f"no fast path named {name!r}")
    return name not in _global_off and name not in getattr(_off, "names", ())


@contextlib.contextmanager
def disabled(*names: str, all_threads: bool = True) -> Iterator[None]:
    """Turn fast paths off inside the block (all when no name is given);
    ``all_threads=False``: for the calling thread only."""
    names = tuple(names) or tuple(PATHS)
    for n in names:
        if n not in PATHS:
            raise KeyError(f"no fast path named {n!r}")
    if all_threads:
        added = [n for n in names if n not in _global_off]
        _global_off.update(added)
        try:
            yield
        finally:
            _global_off.difference_update(added)
    else:
        before = getattr(_off, "names", frozenset())
        _off.names = before | set(names)
        try:
            yield
        finally:
            _off.names = before
