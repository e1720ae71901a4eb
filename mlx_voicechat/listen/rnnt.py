"""The RNNT transcript head (mlx-audio's prediction and joint networks) and the one greedy
transducer step, :func:`greedy_step`: a live frame unrolls it over its encoder frame
(:func:`frame_greedy`, fast path ``rnnt.frame``), everything else runs it in rounds
(``listen.greedy``)."""

from __future__ import annotations

import functools
import re
from typing import Optional, Sequence, Tuple

import mlx.core as mx
from mlx_audio.stt.models.nemotron_asr.config import JointArgs, PredictArgs
from mlx_audio.stt.models.nemotron_asr.rnnt import LSTM, JointNetwork, PredictNetwork

from .. import fastpaths
from ..config import RNNTDecoderConfig, RNNTJointConfig
from ..derived import compiled, derived

NO_TOKEN = -1  # greedy_step's token where a row emitted none
SPECIAL_PIECES = frozenset({"<unk>", "<pad>", "<s>", "</s>"})
LANGUAGE_TAG = re.compile(r"^<[a-z]{2,3}-[A-Za-z0-9]{2,4}>$")
WORD_BOUNDARY = "\u2581"  # SentencePiece's "▁"


class StackedLSTM(LSTM):
    """mlx-audio's stacked LSTM, fed batch-first: its time-major transpose makes
    ``nn.LSTM`` read the time axis as the batch, which is only right for one step."""

    def __call__(self, x: mx.array, h_c=None):
        h, c = h_c if h_c is not None else ([None] * self.num_layers, [None] * self.num_layers)
        next_h, next_c = [], []
        for i, layer in enumerate(self.lstm):
            x, cells = layer(x, hidden=h[i], cell=c[i])
            next_h.append(x[:, -1])
            next_c.append(cells[:, -1])
        return x, (mx.stack(next_h), mx.stack(next_c))


class RNNTDecoder(PredictNetwork):
    """``stt_model.rnnt_decoder``: embedding (+ the blank row) and the stacked LSTM.

    ``__call__(y [B, U] or None, state)`` -> (outputs [B, U, H], (h, c) each [layers, B, H]);
    ``y=None`` is the start symbol (a zero input, NeMo's blank-as-pad)."""

    def __init__(self, cfg: RNNTDecoderConfig):
        super().__init__(PredictArgs(**cfg.to_dict()))
        self.blank_as_pad = cfg.blank_as_pad
        hidden = cfg.pred_hidden
        self.prediction["dec_rnn"] = StackedLSTM(hidden, hidden, cfg.pred_rnn_layers)

    def step(self, y: mx.array, state: Tuple[mx.array, mx.array]):
        """:func:`predict_step` on this network."""
        return predict_step(self, y, state)

    def predict(self, labels: mx.array, state=None, add_sos: bool = True):
        """Teacher forcing (NeMo ``predict``): outputs for [start, y1, ..., yU] when ``add_sos``."""
        x = self.prediction["embed"](labels)
        if add_sos:
            x = mx.concatenate([mx.zeros_like(x[:, :1]), x], axis=1)
        return self.prediction["dec_rnn"](x, state)


class RNNTJoint(JointNetwork):
    """``stt_model.rnnt_joint``: enc / pred Linear, activation, ``joint_net.2`` to vocab + blank."""

    def __init__(self, cfg: RNNTJointConfig):
        super().__init__(JointArgs(**cfg.to_dict()))

    @property
    def blank_id(self) -> int:
        # Errata 15: the blank is the joint's last output.
        return self.joint_net[-1].weight.shape[0] - 1

    def project_encoder(self, enc: mx.array) -> mx.array:
        return self.enc(enc)

    def project_prediction(self, pred: mx.array) -> mx.array:
        return self.pred(pred)

    def logits(self, enc_proj: mx.array, pred_proj: mx.array) -> mx.array:
        """Joint logits of already-projected encoder and prediction frames (broadcast)."""
        x = enc_proj + pred_proj
        for layer in self.joint_net:
            x = layer(x)
        return x


def predict_step(decoder, y: mx.array, state):
    """One token per row through a prediction network: ``y`` [B] int, ``state`` (h, c) each
    [layers, B, H] -> (output [B, H], (h, c))."""
    out, state = decoder(y[:, None], state)
    return out[:, -1], state


def greedy_step(predict, joint, e, pred, h, c, t, sym, length, blank: int, max_symbols: int):
    """One step of NeMo's greedy transducer rule for every row, on the device: the blank steps
    up to the window's first non-blank settle at once (a blank keeps the prediction), that
    token is emitted and the prediction adopted; after ``max_symbols`` tokens at one frame the
    cursor advances without a step.

    ``e`` [B, W, J]: projected encoder frames from each row's cursor ``t`` [B] (``length`` [B]
    frames); ``pred`` [B, J], ``h`` / ``c`` [layers, B, H]: the prediction after each row's last
    token; ``sym`` [B]: tokens at the current frame; ``predict``: :func:`predict_step` on the
    prediction network. Returns ``(jump, token or NO_TOKEN, pred, h, c, t, sym)``."""
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
    out, (h2, c2) = predict(mx.where(emit, k, 0), (h, c))
    pred2 = joint.project_prediction(out)
    keep = emit[None, :, None]
    h, c = mx.where(keep, h2, h), mx.where(keep, c2, c)
    pred = mx.where(emit[:, None], pred2, pred)
    sym = mx.where(emit, sym + 1, sym)
    forced = emit & (sym >= max_symbols)
    t = t + forced.astype(mx.int32)
    sym = mx.where(forced, 0, sym)
    return jump, mx.where(emit, k, NO_TOKEN), pred, h, c, t, sym


def start_state(decoder, joint, batch: int = 1, token: Optional[int] = None):
    """The start symbol's prediction for ``batch`` rows: (projected prediction [B, J], LSTM
    state (h, c) [layers, B, H]). ``token`` None: a zero input (NeMo's blank-as-pad); the
    recognizer embeds its blank as Transformers does (the same while that row is zero, as
    in weights converted from NeMo)."""
    out, (h, c) = decoder(None if token is None else mx.array([[token]], dtype=mx.int32), None)
    pred = joint.project_prediction(out[:, -1])
    tile = lambda a, axis: mx.repeat(a, batch, axis=axis) if batch > 1 else a  # noqa: E731
    return tile(pred, 0), (tile(h, 1), tile(c, 1))


def frame_greedy(decoder, joint: "RNNTJoint", enc_proj, h, c, pred, blank: int, steps: int):
    """:func:`greedy_step` ``steps`` (``max_symbols``) times over one encoder frame per row:
    ``enc_proj`` [B, J] -> (labels [B, steps]: the frame's tokens, then ``blank``; h, c, pred)."""
    predict = functools.partial(predict_step, decoder)
    one = mx.ones((enc_proj.shape[0],), mx.int32)
    t = sym = 0 * one
    labels = []
    for _ in range(steps):
        _, k, pred, h, c, t, sym = greedy_step(
            predict, joint, enc_proj[:, None], pred, h, c, t, sym, one, blank, steps
        )
        labels.append(mx.where(k == NO_TOKEN, blank, k))
    return mx.stack(labels, axis=1), h, c, pred


class FrameDecoder:
    """:func:`frame_greedy` for a decoder / joint pair, compiled (``rnnt.frame``), and the
    prediction state a stream starts from."""

    def __init__(self, decoder, joint: "RNNTJoint", max_symbols: Optional[int]):
        if max_symbols is None or max_symbols < 1:
            raise ValueError(
                f"live RNNT decoding needs max_symbols >= 1 per frame, got {max_symbols!r}"
            )
        self.decoder, self.joint = decoder, joint
        self.blank, self.steps = joint.blank_id, int(max_symbols)

    def start(self):
        """``(h, c, pred)`` of a stream before its first token: ``[layers, 1, H]`` twice and
        ``[1, J]`` (the start symbol's prediction)."""

        def build():
            pred, (h, c) = start_state(self.decoder, self.joint)
            mx.eval(h, c, pred)
            return h, c, pred

        return derived(self.joint, "rnnt.start", build)

    def __call__(self, enc_proj, h, c, pred):
        run = lambda e, h, c, p: frame_greedy(  # noqa: E731
            self.decoder, self.joint, e, h, c, p, self.blank, self.steps
        )
        if not fastpaths.enabled("rnnt.frame"):
            return run(enc_proj, h, c, pred)
        fn = derived(self.joint, "rnnt.frame", lambda: compiled(run), (self.blank, self.steps))
        return fn(enc_proj, h, c, pred)


def read_piece(vocabulary: Sequence[str], token_id) -> Tuple[Optional[str], Optional[str]]:
    """``(piece, language)`` of an id: its text piece, None for the blank, ids past the
    vocabulary, special pieces and ``<xx-XX>`` tags; a tag's language, else None."""
    i = int(token_id)
    piece = vocabulary[i] if 0 <= i < len(vocabulary) else None
    if piece is None or piece in SPECIAL_PIECES:
        return None, None
    return (None, piece[1:-1]) if LANGUAGE_TAG.match(piece) else (piece, None)


def decode_pieces(ids: Sequence[int], vocabulary: Sequence[str]) -> Tuple[str, Optional[str]]:
    """SentencePiece ids -> (text, language): special pieces and ``<xx-XX>`` tags are dropped
    (the last tag is the detected language), ``▁`` becomes a space, the ends are stripped."""
    pieces, language = [], None
    for i in ids:
        piece, tag = read_piece(vocabulary, i)
        language = tag or language
        if piece is not None:
            pieces.append(piece)
    return "".join(pieces).replace(WORD_BOUNDARY, " ").strip(), language
