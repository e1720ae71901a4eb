"""Configuration of NVIDIA's streaming recognizer Nemotron-3.5-ASR (defaults: the real 0.6b
model's), read from either layout's ``config.json``: mlx-audio's (``model_type:
"nemotron_asr"``, NeMo's sections flattened, the vocabulary inline) or the Transformers one
(``"nemotron3_5_asr"``, or ``"nemotron_asr_streaming"`` without a prompt; with
``tokenizer.json`` and ``processor_config.json``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Tuple

from ..config.sections import (  # noqa: F401  (the model types: re-exported)
    MLX_AUDIO_TYPE,
    RECOGNIZER_TYPES,
    TRANSFORMERS_TYPES,
    ConfigError,
    EncoderConfig,
    PreprocessorConfig,
    RNNTDecoderConfig,
    RNNTJointConfig,
    SubConfig,
    is_recognizer_config,
    read_fields,
    write_fields,
)
from .config_transformers import (
    _ENCODER_DEFAULTS,
    _FEATURE_DEFAULTS,
    PROCESSOR,
    PROMPT,
    TRANSFORMERS,
    _default_prompt_dictionary,
    _require,
    transformers_vocabulary,
)

LAYOUTS = ("mlx-audio", "transformers")
MEL_FILTERS_DTYPES = ("float32", "bfloat16", "float16")
AUTO = "auto"  # the prompt key of automatic language detection
NEMO_TARGET = "nemo.collections.asr.models.rnnt_bpe_models_prompt.EncDecRNNTBPEModelWithPrompt"


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
        enc = self.encoder
        if enc.att_context_style != "chunked_limited" or enc.att_context_size[0] < 0:
            raise ConfigError(
                "the recognizer's encoder must use chunked_limited attention with a finite left "
                f"context, not {enc.att_context_style} {list(enc.att_context_size)}"
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
        """Input samples per encoder frame (the subsampling factor's mel hops)."""
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
            fields = mlx_audio_fields(d)
        else:
            fields = transformers_fields(d, tokenizer, processor or {})
        quantization = d.get("quantization") or d.get("quantization_config")
        return cls(**fields, quantization=quantization, model_path=d.get("model_path"))

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
    """:class:`ASRConfig` fields from mlx-audio's ``config.json`` (model type and layout are the
    defaults; ``ASRConfig.from_dict`` reads either layout's quantization and path)."""
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
        mel_filters_dtype=mel_filters_dtype,
    )


def transformers_fields(
    d: Mapping[str, Any], tokenizer: Optional[Mapping[str, Any]], processor: Mapping[str, Any]
) -> Dict[str, Any]:
    """:class:`ASRConfig` fields from a Transformers ``config.json`` and its processor files."""
    enc = d.get("encoder_config")
    if not isinstance(enc, dict):
        raise ConfigError("config.json has no encoder_config")
    for key in ("hidden_act", "subsampling_conv_kernel_size", "subsampling_conv_stride"):
        _require(enc, key, TRANSFORMERS["encoder_config"][key], "encoder_config")
    enc = {**_ENCODER_DEFAULTS, **enc}
    feature = {**_FEATURE_DEFAULTS, **(processor.get("feature_extractor") or processor)}
    f = read_fields(TRANSFORMERS, {**d, "encoder_config": enc})
    read_fields(PROMPT if d["model_type"] == "nemotron3_5_asr" else {}, d, f)
    read_fields(PROCESSOR, {**processor, "feature_extractor": feature}, f)
    # The processor's lookahead is what Transformers' pipeline passes to the model (its own
    # default: the first supported one); the encoder's applies to a bare forward call.
    lookaheads = f.get("lookaheads") or ASRConfig.lookaheads
    lookahead = processor.get("default_num_lookahead_tokens", lookaheads[0])
    e = EncoderConfig.from_dict(
        {**f.get("encoder", {}), "att_context_size": (enc["sliding_window"] - 1, lookahead)}
    )
    pre = PreprocessorConfig.from_dict(f.get("preprocessor"))
    if enc.get("num_key_value_heads") not in (None, e.n_heads):
        raise ConfigError("encoder_config num_key_value_heads must equal num_attention_heads")
    inter = enc.get("intermediate_size", 4 * e.d_model)
    if inter % e.d_model:
        raise ConfigError(
            f"encoder_config intermediate_size {inter} must be a multiple of hidden_size "
            f"{e.d_model}"
        )
    if pre.features != e.feat_in:
        raise ConfigError(
            f"processor_config.json feature_size {pre.features} differs from encoder_config "
            f"num_mel_bins {e.feat_in} (a key left out means Transformers' default, 80)"
        )
    biases = {"attention": enc["attention_bias"], "convolution": enc["convolution_bias"]}
    e.ff_expansion_factor, e.use_bias = inter // e.d_model, any(biases.values())
    pre.window_size = feature["win_length"] / pre.sample_rate
    pre.window_stride = feature["hop_length"] / pre.sample_rate
    pre.preemph = pre.preemph or 0.0
    # Each model type's class defaults (NemotronAsrStreamingConfig: 1025 / 1024).
    english = d["model_type"] == "nemotron_asr_streaming"
    vocab_size = d.get("vocab_size", 1025 if english else 13088)
    blank = d.get("blank_token_id", 1024 if english else 13087)
    if blank != vocab_size - 1:
        raise ConfigError(
            f"blank_token_id {blank} must be the joint's last output ({vocab_size - 1})"
        )
    f.setdefault("decoder", {})["vocab_size"] = f.setdefault("joint", {})["num_classes"] = blank
    if english:
        prompt = PromptConfig(num_prompts=0, prompt_hidden=0, default_prompt_id=0)
    else:
        dictionary = processor.get("prompt_dictionary") or _default_prompt_dictionary()
        f.setdefault("prompt", {})["prompt_dictionary"] = {
            str(k): int(v) for k, v in dictionary.items()
        }
        prompt = PromptConfig.from_dict(f["prompt"])
    return dict(
        preprocessor=pre,
        encoder=e,
        prompt=prompt,
        decoder=RNNTDecoderConfig.from_dict(f["decoder"]),
        joint=RNNTJointConfig.from_dict(f["joint"]),
        vocabulary=transformers_vocabulary(tokenizer, blank),
        lookaheads=tuple(lookaheads),
        model_type=d["model_type"],
        layout="transformers",
        zero_biases=tuple(k for k, on in biases.items() if not on and any(biases.values())),
        **{k: f[k] for k in ("max_symbols", "mel_filters_dtype") if k in f},
    )


def transformers_config(config: ASRConfig) -> Dict[str, Any]:
    """(``config.json``, ``processor_config.json``) of the Transformers layout for ``config``."""
    enc = config.encoder
    d = write_fields(TRANSFORMERS, config)
    if config.layout != "transformers":
        d["model_type"] = TRANSFORMERS_TYPES[0]
    d["vocab_size"] = config.blank_id + 1
    d["encoder_config"].update(
        intermediate_size=enc.d_model * enc.ff_expansion_factor,
        attention_bias=enc.use_bias and "attention" not in config.zero_biases,
        convolution_bias=enc.use_bias and "convolution" not in config.zero_biases,
        sliding_window=enc.att_context_size[0] + 1,
    )
    if config.prompt.num_prompts:
        d.update(write_fields(PROMPT, config))
    else:
        d.update(architectures=["NemotronAsrStreamingForRNNT"], model_type="nemotron_asr_streaming")
    if config.quantization:
        d["quantization"] = dict(config.quantization)
    processor = write_fields(PROCESSOR, config)
    if config.prompt.num_prompts:
        processor.update(
            prompt_dictionary=dict(config.prompt.prompt_dictionary),
            num_prompts=config.prompt.num_prompts,
        )
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
