"""Nemotron-3.5-ASR's Transformers layout as data: the rename tables of ``config.json`` and
``processor_config.json`` (for ``sections.read_fields`` / ``write_fields``), the class defaults
that differ from ours, the ``tokenizer.json`` vocabulary and the prompts' dictionary."""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional

from ..config.sections import ConfigError


def _require(d: Mapping[str, Any], key: str, want, what: str) -> None:
    if key in d and d[key] != want:
        raise ConfigError(f"{what} {key}={d[key]!r} is not supported ({want!r} only)")


def transformers_vocabulary(tokenizer: Optional[Mapping[str, Any]], blank: int) -> List[str]:
    """The pieces with ids below the blank from a ``tokenizer.json`` (BPE ``{piece: id}`` or
    Unigram ``[[piece, score], ...]``); they must be exactly ids ``0 .. blank - 1``."""
    model = (tokenizer or {}).get("model") if isinstance(tokenizer, Mapping) else None
    vocab = (model or {}).get("vocab")
    if isinstance(vocab, list):
        vocab = {entry[0]: i for i, entry in enumerate(vocab) if isinstance(entry, (list, tuple))}
    if not isinstance(vocab, dict) or not vocab:
        raise ConfigError("tokenizer.json has no model.vocab to read the recognizer's pieces from")
    by_id = {int(i): str(p) for p, i in vocab.items() if int(i) < blank}
    if sorted(by_id) != list(range(blank)):
        raise ConfigError(
            f"tokenizer.json must hold the {blank} pieces with ids 0..{blank - 1} (the blank is "
            f"{blank}); it has {len(by_id)} of them"
        )
    return [by_id[i] for i in range(blank)]


def _default_prompt_dictionary() -> Dict[str, int]:
    """Transformers' copy of NeMo's prompt dictionary, for a checkpoint whose
    ``processor_config.json`` has none (empty when that module is not there)."""
    try:
        from transformers.models.nemotron3_5_asr import processing_nemotron3_5_asr as p

        return dict(p.DEFAULT_PROMPT_DICTIONARY)
    except Exception:  # an older transformers, or one that cannot import it here
        return {}


# Transformers' names for our fields. A key a config leaves out takes Transformers' class
# default (NemotronAsrStreamingEncoderConfig, NemotronAsrStreamingFeatureExtractor, the
# processors; 5.23 writes every key, older versions or hand-edited folders need not): our
# dataclasses' default, but for the keys in the _DEFAULTS below.
TRANSFORMERS = {
    "model_type": "=model_type",
    "vocab_size": None,
    "decoder_hidden_size": "@decoder.pred_hidden|joint.pred_hidden|joint.joint_hidden",
    "num_decoder_layers": "@decoder.pred_rnn_layers",
    "hidden_act": "@joint.activation",
    "max_symbols_per_step": "@max_symbols",
    "encoder_config": {
        "model_type": "nemotron_asr_streaming_encoder",
        "hidden_size": "@encoder.d_model|joint.encoder_hidden",
        "num_hidden_layers": "@encoder.n_layers",
        "num_attention_heads": "@encoder.n_heads",
        "num_key_value_heads": "=encoder.n_heads",
        "intermediate_size": None,
        "hidden_act": "silu",
        "attention_bias": None,
        "convolution_bias": None,
        "conv_kernel_size": "@encoder.conv_kernel_size",
        "subsampling_factor": "@encoder.subsampling_factor",
        "subsampling_conv_channels": "@encoder.subsampling_conv_channels",
        "num_mel_bins": "@encoder.feat_in",
        "subsampling_conv_kernel_size": 3,
        "subsampling_conv_stride": 2,
        "max_position_embeddings": "@encoder.pos_emb_max_len",
        "scale_input": "@encoder.xscaling",
        "sliding_window": None,
        "default_num_lookahead_tokens": "=lookahead",
    },
    "pad_token_id": 0,
    "blank_token_id": "=blank_id",
    "is_encoder_decoder": True,
}
PROMPT = {  # config.json of a model with the language prompt
    "architectures": ["Nemotron3_5AsrForRNNT"],
    "model_type": "nemotron3_5_asr",
    "num_prompts": "@prompt.num_prompts",
    "prompt_intermediate_size": "@prompt.prompt_hidden",
    "default_prompt_id": "@prompt.default_prompt_id",
}
PROCESSOR = {
    "feature_extractor": {
        "feature_extractor_type": "NemotronAsrStreamingFeatureExtractor",
        "feature_size": "@preprocessor.features",
        "sampling_rate": "@preprocessor.sample_rate",
        "hop_length": "=preprocessor.hop_length",
        "n_fft": "@preprocessor.n_fft",
        "win_length": "=preprocessor.win_length",
        "preemphasis": "@preprocessor.preemph",
        "padding_value": "@preprocessor.pad_value",
        "mel_filters_dtype": "@mel_filters_dtype",
    },
    "supported_num_lookahead_tokens": "@lookaheads",
    "default_num_lookahead_tokens": "=lookahead",
}
_ENCODER_DEFAULTS = {
    "attention_bias": True,
    "convolution_bias": True,
    "num_mel_bins": 80,
    "scale_input": True,
    "sliding_window": 71,
}
_FEATURE_DEFAULTS = {"feature_size": 80, "win_length": 400, "hop_length": 160}
