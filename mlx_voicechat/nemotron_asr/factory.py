"""Random-weight Nemotron-3.5-ASR checkpoints in either layout, for tests and benchmarks: scales
``tiny`` / ``small`` / ``full`` with the real model's structure, the joint's blank bias set so
that random models emit tokens at a speech-like rate. A pure function of its arguments.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List, Optional

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from ..config import EncoderConfig, RNNTDecoderConfig, RNNTJointConfig
from ..errors import VoiceChatError
from ..files import atomic_folder
from ..nemotron_voicechat.weights.loading import check_write_options
from ..nemotron_voicechat.weights.random_init import is_norm, keyed_parameters, random_value
from ..nemotron_voicechat.weights.scales import letter_pieces
from ..nemotron_voicechat.weights.writer import (
    cast_floats,
    quantize_listed,
    save_safetensors,
    write_json,
)
from .config import ASRConfig, PromptConfig, transformers_config
from .layout import to_transformers

ASR_SCALES = ("tiny", "small", "full")
ASR_LAYOUTS = ("mlx-audio", "transformers")
BLANK_SHARE = 0.85  # of the steps on noise, for the blank bias
_LANGUAGES = ["en-US", "es-ES", "de-DE", "fr-FR", "it-IT", "ja-JP", "zh-CN", "pt-BR"]
_TOKENIZER_CONFIG = {  # the Transformers layout's tokenizer_config.json
    "tokenizer_class": "PreTrainedTokenizerFast",
    "unk_token": "<unk>",
    "pad_token": "<unk>",
}

# Each scale: d_model, layers, heads, subsampling channels, vocabulary, prediction (and joint)
# width, prompts, prompt hidden width.
_PRESETS = {
    "tiny": (32, 2, 4, 16, 64, 32, 16, 32),
    "small": (192, 6, 4, 64, 1024, 160, 128, 384),
    "full": (1024, 24, 8, 256, 13087, 640, 128, 2048),
}


def recognizer_vocabulary(n: int) -> List[str]:
    """The factory's SentencePiece-like vocabulary of ``n`` pieces, the language tags in it."""
    return letter_pieces(n, tags=[f"<{lang}>" for lang in _LANGUAGES])


def asr_scale_config(scale: str = "tiny", prompt: bool = True) -> ASRConfig:
    """The config of a named scale; ``prompt=False``: without the language prompt (the
    English-only ``nemotron_asr_streaming`` kind)."""
    if scale not in _PRESETS:
        raise VoiceChatError(
            f"unknown recognizer scale {scale!r}; choose one of {', '.join(ASR_SCALES)}"
        )
    d, layers, heads, sub, vocab, pred, prompts, prompt_hidden = _PRESETS[scale]
    n_prompts = prompts if prompt else 0
    dictionary = {}
    for i, lang in enumerate(_LANGUAGES[: max(n_prompts - 1, 0)]):
        dictionary[lang] = dictionary[lang.split("-")[0]] = i
    auto = max(min(101, n_prompts - 1), 0)  # the real model's slot, or the last one
    if n_prompts:
        dictionary["auto"] = auto
    return ASRConfig(  # preprocessor and lookaheads: the real model's (the defaults)
        encoder=EncoderConfig(
            n_layers=layers,
            d_model=d,
            n_heads=heads,
            subsampling_conv_channels=sub,
            att_context_size=(56, 13),
        ),
        prompt=PromptConfig(
            num_prompts=n_prompts,
            prompt_hidden=prompt_hidden,
            prompt_dictionary=dictionary,
            default_prompt_id=auto,
        ),
        decoder=RNNTDecoderConfig(pred_hidden=pred, pred_rnn_layers=2, vocab_size=vocab),
        joint=RNNTJointConfig(
            encoder_hidden=d, pred_hidden=pred, joint_hidden=pred, num_classes=vocab
        ),
        vocabulary=recognizer_vocabulary(vocab),
    )


def random_recognizer_weights(model, seed: int = 0) -> Dict[str, mx.array]:
    """Deterministic random values for every parameter (MLX layout), then the blank bias."""
    out = {}
    for (name, p), k in keyed_parameters(model, seed):
        around_one = is_norm(name) and name.endswith("weight")
        small = name.endswith(("pos_bias_u", "pos_bias_v"))
        v = random_value(name, p.shape, k, around_one=around_one, small=small)
        out[name] = v.astype(p.dtype)
    blank = model.config.blank_id
    embed = "decoder.prediction.embed.weight"
    out[embed] = mx.concatenate([out[embed][:blank], mx.zeros_like(out[embed][blank:])])
    model.load_weights(list(out.items()), strict=True)
    out["joint.joint_net.2.bias"] = _blank_bias(model, seed)
    return out


def _blank_bias(model, seed: int) -> mx.array:
    """The joint's bias with the blank's raised so that ``BLANK_SHARE`` of the steps over two
    seconds of noise are blank, over prediction states after random tokens."""
    rng = np.random.default_rng(seed)
    noise = (0.1 * rng.standard_normal(32000)).astype(np.float32)
    mel, mel_len = model.frontend(mx.array(noise)[None], mx.array([len(noise)]))
    total = int(model.encoder.output_lengths(mel_len)[0].item())
    enc = model.encoder.encode(mel, mel_len, total)
    pid = mx.array([model.config.prompt.default_prompt_id], dtype=mx.int32)
    frames = model.joint_frames(enc, pid)[0]
    blank = model.config.blank_id
    start, _ = model.start(1)
    tokens = mx.array(rng.integers(0, blank, (1, 64)), dtype=mx.int32)
    out, _ = model.decoder.predict(tokens)
    preds = mx.concatenate([start, model.joint.project_prediction(out[0])])  # [65, J]
    logits = model.joint.logits(frames[:, None], preds[None])  # [T, 33, V + 1]
    margin = mx.max(logits[..., :blank], axis=-1) - logits[..., blank]
    shift = float(np.quantile(np.array(margin.astype(mx.float32)), BLANK_SHARE))
    bias = model.joint.joint_net[-1].bias
    return bias + mx.where(mx.arange(bias.shape[0]) == blank, shift, 0.0).astype(bias.dtype)


def _tokenizer_json(vocabulary: List[str], blank: int) -> Dict:
    """A Transformers ``tokenizer.json`` for the pieces (BPE vocabulary, Metaspace) with
    ``<blank>`` as the added token after them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {p: i for i, p in enumerate(vocabulary)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.add_special_tokens(["<blank>"])
    return json.loads(tok.to_str())


def make_recognizer_checkpoint(
    out_dir,
    scale: str = "tiny",
    layout: str = "mlx-audio",
    *,
    quantize: Optional[int] = None,
    group_size: int = 64,
    seed: int = 0,
    dtype: str = "float32",
    prompt: bool = True,
    force: bool = False,
) -> Path:
    """Write a random-weight recognizer checkpoint and return its folder (see
    :func:`mlx_voicechat.nemotron_voicechat.weights.factory.make_checkpoint` for ``out_dir`` and
    ``force``). ``prompt=False`` leaves the language prompt out (Transformers:
    ``nemotron_asr_streaming``)."""
    from ..nemotron_voicechat.weights.factory import check_target
    from .network import RecognizerNetwork as Recognizer

    if layout not in ASR_LAYOUTS:
        raise VoiceChatError(
            f"unknown recognizer layout {layout!r}; choose one of {', '.join(ASR_LAYOUTS)}"
        )
    if quantize and layout == "transformers":
        raise VoiceChatError(
            "the Transformers layout is not quantized; quantize mlx-audio's layout"
        )
    check_write_options(quantize, dtype, group_size, VoiceChatError)
    out_dir, replace = check_target(out_dir, force)
    config = asr_scale_config(scale, prompt)
    model = Recognizer(config)
    weights = random_recognizer_weights(model, seed)
    weights = cast_floats(weights, getattr(mx, dtype))
    model.load_weights(list(weights.items()), strict=True)
    if quantize:
        listed = [
            path
            for path, m in model.named_modules()
            if hasattr(m, "to_quantized") and m.weight.shape[-1] % group_size == 0
        ]
        quantize_listed(model, listed, quantize, group_size, f"{scale} recognizer")
        config.quantization = {"group_size": group_size, "bits": quantize, "mode": "affine"}
        weights = dict(tree_flatten(model.parameters()))

    with atomic_folder(out_dir, replace) as tmp:
        if layout == "mlx-audio":
            write_json(tmp / "config.json", config.to_dict())
            save_safetensors(tmp / "model.safetensors", weights)
        else:
            cfg, processor = transformers_config(config)
            write_json(tmp / "config.json", cfg)
            write_json(tmp / "processor_config.json", processor)
            write_json(tmp / "tokenizer.json", _tokenizer_json(config.vocabulary, config.blank_id))
            write_json(tmp / "tokenizer_config.json", _TOKENIZER_CONFIG)
            save_safetensors(tmp / "model.safetensors", to_transformers(weights), {"format": "pt"})
    return out_dir
