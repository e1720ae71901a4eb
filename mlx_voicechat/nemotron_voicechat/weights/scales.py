"""Named scales of the random-weight model (``tiny`` for tests, ``small`` / ``medium`` for
benchmarks, ``full`` for the real 11B dimensions) and the small tokenizers that go with them.

The structural constants are the real model's (128 mels, [70, 0] attention context, conv kernel
9, 31 codebooks, 1764 samples per frame, 8 TTS iterations, ids bos 1 / eos 2 / pad 12 /
silence 11); widths, layer counts, codebook size and vocabulary shrink with the scale.
"""

from __future__ import annotations

from typing import Any, Dict, List

from ...config import NEMOTRON_NANO_9B_V2, VoiceChatConfig
from ...errors import VoiceChatError

# <SPECIAL_20> / <SPECIAL_21> open and close a tool call on the function channel.
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"] + [f"<SPECIAL_{i}>" for i in range(3, 24)]
RNNT_SPECIALS = ["<unk>"]

_CORPUS = (
    "What is the capital of France? The capital of France is Paris. "
    "Hello, how are you today? I am fine, thank you, and you? "
    "Please tell me the weather in Santa Clara this afternoon. "
    "The quick brown fox jumps over the lazy dog while the voice assistant answers. "
    "Turn on the lights in the kitchen and set a timer for ten minutes. "
    "Sure, here is a short answer: speech goes in, speech comes out, every eighty milliseconds. "
)


def _scale_presets() -> Dict[str, Dict[str, Any]]:
    tiny_text = {
        "vocab_size": 400,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "mamba_num_heads": 8,
        "mamba_head_dim": 16,
        "ssm_state_size": 16,
        "n_groups": 2,
        "hybrid_override_pattern": "M-M*-M",
        "max_position_embeddings": 4096,
    }
    medium_pattern = NEMOTRON_NANO_9B_V2["hybrid_override_pattern"]
    return {
        "tiny": {
            "text": tiny_text,
            "encoder": {
                "n_layers": 2,
                "d_model": 48,
                "n_heads": 4,
                "subsampling_conv_channels": 32,
            },
            "rnnt": {"vocab": 40, "pred_hidden": 32, "joint_hidden": 40},
            "tts": {
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_hidden_layers": 6,
                "num_attention_heads": 4,
                "num_key_value_heads": 4,
                "head_dim": 16,
                "sliding_window": 16,
                "query_pre_attn_scalar": 64,
                "latent_size": 32,
                "codebook_size": 64,
            },
            "mog": {"intermediate_size": 128, "low_rank": 8, "num_predictions": 32},
            "codec": {"base_channels": 16, "latent_dim": 32, "codebook_size": 64},
        },
        "small": {
            "text": {
                **tiny_text,
                "vocab_size": 32768,
                "hidden_size": 256,
                "intermediate_size": 512,
                "num_attention_heads": 8,
                "num_key_value_heads": 2,
                "head_dim": 32,
                "mamba_num_heads": 16,
                "mamba_head_dim": 32,
                "ssm_state_size": 32,
                "hybrid_override_pattern": "M-M-M*-M-M-M*-M-",
            },
            "encoder": {
                "n_layers": 6,
                "d_model": 128,
                "n_heads": 4,
                "subsampling_conv_channels": 64,
            },
            "rnnt": {"vocab": 256, "pred_hidden": 128, "joint_hidden": 128},
            "tts": {
                "hidden_size": 128,
                "intermediate_size": 256,
                "num_hidden_layers": 6,
                "num_attention_heads": 4,
                "num_key_value_heads": 4,
                "head_dim": 32,
                "sliding_window": 7500,
                "query_pre_attn_scalar": 256,
                "latent_size": 64,
                "codebook_size": 1024,
            },
            "mog": {"intermediate_size": 256, "low_rank": 16, "num_predictions": 256},
            "codec": {"base_channels": 32, "latent_dim": 64, "codebook_size": 1024},
        },
        "medium": {
            "text": {
                **tiny_text,
                "vocab_size": 131072,
                "hidden_size": 256,
                "intermediate_size": 896,
                "num_attention_heads": 8,
                "num_key_value_heads": 2,
                "head_dim": 32,
                "mamba_num_heads": 8,
                "mamba_head_dim": 64,
                "ssm_state_size": 32,
                "n_groups": 8,
                "hybrid_override_pattern": medium_pattern,
                "max_position_embeddings": 131072,
            },
            "encoder": {
                "n_layers": 24,
                "d_model": 128,
                "n_heads": 8,
                "subsampling_conv_channels": 64,
            },
            "rnnt": {"vocab": 1024, "pred_hidden": 128, "joint_hidden": 128},
            "tts": {
                "hidden_size": 128,
                "intermediate_size": 512,
                "num_hidden_layers": 28,
                "num_attention_heads": 4,
                "num_key_value_heads": 4,
                "head_dim": 32,
                "sliding_window": 7500,
                "query_pre_attn_scalar": 256,
                "latent_size": 128,
                "codebook_size": 1024,
            },
            "mog": {"intermediate_size": 512, "low_rank": 16, "num_predictions": 1024},
            "codec": {"base_channels": 32, "latent_dim": 128, "codebook_size": 1024},
        },
    }


SCALES = ("tiny", "small", "medium", "full")


def scale_config(scale: str = "tiny") -> VoiceChatConfig:
    """The config of a named scale; ``full`` is the real 11B model."""
    if scale == "full":
        return VoiceChatConfig(rnnt_vocabulary=_rnnt_pieces(1024))
    presets = _scale_presets()
    if scale not in presets:
        raise VoiceChatError(f"unknown scale {scale!r}; choose one of {', '.join(SCALES)}")
    p = presets[scale]
    text = {**NEMOTRON_NANO_9B_V2, **p["text"]}
    text.pop("num_hidden_layers", None)
    text["num_hidden_layers"] = len(text["hybrid_override_pattern"])
    enc, rnnt, tts, mog, codec = p["encoder"], p["rnnt"], p["tts"], p["mog"], p["codec"]
    d = {
        "model_type": "nemotron_voicechat",
        "text_config": text,
        "audio_config": {
            "encoder": enc,
            "decoder": {
                "pred_hidden": rnnt["pred_hidden"],
                "pred_rnn_layers": 2,
                "vocab_size": rnnt["vocab"],
            },
            "joint": {
                "encoder_hidden": enc["d_model"],
                "pred_hidden": rnnt["pred_hidden"],
                "joint_hidden": rnnt["joint_hidden"],
                "num_classes": rnnt["vocab"],
            },
            "output_dim": text["hidden_size"],
        },
        "tts_config": {
            **tts,
            "character_encoder": {
                "hidden_size": tts["hidden_size"],
                "intermediate_size": tts["intermediate_size"],
                "num_attention_heads": tts["num_attention_heads"],
                "num_key_value_heads": tts["num_key_value_heads"],
                "head_dim": tts["head_dim"],
                "query_pre_attn_scalar": tts["query_pre_attn_scalar"],
            },
            "mog_head": mog,
        },
        "codec_config": {**codec, "num_quantizers": 31},
        "rnnt_vocabulary": _rnnt_pieces(rnnt["vocab"]),
    }
    return VoiceChatConfig.from_dict(d)


# --- tokenizers -------------------------------------------------------------------------


def build_tokenizer(vocab_size: int):
    """A byte-level BPE (``tokenizers``) with the special tokens at ids 0..23, then exactly
    the 256 single-character byte tokens, then merges learned from a small built-in corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    target = min(vocab_size, len(SPECIAL_TOKENS) + 256 + 1024)
    trainer = trainers.BpeTrainer(
        vocab_size=target,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    return tok


def tokenizer_config() -> Dict[str, Any]:
    return {
        "backend": "tokenizers",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<SPECIAL_12>",
        "unk_token": "<unk>",
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 1 << 20,
    }


_LETTERS = list("abcdefghijklmnopqrstuvwxyz")


def _rnnt_pieces(n: int) -> List[str]:
    """A SentencePiece-like RNNT vocabulary of n pieces (index 0 = <unk>)."""
    pieces = RNNT_SPECIALS + ["\u2581"] + _LETTERS + ["\u2581" + c for c in _LETTERS]
    return letter_pieces(pieces + ["'", ",", ".", "?", "<en-US>"], n)


def letter_pieces(pieces: List[str], n: int) -> List[str]:
    """``pieces`` filled up to ``n`` with two-letter pieces (``aa``, ``ba``, ..., then with a
    word-start mark, then numbered), or cut to ``n``."""
    pieces = list(pieces)
    i = 0
    while len(pieces) < n:
        a, b = _LETTERS[i % 26], _LETTERS[(i // 26) % 26]
        pieces.append(("\u2581" if (i // 676) % 2 else "") + a + b + ("" if i < 1352 else str(i)))
        i += 1
    return pieces[:n]
