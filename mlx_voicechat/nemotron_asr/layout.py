"""Nemotron-3.5-ASR's Transformers tensor layout (names, PyTorch shapes) to the MLX tree
(mlx-audio's names) and back; idempotent: renames anchored on the key, transposes gated on the
expected shape, the LSTM's two biases summed (``nemotron_voicechat.weights.sanitize``).
"""

from __future__ import annotations

import re
from typing import Dict, Mapping

import mlx.core as mx

from ..nemotron_voicechat.weights.sanitize import expected_shapes, rename, sanitize, to_torch_layout

# (Transformers, ours) names, applied in this order either way: "^" anchors a name at the key's
# start, "$" at its end; others are infixes.
_RENAMES = (
    ("^encoder.subsampling.conv_in.", "^encoder.pre_encode.conv.0."),
    ("^encoder.subsampling.linear.", "^encoder.pre_encode.out."),
    (".conv.norm.", ".conv.batch_norm."),
    (".self_attn.q_proj.", ".self_attn.linear_q."),
    (".self_attn.k_proj.", ".self_attn.linear_k."),
    (".self_attn.v_proj.", ".self_attn.linear_v."),
    (".self_attn.o_proj.", ".self_attn.linear_out."),
    (".self_attn.relative_k_proj.", ".self_attn.linear_pos."),
    (".self_attn.bias_u$", ".self_attn.pos_bias_u$"),
    (".self_attn.bias_v$", ".self_attn.pos_bias_v$"),
    ("^decoder.embedding.", "^decoder.prediction.embed."),
    ("^decoder.lstm.", "^decoder.prediction.dec_rnn.lstm."),
    ("^decoder.decoder_projector.", "^joint.pred."),
    ("^encoder_projector.", "^joint.enc."),
    ("^joint.head.", "^joint.joint_net.2."),
    ("^prompt_projector.linear_1.", "^prompt_kernel.0."),
    ("^prompt_projector.linear_2.", "^prompt_kernel.2."),
)


def _rule(name: str, to: str):
    core = re.escape(name.strip("^$"))
    pattern = ("^" if name.startswith("^") else "") + core + ("$" if name.endswith("$") else "")
    return re.compile(pattern), to.strip("^$")


# The subsampling's convolutions: Transformers numbers its (depthwise, pointwise) pairs, the
# MLX tree (NeMo's Sequential) counts every module, the activations included.
_TO_OURS = tuple(_rule(theirs, ours) for theirs, ours in _RENAMES) + (
    (
        re.compile(r"^encoder\.subsampling\.layers\.(\d+)\.(depthwise|pointwise)_conv\."),
        lambda m: f"encoder.pre_encode.conv.{3 * int(m[1]) + (2 if m[2] == 'depthwise' else 3)}.",
    ),
)

_TO_TRANSFORMERS = tuple(_rule(ours, theirs) for theirs, ours in _RENAMES) + (
    (
        re.compile(r"^encoder\.pre_encode\.conv\.(\d+)\."),
        lambda m: "encoder.subsampling.layers.{}.{}.".format(
            (int(m[1]) - 2) // 3, "depthwise_conv" if (int(m[1]) - 2) % 3 == 0 else "pointwise_conv"
        ),
    ),
)

# Buffers of the Transformers modules that no inference path reads.
_IGNORED = re.compile(r"(\.num_batches_tracked|\.inv_freq)$")


def sanitize_recognizer(model, weights: Mapping[str, mx.array]) -> Dict[str, mx.array]:
    """Either layout's tensors onto ``model``'s parameter tree (unknown keys kept, so that
    strict loading names them)."""
    renamed = {rename(k, _TO_OURS): v for k, v in weights.items() if not _IGNORED.search(k)}
    return sanitize(renamed, expected_shapes(model))


def to_transformers(weights: Mapping[str, mx.array]) -> Dict[str, mx.array]:
    """MLX-layout tensors of :class:`~mlx_voicechat.nemotron_asr.network.RecognizerNetwork` in the
    Transformers layout (names and PyTorch shapes; the LSTM bias as ``bias_ih``, with a zero
    ``bias_hh``)."""
    torch_w = to_torch_layout(weights)
    return {rename(k, _TO_TRANSFORMERS): v for k, v in torch_w.items()}
