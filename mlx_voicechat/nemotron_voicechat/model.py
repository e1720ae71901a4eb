"""The whole VoiceChat model's parameter tree, composed of the networks in :mod:`.nets`.

Parameter names are the checkpoint's keys (``stt_model.*``, ``tts_model.*``) in MLX layout
(:mod:`.weights.sanitize` maps NeMo / PyTorch layouts onto them). The user-facing class is
:class:`mlx_voicechat.nemotron_voicechat.Model`; this module imports neither weights/ nor runtime/.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Tuple, Union

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..config import VoiceChatConfig
from ..derived import derived, reset_derived
from ..errors import CheckpointError
from ..listen.rnnt import FrameDecoder, RNNTDecoder, RNNTJoint
from .nets.codec import AudioCodec
from .nets.llm import FusedNemotronH
from .nets.perception import Perception
from .nets.tts import EarTTS


class STTModel(nn.Module):
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


class SpeechModel(nn.Module):
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


class VoiceChatModel(nn.Module):
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

    # load_weights, set_dtype and nn.quantize(model) change weights through these two.
    def update(self, parameters: dict, strict: bool = True):
        reset_derived(self)
        return super().update(parameters, strict)

    def update_modules(self, modules: dict, strict: bool = True):
        reset_derived(self)
        return super().update_modules(modules, strict)

    @property
    def tts(self) -> EarTTS:
        return self.tts_model.tts_model

    @property
    def codec(self) -> AudioCodec:
        return self.tts_model.audio_codec

    @property
    def rnnt_frames(self) -> FrameDecoder:
        """The RNNT head's live decoder: one encoder frame per call, on the device."""
        stt, steps = self.stt_model, self.config.audio_config.max_symbols
        build = lambda: FrameDecoder(stt.rnnt_decoder, stt.rnnt_joint, steps)  # noqa: E731
        return derived(self, "rnnt_frames", build)

    def setup_tokenizer(self, tokenizer) -> None:
        """Attach the LLM tokenizer and build the character tables EAR-TTS derives from it."""
        self.tokenizer = tokenizer
        self.tts.set_vocabulary(tokenizer)

    @property
    def layers(self):
        return self.stt_model.llm.layers

    def make_cache(self):
        return self.stt_model.llm.make_cache()

    def memory_per_minute(self) -> dict:
        """Bytes a conversation's caches grow by per minute: the LLM's attention keys / values,
        the TTS's global layers' and its windowed layers' (until their window is full)."""
        cfg, args, tts = self.config, self.config.text_args, self.config.tts_config
        frames = int(round(60.0 / cfg.frame_duration))
        floats = (mx.float32, mx.float16, mx.bfloat16)  # quantized weights: bf16 caches
        llm_dtype = self.stt_model.lm_head.weight.dtype
        llm_dtype = llm_dtype if llm_dtype in floats else mx.bfloat16
        n_attn = (getattr(args, "hybrid_override_pattern", "") or "").count("*")
        llm = n_attn * 2 * args.num_key_value_heads * args.head_dim * llm_dtype.size * frames
        tts_dtype = self.tts.embed_code.weight.dtype
        tts_dtype = tts_dtype if tts_dtype in floats else mx.bfloat16
        per_layer = 2 * 2 * tts.num_key_value_heads * tts.head_dim * tts_dtype.size  # cond + uncond
        n_global = sum(1 for i in range(tts.num_hidden_layers) if tts.is_global_layer(i))
        return {
            "llm_kv": llm,
            "tts_global_kv": n_global * per_layer * frames,
            "tts_window_kv": (tts.num_hidden_layers - n_global) * per_layer * frames,
            "tts_window_minutes": tts.sliding_window * cfg.frame_duration / 60.0,
            "total_after_window": llm + n_global * per_layer * frames,
        }

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
