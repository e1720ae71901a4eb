"""A random-weight VoiceChat model built in memory: what :func:`mlx_voicechat.load` returns for
the checkpoint the factory would write with the same arguments (same bits, config and
tokenizer). It gives benchmarks the real 11B dimensions (``scale="full"``) without writing a
checkpoint; values are generated on the device and cast in groups of about a GiB.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from ...config import VoiceChatConfig
from ...errors import VoiceChatError
from ...fastpaths.layout import use_cpu_layout
from .loading import check_write_options
from .random_init import random_weights
from .scales import build_tokenizer, scale_config, tokenizer_config
from .writer import flat_config, quantize_like_mlx_community

# Parameters generated and cast per evaluation: bounds the float32 draws alive at once.
_EVAL_BYTES = 1 << 30


def random_model(
    scale: str = "tiny",
    *,
    quantize: Optional[int] = None,
    group_size: int = 64,
    dtype: str = "float32",
    seed: int = 0,
    model_class: Optional[type] = None,
):
    """A loaded random-weight model at a named scale, as if read from
    ``make_checkpoint(dir, scale, "mlx-community", quantize=..., dtype=..., seed=...)``.

    Args:
        scale: ``tiny``, ``small``, ``medium`` or ``full`` (the real 11B dimensions).
        quantize: 4 or 8 quantizes what the mlx-community checkpoints quantize (the LLM's
            mixer projections, its embedding and both heads); everything else keeps ``dtype``.
        dtype: ``float32``, ``bfloat16`` (the mlx-community checkpoints) or ``float16``.
        model_class: the class to build (default: the parameter tree, ``VoiceChatModel``; pass
            :class:`mlx_voicechat.nemotron_voicechat.Model` for ``generate`` / ``session``).
    """
    if model_class is None:
        from ..model import VoiceChatModel as model_class
    check_write_options(quantize, dtype, group_size, VoiceChatError)
    base = scale_config(scale)
    tokenizer = build_tokenizer(base.text_args.vocab_size)
    model = model_class(base)
    target = getattr(mx, dtype)
    weights, batch, size = {}, [], 0
    for name, value in sorted(random_weights(model, base, tokenizer, seed).items()):
        if mx.issubdtype(value.dtype, mx.floating):
            value = value.astype(target)
        weights[name] = value
        batch.append(value)
        size += value.size * 4
        if size >= _EVAL_BYTES:
            mx.eval(batch)
            batch, size = [], 0
    mx.eval(batch)
    model.load_weights(list(weights.items()), strict=True)
    del weights, batch
    quant_map = None
    if quantize:
        quant_map = quantize_like_mlx_community(model, quantize, group_size, scale)
    # The config the checkpoint would carry (its quantization map included).
    model.config = VoiceChatConfig.from_dict(flat_config(base, quant_map))
    model.eval()
    mx.eval(model.parameters())
    use_cpu_layout(model)
    from transformers import PreTrainedTokenizerFast

    special = {k: v for k, v in tokenizer_config().items() if k.endswith("_token")}
    model.rnnt_vocabulary = list(model.config.rnnt_vocabulary)
    model.setup_tokenizer(PreTrainedTokenizerFast(tokenizer_object=tokenizer, **special))
    return model
