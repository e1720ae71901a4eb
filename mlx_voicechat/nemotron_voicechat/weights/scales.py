"""Named scales of the random-weight model (``tiny`` for tests, ``small`` / ``medium`` for
benchmarks, ``full`` for the real 11B dimensions) and the small tokenizers that go with them.
Only widths, layer counts, codebook size and vocabulary shrink; the rest is the real model's.
"""

from __future__ import annotations

from typing import Any, Dict, List, Sequence

from ...config import NEMOTRON_NANO_9B_V2, VoiceChatConfig
from ...config.layouts import GEMMA_KEYS
from ...errors import VoiceChatError

# <SPECIAL_20> / <SPECIAL_21> open and close a tool call on the function channel.
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"] + [f"<SPECIAL_{i}>" for i in range(3, 24)]

_CORPUS = (
    "What is the capital of France? The capital of France is Paris. "
    "Hello, how are you today? I am fine, thank you, and you? "
    "Please tell me the weather in Santa Clara this afternoon. "
    "The quick brown fox jumps over the lazy dog while the voice assistant answers. "
    "Turn on the lights in the kitchen and set a timer for ten minutes. "
    "Sure, here is a short answer: speech goes in, speech comes out, every eighty milliseconds. "
)


# Each value per preset scale: (tiny, small, medium); ``full`` is the real model.
_PRESETS = {
    "text": {
        "vocab_size": (400, 32768, 131072),
        "hidden_size": (64, 256, 256),
        "intermediate_size": (96, 512, 896),
        "num_attention_heads": (4, 8, 8),
        "num_key_value_heads": (2, 2, 2),
        "head_dim": (16, 32, 32),
        "mamba_num_heads": (8, 16, 8),
        "mamba_head_dim": (16, 32, 64),
        "ssm_state_size": (16, 32, 32),
        "n_groups": (2, 2, 8),
        "hybrid_override_pattern": (
            "M-M*-M",
            "M-M-M*-M-M-M*-M-",
            NEMOTRON_NANO_9B_V2["hybrid_override_pattern"],
        ),
        "max_position_embeddings": (4096, 4096, 131072),
    },
    "encoder": {
        "n_layers": (2, 6, 24),
        "d_model": (48, 128, 128),
        "n_heads": (4, 4, 8),
        "subsampling_conv_channels": (32, 64, 64),
    },
    "rnnt": {
        "vocab": (40, 256, 1024),
        "pred_hidden": (32, 128, 128),
        "joint_hidden": (40, 128, 128),
    },
    "tts": {
        "hidden_size": (64, 128, 128),
        "intermediate_size": (128, 256, 512),
        "num_hidden_layers": (6, 6, 28),
        "num_attention_heads": (4, 4, 4),
        "num_key_value_heads": (4, 4, 4),
        "head_dim": (16, 32, 32),
        "sliding_window": (16, 7500, 7500),
        "query_pre_attn_scalar": (64, 256, 256),
        "latent_size": (32, 64, 128),
        "codebook_size": (64, 1024, 1024),
    },
    "mog": {
        "intermediate_size": (128, 256, 512),
        "low_rank": (8, 16, 16),
        "num_predictions": (32, 256, 1024),
    },
    "codec": {
        "base_channels": (16, 32, 32),
        "latent_dim": (32, 64, 128),
        "codebook_size": (64, 1024, 1024),
    },
}
# The character encoder is built to the backbone's sizes (but for its one layer).
_CHAR_FROM_TTS = [k for k in GEMMA_KEYS if k in _PRESETS["tts"] and k != "num_hidden_layers"]


SCALES = ("tiny", "small", "medium", "full")


def scale_config(scale: str = "tiny") -> VoiceChatConfig:
    """The config of a named scale; ``full`` is the real 11B model."""
    if scale == "full":
        return VoiceChatConfig(rnnt_vocabulary=letter_pieces(1024, tail=["<en-US>"]))
    if scale not in SCALES:
        raise VoiceChatError(f"unknown scale {scale!r}; choose one of {', '.join(SCALES)}")
    i = SCALES.index(scale)
    p = {part: {k: v[i] for k, v in table.items()} for part, table in _PRESETS.items()}
    text = {**NEMOTRON_NANO_9B_V2, **p["text"]}
    del text["num_hidden_layers"]  # written again last, as the checkpoints have it
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
            "character_encoder": {k: tts[k] for k in _CHAR_FROM_TTS},
            "mog_head": mog,
        },
        "codec_config": {**codec, "num_quantizers": 31},
        "rnnt_vocabulary": letter_pieces(rnnt["vocab"], tail=["<en-US>"]),
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


def letter_pieces(n: int, tags: Sequence[str] = (), tail: Sequence[str] = ()) -> List[str]:
    """A SentencePiece-like vocabulary of ``n`` pieces: ``<unk>`` (index 0), the word-start mark,
    ``tags``, the letters alone and word-initial, punctuation, ``tail``, filled up with
    two-letter pieces (``aa``, ``ba``, ..., then with a word-start mark, then numbered), or cut
    to ``n``."""
    pieces = ["<unk>", "\u2581", *tags] + _LETTERS + ["\u2581" + c for c in _LETTERS]
    pieces += ["'", ",", ".", "?", *tail]
    i = 0
    while len(pieces) < n:
        a, b = _LETTERS[i % 26], _LETTERS[(i // 26) % 26]
        pieces.append(("\u2581" if (i // 676) % 2 else "") + a + b + ("" if i < 1352 else str(i)))
        i += 1
    return pieces[:n]
