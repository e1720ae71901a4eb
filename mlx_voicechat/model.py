"""The whole VoiceChat model's parameter tree, composed of the networks in :mod:`mlx_voicechat.nets`.

Parameter names are the checkpoint's key names (``stt_model.*``, ``tts_model.*``) in MLX
layout; :mod:`mlx_voicechat.weights.sanitize` maps NeMo / PyTorch layouts onto them. The
user-facing class, with the loader hooks and the runtime methods, is
:class:`mlx_voicechat.nemotron_voicechat.Model`; this module imports neither weights/ nor
runtime/.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Tuple, Union

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .config import VoiceChatConfig
from .errors import CheckpointError
from .nets.codec import AudioCodec
from .nets.llm import FusedNemotronH
from .nets.perception import Perception
from .nets.rnnt import FrameDecoder, RNNTDecoder, RNNTJoint
from .nets.tts import EarTTS
from .nets.version import Versioned


class STTModel(Versioned, nn.Module):
    """Listening and thinking: perception, the dual-head Nemotron-H, the RNNT transcript head."""

    def __init__(self, config: VoiceChatConfig):
        super().__init__()
        args = config.text_args
        audio = config.audio_config
        if audio.output_dim != args.hidden_size:
            raise CheckpointError(
                f"audio_config.output_dim ({audio.output_dim}) must equal the LLM hidden size "
                f"({args.hidden_size})"
            )
        self.perception = Perception(audio)
        self.llm = FusedNemotronH(args)
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.function_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.rnnt_decoder = RNNTDecoder(audio.decoder)
        self.rnnt_joint = RNNTJoint(audio.joint)


class SpeechModel(Versioned, nn.Module):
    """Speaking: EAR-TTS, the codec, the Aria voice prompt and the silence / control codes."""

    def __init__(self, config: VoiceChatConfig):
        super().__init__()
        tts = config.tts_config
        self.tts_model = EarTTS(
            tts, config.text_args.vocab_size, config.eos_token_id, config.pad_token_id
        )
        self.audio_codec = AudioCodec(config.codec_config)
        prompt_frames = int(tts.audio_prompt_duration / config.frame_duration)
        self.audio_prompt_latents = {config.speaker: mx.zeros((1, prompt_frames, tts.hidden_size))}
        self.codec_silence_tokens = mx.zeros((tts.num_quantizers,), dtype=mx.int32)
        self.control_codes = mx.zeros((3,), dtype=mx.int32)


class VoiceChatModel(Versioned, nn.Module):
    """The parameter tree of the whole model: listening and thinking (``stt_model``) and
    speaking (``tts_model``), plus the tokenizer and RNNT vocabulary once they are attached."""

    def __init__(self, config: VoiceChatConfig):
        super().__init__()
        if isinstance(config, dict):
            config = VoiceChatConfig.from_dict(config)
        self.config = config
        self.model_type = config.model_type
        self.stt_model = STTModel(config)
        self.tts_model = SpeechModel(config)
        self._checkpoint_keys: Optional[Dict[str, Tuple[int, ...]]] = None  # key -> shape
        self.tokenizer = None
        self.rnnt_vocabulary = list(config.rnnt_vocabulary)

    def load_weights(self, file_or_weights, strict: bool = True):
        if strict and not isinstance(file_or_weights, str):
            file_or_weights = list(file_or_weights)
            check_weights(self, dict(file_or_weights))
        return super().load_weights(file_or_weights, strict=strict)

    @property
    def rnnt_frames(self) -> FrameDecoder:
        """The RNNT head's live decoder: one encoder frame per call, on the device."""
        frames = self.__dict__.get("_rnnt_frames")
        if frames is None:
            stt = self.stt_model
            frames = FrameDecoder(stt.rnnt_decoder, stt.rnnt_joint, self.config.audio_config.max_symbols)
            object.__setattr__(self, "_rnnt_frames", frames)
        return frames

    def setup_tokenizer(self, tokenizer) -> None:
        """Attach the LLM tokenizer and build the character tables EAR-TTS derives from it."""
        self.tokenizer = tokenizer
        self.tts_model.tts_model.set_vocabulary(tokenizer)

    @property
    def layers(self):
        return self.stt_model.llm.layers

    def make_cache(self):
        return self.stt_model.llm.make_cache()

    # mlx-lm's text generation calls the model like a causal LM; this one is not.
    def __call__(self, *args, **kwargs):
        raise TypeError(
            "NemotronLabs VoiceChat is a speech-to-speech model and cannot run mlx-lm's text "
            "generation. Use `mlx-voicechat generate --model M --audio question.wav`, "
            "`python -m mlx_audio.sts.generate --model M --audio question.wav`, or "
            "`mlx_voicechat.load(M).generate('question.wav')`."
        )


def expected_shapes(model: "VoiceChatModel") -> Dict[str, Tuple[int, ...]]:
    """The parameter shapes ``model``'s config and quantization call for, whatever was loaded
    into it: a fresh, never evaluated copy of the parameter tree, quantized like ``model``."""
    fresh = VoiceChatModel(model.config)
    quantized = {
        name: {"group_size": m.group_size, "bits": m.bits, "mode": getattr(m, "mode", "affine")}
        for name, m in model.named_modules()
        if hasattr(m, "scales") and hasattr(m, "group_size")
    }
    if quantized:
        nn.quantize(fresh, class_predicate=lambda p, m: quantized.get(p, False))
    return {k: tuple(v.shape) for k, v in tree_flatten(fresh.parameters())}


def check_weights(model: nn.Module, weights: Mapping[str, Any]) -> None:
    """Raise one clear CheckpointError for a missing, unexpected or misshaped tensor (a value
    of None stands for a tensor whose shape is not known here)."""
    expected = {k: tuple(v.shape) for k, v in tree_flatten(model.parameters())}
    found = {k: None if v is None else tuple(v.shape) for k, v in weights.items()}
    check_shapes(expected, found)


def check_shapes(
    expected: Mapping[str, Tuple[int, ...]],
    found: Mapping[str, Optional[Tuple[int, ...]]],
    where: Union[str, Path] = "checkpoint",
    error: type = CheckpointError,
    model: str = "a NemotronLabs VoiceChat model",
) -> None:
    """``found`` (key -> shape, or None when unknown) must hold exactly the ``expected`` keys
    with their shapes; the first difference is raised as ``error``, naming the key. ``where``
    is a noun ("checkpoint") or a folder (a Path), ``model`` what the keys should describe."""
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise error(
            f"{where} is missing tensor '{missing[0]}' with shape "
            f"{list(expected[missing[0]])}{more}"
        )
    if unexpected:
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise error(
            f"{where} has unexpected tensor '{unexpected[0]}'{more}; it does not belong to "
            f"{model} with this config"
        )
    in_where = where if isinstance(where, Path) else f"the {where}"
    for k, shape in found.items():
        if shape is not None and tuple(shape) != expected[k]:
            raise error(
                f"tensor '{k}' has shape {list(shape)} in {in_where} but the model "
                f"expects {list(expected[k])}"
            )
