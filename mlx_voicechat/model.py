"""The whole VoiceChat model: the parameter tree both ecosystem loaders build and fill.

Parameter names are the checkpoint's key names (``stt_model.*``, ``tts_model.*``) in MLX
layout; :mod:`mlx_voicechat.sanitize` maps NeMo / PyTorch layouts onto them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from . import sanitize as rules
from .codec import AudioCodec
from .config import VoiceChatConfig
from .errors import CheckpointError
from .layout import use_cpu_layout
from .llm import FusedNemotronH
from .perception import Perception
from .rnnt import RNNTDecoder, RNNTJoint
from .tts import EarTTS


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


class Model(nn.Module):
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

    # --- loading ----------------------------------------------------------------------

    def sanitize(self, weights: Mapping[str, mx.array]) -> Dict[str, mx.array]:
        """NeMo / PyTorch layouts to ours; pure in its result and safe to run twice.

        It also remembers which keys (and shapes) the checkpoint provided, so that
        ``post_load_hook`` can tell a non-strict loader's silently missing or misshaped tensors
        from loaded ones.
        """
        out = rules.sanitize(weights, rules.expected_shapes(self), rules.conv_transpose_keys(self))
        self._checkpoint_keys = {k: tuple(v.shape) for k, v in out.items()}
        return out

    def load_weights(self, file_or_weights, strict: bool = True):
        if strict and not isinstance(file_or_weights, str):
            file_or_weights = list(file_or_weights)
            check_weights(self, dict(file_or_weights))
        return super().load_weights(file_or_weights, strict=strict)

    @staticmethod
    def post_load_hook(model: "Model", model_path) -> "Model":
        """mlx-audio loads non-strictly: verify here that every parameter was in the checkpoint
        with its shape, then attach the tokenizer and RNNT vocabulary from the checkpoint
        folder."""
        from .checkpoint import attach_assets

        provided = model._checkpoint_keys
        if provided is None:
            raise CheckpointError(
                "the weights were loaded without Model.sanitize; cannot verify the checkpoint"
            )
        check_shapes(expected_shapes(model), provided)
        attach_assets(model, Path(model_path))
        use_cpu_layout(model)
        return model

    def setup_tokenizer(self, tokenizer) -> None:
        """Attach the LLM tokenizer and build the character tables EAR-TTS derives from it."""
        self.tokenizer = tokenizer
        self.tts_model.tts_model.set_vocabulary(tokenizer)

    # --- listening ----------------------------------------------------------------------

    def transcribe(self, audio, *, source_rate: Optional[int] = None, chunk_size=None):
        """The user's words via the RNNT head: text, token ids, frame indices, language."""
        from .transcribe import transcribe

        use_cpu_layout(self)
        stt = self.stt_model
        return transcribe(
            stt.perception,
            stt.rnnt_decoder,
            stt.rnnt_joint,
            self.rnnt_vocabulary,
            self.config.rnnt_blank_id,
            self.config.audio_config.max_symbols,
            audio,
            source_rate=source_rate,
            chunk_size=chunk_size,
        )

    # --- the duplex loop ------------------------------------------------------------------

    def generate(self, audio, system_prompt=None, extra_decoding_seconds=3.0, seed=0, **kwargs):
        """Offline speech-to-speech: see :func:`mlx_voicechat.duplex.generate`.

        Generic options of ``python -m mlx_audio.sts.generate`` are accepted too: ``sample_rate``
        is the rate of an array ``audio``; options that do not apply to this model (sampling
        temperature, voices, ...) are ignored with a one-line warning; anything else is a
        GenerationError."""
        from .duplex import GenerationError, generate

        if self.tokenizer is None:
            raise GenerationError(
                "this model has no tokenizer attached: call model.setup_tokenizer(tokenizer) "
                "(mlx_lm.load returns one), or load the model with mlx_voicechat.load(path)"
            )
        kwargs = _generate_options(kwargs, GenerationError)
        return generate(self, audio, system_prompt, extra_decoding_seconds, seed, **kwargs)

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


GENERATE_OPTIONS = ("noise", "prompt", "source_rate", "progress", "prompt_progress")
# Options of mlx-audio's generic STS command line that this model has no use for: the LLM is
# greedy and the speech sampling is fixed by the checkpoint; there is one voice.
IGNORED_OPTIONS = (
    "temperature",
    "audio_temperature",
    "top_p",
    "top_k",
    "max_new_tokens",
    "no_repeat_ngram_size",
    "voice",
    "verbose",
)


def _generate_options(kwargs: Dict[str, Any], error: type) -> Dict[str, Any]:
    """``generate``'s keyword options, with mlx-audio's generic ones mapped or dropped."""
    import warnings

    kwargs = dict(kwargs)
    if "sample_rate" in kwargs:
        rate = kwargs.pop("sample_rate")
        if kwargs.get("source_rate") not in (None, rate):
            raise error(f"sample_rate={rate} and source_rate={kwargs['source_rate']} disagree")
        kwargs["source_rate"] = rate
    ignored = sorted(k for k in kwargs if k in IGNORED_OPTIONS)
    if ignored:
        warnings.warn(
            "NemotronLabs VoiceChat ignores " + ", ".join(ignored) + " (greedy text, the "
            "checkpoint's own speech sampling, one voice)",
            stacklevel=3,
        )
    unknown = sorted(k for k in kwargs if k not in GENERATE_OPTIONS and k not in IGNORED_OPTIONS)
    if unknown:
        raise error(
            f"generate() got an option it does not know: {unknown[0]}; it takes audio, "
            "system_prompt, extra_decoding_seconds, seed and " + ", ".join(GENERATE_OPTIONS)
        )
    return {k: v for k, v in kwargs.items() if k in GENERATE_OPTIONS}


def expected_shapes(model: "Model") -> Dict[str, Tuple[int, ...]]:
    """The parameter shapes ``model``'s config and quantization call for, whatever was loaded
    into it: a fresh, never evaluated copy of the parameter tree, quantized like ``model``."""
    fresh = Model(model.config)
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
    where: str = "checkpoint",
    error: type = CheckpointError,
) -> None:
    """``found`` (key -> shape, or None when unknown) must hold exactly the ``expected`` keys
    with their shapes; the first difference is raised as ``error``, naming the key."""
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
            "a NemotronLabs VoiceChat model with this config"
        )
    for k, shape in found.items():
        if shape is not None and shape != expected[k]:
            raise error(
                f"tensor '{k}' has shape {list(shape)} in the {where} but the model "
                f"expects {list(expected[k])}"
            )
