"""Configuration of NVIDIA's standalone streaming recognizer Nemotron-3.5-ASR
(``nvidia/nemotron-3.5-asr-streaming-0.6b``): a cache-aware FastConformer, a language prompt
fused into its frames, an LSTM prediction network and a joint (``spec/nemotron-asr-runtime-notes``).

Two checkpoint layouts describe it, both detected from ``config.json``:

* mlx-audio's (``model_type: "nemotron_asr"``, the mlx-community conversions): NeMo's sections
  ``preprocessor`` / ``encoder`` / ``prompt`` / ``decoder`` / ``joint`` flattened, the
  vocabulary inline, MLX tensor layouts;
* NVIDIA's Transformers one (``model_type: "nemotron3_5_asr"``, or ``"nemotron_asr_streaming"``
  for the English-only model without a prompt): an ``encoder_config``, the vocabulary in
  ``tokenizer.json`` and the front-end, lookaheads and language prompts in
  ``processor_config.json``, PyTorch tensor layouts.

Defaults are the real 0.6b model's values, written once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Tuple

from .sections import (
    ConfigError,
    EncoderConfig,
    PreprocessorConfig,
    RNNTDecoderConfig,
    RNNTJointConfig,
    SubConfig,
)

MLX_AUDIO_TYPE = "nemotron_asr"
TRANSFORMERS_TYPES = ("nemotron3_5_asr", "nemotron_asr_streaming")
RECOGNIZER_TYPES = (MLX_AUDIO_TYPE,) + TRANSFORMERS_TYPES
LAYOUTS = ("mlx-audio", "transformers")
MEL_FILTERS_DTYPES = ("float32", "bfloat16", "float16")
AUTO = "auto"  # the prompt key of automatic language detection
NEMO_TARGET = "nemo.collections.asr.models.rnnt_bpe_models_prompt.EncDecRNNTBPEModelWithPrompt"


def is_recognizer_config(raw: Any) -> bool:
    """Whether a ``config.json`` object describes Nemotron-3.5-ASR (either layout)."""
    return isinstance(raw, dict) and raw.get("model_type") in RECOGNIZER_TYPES


@dataclass
class PromptConfig(SubConfig):
    """The language prompt: a one-hot of ``num_prompts`` concatenated to every encoder frame
    and projected back (``prompt_kernel``: Linear, ReLU, Linear). ``num_prompts`` 0: none."""

    num_prompts: int = 128
    prompt_hidden: int = 2048
    prompt_dictionary: Dict[str, int] = field(default_factory=dict)
    default_prompt_id: int = 101  # "auto": the model detects the language and tags it

    def name_of(self, prompt_id: int) -> Optional[str]:
        """The most specific language key for ``prompt_id`` (``en-US`` over ``en``)."""
        names = [k for k, v in self.prompt_dictionary.items() if v == prompt_id and k != AUTO]
        return max(names, key=lambda k: (len(k), k), default=None)


@dataclass
class ASRConfig:
    preprocessor: PreprocessorConfig = field(default_factory=PreprocessorConfig)
    # att_context_size is (left, lookahead) in encoder frames: the one this runtime uses.
    encoder: EncoderConfig = field(default_factory=lambda: EncoderConfig(att_context_size=(56, 13)))
    prompt: PromptConfig = field(default_factory=PromptConfig)
    decoder: RNNTDecoderConfig = field(default_factory=lambda: RNNTDecoderConfig(vocab_size=13087))
    joint: RNNTJointConfig = field(default_factory=lambda: RNNTJointConfig(num_classes=13087))
    vocabulary: List[str] = field(default_factory=list)
    max_symbols: int = 10
    lookaheads: Tuple[int, ...] = (13, 6, 1, 0)  # the right contexts it was trained with
    model_type: str = MLX_AUDIO_TYPE
    layout: str = "mlx-audio"
    quantization: Optional[Dict[str, Any]] = None
    model_path: Optional[str] = None
    # The precision the front-end's Hann window and mel filterbank are rounded to before use
    # (Transformers' ``mel_filters_dtype``); the spectrogram itself is float32.
    mel_filters_dtype: str = "float32"
    # Bias groups of the encoder's layers a Transformers config leaves out while the other is
    # in ("attention": the attention and feed-forward projections, "convolution": the conv
    # module): the network is built with biases and these are loaded as zeros.
    zero_biases: Tuple[str, ...] = ()

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise ConfigError(f"unknown recognizer layout {self.layout!r}")
        if self.decoder.vocab_size != self.joint.num_classes:
            raise ConfigError(
                f"the prediction network has {self.decoder.vocab_size} pieces but the joint "
                f"{self.joint.num_classes}; both must be the vocabulary without the blank"
            )
        if not self.decoder.blank_as_pad:
            raise ConfigError("decoder.blank_as_pad false is not supported (NeMo's default: true)")
        if (
            self.encoder.att_context_style != "chunked_limited"
            or self.encoder.att_context_size[0] < 0
        ):
            raise ConfigError(
                "the recognizer's encoder must use chunked_limited attention with a finite left "
                f"context, not {self.encoder.att_context_style} "
                f"{list(self.encoder.att_context_size)}"
            )
        if not isinstance(self.max_symbols, int) or self.max_symbols < 1:
            raise ConfigError(f"max_symbols must be a positive integer, not {self.max_symbols!r}")
        p = self.prompt
        if p.num_prompts and not 0 <= p.default_prompt_id < p.num_prompts:
            raise ConfigError(
                f"default prompt id {p.default_prompt_id} is outside the {p.num_prompts} prompts"
            )
        self.lookaheads = tuple(int(r) for r in self.lookaheads)
        if self.mel_filters_dtype not in MEL_FILTERS_DTYPES:
            raise ConfigError(
                f"mel_filters_dtype {self.mel_filters_dtype!r} is not supported "
                f"({', '.join(MEL_FILTERS_DTYPES)})"
            )
        self.zero_biases = tuple(self.zero_biases)

    # --- derived values ------------------------------------------------------------------

    @property
    def blank_id(self) -> int:
        """The blank: the joint's last output (errata 15)."""
        return self.joint.num_classes

    @property
    def lookahead(self) -> int:
        """Encoder frames of right context: a frame's output waits for this many more."""
        return self.encoder.att_context_size[1]

    @property
    def chunk_frames(self) -> int:
        """Encoder frames whose outputs become final together (lookahead + 1)."""
        return self.lookahead + 1

    @property
    def frame_samples(self) -> int:
        """Input samples per encoder frame (1280: 8 mel hops of 160 at 16 kHz)."""
        return self.encoder.subsampling_factor * self.preprocessor.hop_length

    @property
    def sample_rate(self) -> int:
        return self.preprocessor.sample_rate

    # --- parsing -------------------------------------------------------------------------

    @classmethod
    def from_dict(
        cls,
        d: Mapping[str, Any],
        *,
        tokenizer: Optional[Mapping[str, Any]] = None,
        processor: Optional[Mapping[str, Any]] = None,
    ) -> "ASRConfig":
        """Either layout's ``config.json``; the Transformers layout also needs its
        ``tokenizer.json`` (the vocabulary) and, where present, ``processor_config.json``."""
        if not is_recognizer_config(d):
            raise ConfigError(
                f"config.json describes model_type {d.get('model_type')!r}, not a "
                f"Nemotron-3.5-ASR recognizer ({', '.join(RECOGNIZER_TYPES)})"
            )
        if d["model_type"] == MLX_AUDIO_TYPE:
            return cls(**mlx_audio_fields(d))
        return cls(**transformers_fields(d, tokenizer, processor or {}))

    def to_dict(self) -> Dict[str, Any]:
        """mlx-audio's ``config.json`` for this model (what its converter writes)."""
        enc = self.encoder.to_dict()
        enc.pop("untie_biases", None)
        preprocessor = self.preprocessor.to_dict()
        if self.mel_filters_dtype != "float32":
            preprocessor["mel_filters_dtype"] = self.mel_filters_dtype
        left = self.encoder.att_context_size[0]
        enc["att_context_size"] = [[left, r] for r in self.lookaheads]
        enc["conv_context_size"] = "causal"
        prompt = self.prompt
        dictionary = dict(prompt.prompt_dictionary)
        default_language = prompt.name_of(prompt.default_prompt_id) or AUTO
        if prompt.num_prompts and dictionary.get(default_language) != prompt.default_prompt_id:
            dictionary[AUTO] = prompt.default_prompt_id
            default_language = AUTO
        d = {
            "model_type": MLX_AUDIO_TYPE,
            "target": NEMO_TARGET,
            "preprocessor": preprocessor,
            "encoder": enc,
            "prompt": {
                "num_prompts": prompt.num_prompts,
                "prompt_hidden": prompt.prompt_hidden,
                "prompt_dictionary": dictionary,
            },
            "decoder": self.decoder.to_dict(),
            "joint": self.joint.to_dict(),
            "vocabulary": list(self.vocabulary),
            "default_language": default_language,
            "default_att_context_size": [left, self.lookahead],
            "max_symbols": self.max_symbols,
        }
        if self.quantization:
            d["quantization"] = dict(self.quantization)
        return d


def _lookahead_list(pairs, what: str) -> List[List[int]]:
    if (
        isinstance(pairs, (list, tuple))
        and len(pairs) == 2
        and all(isinstance(x, int) for x in pairs)
    ):
        pairs = [pairs]
    if not isinstance(pairs, (list, tuple)) or not pairs:
        raise ConfigError(f"{what} must be a list of [left, right] pairs, not {pairs!r}")
    out = []
    for p in pairs:
        if not (isinstance(p, (list, tuple)) and len(p) == 2):
            raise ConfigError(f"{what} must be a list of [left, right] pairs, not {pairs!r}")
        out.append([int(p[0]), int(p[1])])
    return out


def mlx_audio_fields(d: Mapping[str, Any]) -> Dict[str, Any]:
    """:class:`ASRConfig` fields from mlx-audio's ``config.json``."""
    enc = dict(d.get("encoder") or {})
    ctx = enc.get("conv_context_size", "causal")
    if ctx != "causal":
        raise ConfigError(f"encoder.conv_context_size {ctx!r} is not supported (causal only)")
    trained = _lookahead_list(enc.get("att_context_size", [[56, 13]]), "encoder.att_context_size")
    chosen = d.get("default_att_context_size") or trained[0]
    chosen = _lookahead_list(chosen, "default_att_context_size")[0]
    enc["att_context_size"] = tuple(chosen)
    prompt = dict(d.get("prompt") or {})
    dictionary = {str(k): int(v) for k, v in (prompt.get("prompt_dictionary") or {}).items()}
    language = d.get("default_language", AUTO)
    # mlx-audio's rule: the default language's index, else index 0.
    prompt["default_prompt_id"] = dictionary.get(language, 0)
    prompt["prompt_dictionary"] = dictionary
    pre = dict(d.get("preprocessor") or {})
    mel_filters_dtype = str(pre.pop("mel_filters_dtype", "float32"))
    vocab = d.get("vocabulary") or []
    if not isinstance(vocab, list) or not all(isinstance(p, str) for p in vocab):
        raise ConfigError("config.json vocabulary must be a list of strings")
    return dict(
        preprocessor=PreprocessorConfig.from_dict(pre),
        encoder=EncoderConfig.from_dict(enc),
        prompt=PromptConfig.from_dict(prompt),
        decoder=RNNTDecoderConfig.from_dict(d.get("decoder")),
        joint=RNNTJointConfig.from_dict(d.get("joint")),
        vocabulary=list(vocab),
        max_symbols=d.get("max_symbols", ASRConfig.max_symbols),
        lookaheads=tuple(r for _, r in trained),
        model_type=MLX_AUDIO_TYPE,
        layout="mlx-audio",
        quantization=d.get("quantization") or d.get("quantization_config"),
        model_path=d.get("model_path"),
        mel_filters_dtype=mel_filters_dtype,
    )


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


def transformers_fields(
    d: Mapping[str, Any], tokenizer: Optional[Mapping[str, Any]], processor: Mapping[str, Any]
) -> Dict[str, Any]:
    """:class:`ASRConfig` fields from a Transformers ``config.json`` and its processor files."""
    enc = d.get("encoder_config")
    if not isinstance(enc, dict):
        raise ConfigError("config.json has no encoder_config")
    what = "encoder_config"
    _require(enc, "hidden_act", "silu", what)
    _require(enc, "subsampling_conv_kernel_size", 3, what)
    _require(enc, "subsampling_conv_stride", 2, what)
    hidden = int(enc.get("hidden_size", 1024))
    heads = int(enc.get("num_attention_heads", 8))
    if enc.get("num_key_value_heads") not in (None, heads):
        raise ConfigError("encoder_config num_key_value_heads must equal num_attention_heads")
    inter = int(enc.get("intermediate_size", 4 * hidden))
    if inter % hidden:
        raise ConfigError(
            f"encoder_config intermediate_size {inter} must be a multiple of hidden_size {hidden}"
        )
    # Transformers' class defaults for keys a config leaves out (NemotronAsrStreamingEncoderConfig,
    # NemotronAsrStreamingFeatureExtractor, the processors): 5.23 writes every key, older
    # versions or hand-edited folders need not.
    attention_bias = bool(enc.get("attention_bias", True))
    convolution_bias = bool(enc.get("convolution_bias", True))
    zero_biases = tuple(
        name
        for name, on in (("attention", attention_bias), ("convolution", convolution_bias))
        if not on and (attention_bias or convolution_bias)
    )
    feature = dict(processor.get("feature_extractor") or processor)
    rate = int(feature.get("sampling_rate", 16000))
    mels = int(enc.get("num_mel_bins", 80))
    features = int(feature.get("feature_size", 80))
    if features != mels:
        raise ConfigError(
            f"processor_config.json feature_size {features} differs from encoder_config "
            f"num_mel_bins {mels} (a key left out means Transformers' default, 80)"
        )
    mel_filters_dtype = str(feature.get("mel_filters_dtype", "float32"))
    pre = PreprocessorConfig(
        sample_rate=rate,
        features=mels,
        n_fft=int(feature.get("n_fft", 512)),
        window_size=int(feature.get("win_length", 400)) / rate,
        window_stride=int(feature.get("hop_length", 160)) / rate,
        preemph=float(feature.get("preemphasis", 0.97) or 0.0),
        pad_value=float(feature.get("padding_value", 0.0)),
    )
    left = int(enc.get("sliding_window", 71)) - 1
    # The processor's lookahead is what Transformers' pipeline passes to the model (its own
    # default: the first supported one); the encoder's applies to a bare forward call.
    lookaheads = processor.get("supported_num_lookahead_tokens") or [13, 6, 1, 0]
    default = int(processor.get("default_num_lookahead_tokens", lookaheads[0]))
    encoder = EncoderConfig(
        feat_in=mels,
        n_layers=int(enc.get("num_hidden_layers", 24)),
        d_model=hidden,
        n_heads=heads,
        ff_expansion_factor=inter // hidden,
        subsampling_factor=int(enc.get("subsampling_factor", 8)),
        subsampling_conv_channels=int(enc.get("subsampling_conv_channels", 256)),
        conv_kernel_size=int(enc.get("conv_kernel_size", 9)),
        att_context_size=(left, default),
        pos_emb_max_len=int(enc.get("max_position_embeddings", 5000)),
        use_bias=attention_bias or convolution_bias,
        xscaling=bool(enc.get("scale_input", True)),
    )
    # Each model type's class defaults (NemotronAsrStreamingConfig: 1025 / 1024).
    english = d["model_type"] == "nemotron_asr_streaming"
    vocab_size = int(d.get("vocab_size", 1025 if english else 13088))
    blank = int(d.get("blank_token_id", 1024 if english else 13087))
    if blank != vocab_size - 1:
        raise ConfigError(
            f"blank_token_id {blank} must be the joint's last output ({vocab_size - 1})"
        )
    pred = int(d.get("decoder_hidden_size", 640))
    if d["model_type"] == "nemotron3_5_asr":
        dictionary = processor.get("prompt_dictionary") or _default_prompt_dictionary()
        prompt = PromptConfig(
            num_prompts=int(d.get("num_prompts", 128)),
            prompt_hidden=int(d.get("prompt_intermediate_size", 2048)),
            prompt_dictionary={str(k): int(v) for k, v in dictionary.items()},
            default_prompt_id=int(d.get("default_prompt_id", 101)),
        )
    else:
        prompt = PromptConfig(num_prompts=0, prompt_hidden=0, default_prompt_id=0)
    return dict(
        preprocessor=pre,
        encoder=encoder,
        prompt=prompt,
        decoder=RNNTDecoderConfig(
            pred_hidden=pred, pred_rnn_layers=int(d.get("num_decoder_layers", 2)), vocab_size=blank
        ),
        joint=RNNTJointConfig(
            encoder_hidden=hidden,
            pred_hidden=pred,
            joint_hidden=pred,
            num_classes=blank,
            activation=str(d.get("hidden_act", "relu")),
        ),
        vocabulary=transformers_vocabulary(tokenizer, blank),
        max_symbols=int(d.get("max_symbols_per_step", 10)),
        lookaheads=tuple(int(r) for r in lookaheads),
        model_type=d["model_type"],
        layout="transformers",
        quantization=d.get("quantization") or d.get("quantization_config"),
        model_path=d.get("model_path"),
        mel_filters_dtype=mel_filters_dtype,
        zero_biases=zero_biases,
    )


def transformers_config(config: ASRConfig) -> Dict[str, Any]:
    """(``config.json``, ``processor_config.json``) of the Transformers layout for ``config``."""
    enc, pre, p = config.encoder, config.preprocessor, config.prompt
    encoder = {
        "model_type": "nemotron_asr_streaming_encoder",
        "hidden_size": enc.d_model,
        "num_hidden_layers": enc.n_layers,
        "num_attention_heads": enc.n_heads,
        "num_key_value_heads": enc.n_heads,
        "intermediate_size": enc.d_model * enc.ff_expansion_factor,
        "hidden_act": "silu",
        "attention_bias": enc.use_bias and "attention" not in config.zero_biases,
        "convolution_bias": enc.use_bias and "convolution" not in config.zero_biases,
        "conv_kernel_size": enc.conv_kernel_size,
        "subsampling_factor": enc.subsampling_factor,
        "subsampling_conv_channels": enc.subsampling_conv_channels,
        "num_mel_bins": enc.feat_in,
        "subsampling_conv_kernel_size": 3,
        "subsampling_conv_stride": 2,
        "max_position_embeddings": enc.pos_emb_max_len,
        "scale_input": enc.xscaling,
        "sliding_window": enc.att_context_size[0] + 1,
        "default_num_lookahead_tokens": config.lookahead,
    }
    d = {
        "model_type": config.model_type
        if config.layout == "transformers"
        else TRANSFORMERS_TYPES[0],
        "vocab_size": config.blank_id + 1,
        "decoder_hidden_size": config.decoder.pred_hidden,
        "num_decoder_layers": config.decoder.pred_rnn_layers,
        "hidden_act": config.joint.activation,
        "max_symbols_per_step": config.max_symbols,
        "encoder_config": encoder,
        "pad_token_id": 0,
        "blank_token_id": config.blank_id,
        "is_encoder_decoder": True,
    }
    if p.num_prompts:
        d.update(
            architectures=["Nemotron3_5AsrForRNNT"],
            model_type="nemotron3_5_asr",
            num_prompts=p.num_prompts,
            prompt_intermediate_size=p.prompt_hidden,
            default_prompt_id=p.default_prompt_id,
        )
    else:
        d.update(architectures=["NemotronAsrStreamingForRNNT"], model_type="nemotron_asr_streaming")
    if config.quantization:
        d["quantization"] = dict(config.quantization)
    processor = {
        "feature_extractor": {
            "feature_extractor_type": "NemotronAsrStreamingFeatureExtractor",
            "feature_size": pre.features,
            "sampling_rate": pre.sample_rate,
            "hop_length": pre.hop_length,
            "n_fft": pre.n_fft,
            "win_length": pre.win_length,
            "preemphasis": pre.preemph,
            "padding_value": pre.pad_value,
            "mel_filters_dtype": config.mel_filters_dtype,
        },
        "supported_num_lookahead_tokens": list(config.lookaheads),
        "default_num_lookahead_tokens": config.lookahead,
    }
    if p.num_prompts:
        processor.update(prompt_dictionary=dict(p.prompt_dictionary), num_prompts=p.num_prompts)
    return d, processor


__all__ = [
    "ASRConfig",
    "AUTO",
    "LAYOUTS",
    "PromptConfig",
    "RECOGNIZER_TYPES",
    "is_recognizer_config",
    "transformers_config",
]
