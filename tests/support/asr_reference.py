"""Hugging Face Transformers' own Nemotron-3.5-ASR, the reference of
tests/nemotron_asr/test_asr_transformers.py.

Tiny models are built with Transformers' classes (``Nemotron3_5AsrForRNNT``,
``NemotronAsrStreamingForRNNT``) on torch's CPU, and written the way NVIDIA's conversion
writes them: ``save_pretrained`` of the model, and of a ``Nemotron3_5AsrProcessor`` /
``NemotronAsrStreamingProcessor`` holding Transformers' feature extractor and a
``ParakeetTokenizer`` (a Metaspace BPE over the factory's pieces; the blank and the language
tags are special tokens, so ``skip_special_tokens`` leaves the words).

Transformers' results are read off its ``generate``: the steps' tokens (blank included) and
advances give each token's frame; a hook on the joint records each step's logits, so that the
margin between the two largest logits of every greedy step is known (random weights can come
near a tie, where float32 rounding alone may pick the other token).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from mlx_voicechat.nemotron_asr.factory import recognizer_vocabulary

VOCAB = 64  # pieces without the blank
LANGUAGES = {"en-US": 0, "en": 0, "de-DE": 2, "de": 2, "auto": 15}
PROMPTS = 16
LOOKAHEADS = [13, 6, 1, 0]
TAGS = [p for p in recognizer_vocabulary(VOCAB) if p[0] == "<" and p[-1] == ">" and p != "<unk>"]


def encoder_config(**over):
    from transformers import NemotronAsrStreamingEncoderConfig

    kw = dict(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        subsampling_conv_channels=16,
        num_mel_bins=128,
        sliding_window=57,
        default_num_lookahead_tokens=13,
        scale_input=True,
        dropout=0.0,
        layerdrop=0.0,
        activation_dropout=0.0,
        attention_dropout=0.0,
    )
    kw.update(over)
    return NemotronAsrStreamingEncoderConfig(**kw)


def build(
    folder: Path,
    *,
    kind: str = "nemotron3_5_asr",
    seed: int = 0,
    lookahead: int = 13,
    blank_share: float = 0.5,
    mel_filters_dtype: str = "float32",
    **encoder,
):
    """A random tiny model of ``kind`` written to ``folder``: (model, processor)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import (
        Nemotron3_5AsrConfig,
        Nemotron3_5AsrForRNNT,
        Nemotron3_5AsrProcessor,
        NemotronAsrStreamingConfig,
        NemotronAsrStreamingFeatureExtractor,
        NemotronAsrStreamingForRNNT,
        NemotronAsrStreamingProcessor,
    )
    from transformers.models.parakeet.tokenization_parakeet import ParakeetTokenizer

    enc = encoder_config(**encoder)
    common = dict(
        vocab_size=VOCAB + 1, blank_token_id=VOCAB, decoder_hidden_size=32, encoder_config=enc
    )
    if kind == "nemotron3_5_asr":
        config = Nemotron3_5AsrConfig(
            num_prompts=PROMPTS, prompt_intermediate_size=32, default_prompt_id=15, **common
        )
        model = Nemotron3_5AsrForRNNT(config)
    else:
        model = NemotronAsrStreamingForRNNT(NemotronAsrStreamingConfig(**common))
    model.eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif p.ndim >= 2:
                p.copy_(torch.randn(p.shape, generator=g) / np.sqrt(np.prod(p.shape[1:])))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
        # The audio, not the last token, should decide: a louder encoder side of the joint.
        model.encoder_projector.weight.mul_(4.0)
        model.decoder.decoder_projector.weight.mul_(0.5)
        # The blank's embedding row stays random (a model trained in Transformers, not NeMo's
        # zero row); its bias is set so that about ``blank_share`` of noise frames are blank
        # at the start state (speech-like rates).
        model.joint.head.bias[VOCAB] += _blank_shift(model, kind, blank_share)
    model.generation_config.decoder_start_token_id = VOCAB
    model.generation_config.pad_token_id = VOCAB
    model.save_pretrained(folder)

    pieces = recognizer_vocabulary(VOCAB)
    tok = Tokenizer(
        models.BPE(vocab={p: i for i, p in enumerate(pieces)}, merges=[], unk_token="<unk>")
    )
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.add_special_tokens(["<blank>", *TAGS])
    tokenizer = ParakeetTokenizer(tokenizer_object=tok, unk_token="<unk>", pad_token="<unk>")
    fe = NemotronAsrStreamingFeatureExtractor(
        feature_size=enc.num_mel_bins, mel_filters_dtype=mel_filters_dtype
    )
    kw = dict(supported_num_lookahead_tokens=LOOKAHEADS, default_num_lookahead_tokens=lookahead)
    if kind == "nemotron3_5_asr":
        processor = Nemotron3_5AsrProcessor(
            fe, tokenizer, prompt_dictionary=LANGUAGES, num_prompts=PROMPTS, **kw
        )
    else:
        processor = NemotronAsrStreamingProcessor(fe, tokenizer, **kw)
    processor.save_pretrained(folder)
    return model, processor


def _blank_shift(model, kind, share):
    rng = np.random.default_rng(0)
    mel = torch.from_numpy(rng.standard_normal((1, 400, model.config.encoder_config.num_mel_bins)))
    kw = {"prompt_ids": torch.tensor([15])} if kind == "nemotron3_5_asr" else {}
    enc = model.get_audio_features(input_features=mel.float(), **kw).pooler_output[0]
    ids = torch.from_numpy(rng.integers(0, VOCAB, (1, 32)))
    pred = model.decoder(torch.cat([torch.tensor([[VOCAB]]), ids], 1))[0]  # [33, H]
    logits = model.joint(pred[None, :, :], enc[:, None, :])  # [T, 33, V + 1]
    gap = logits[..., :VOCAB].max(-1).values - logits[..., VOCAB]
    return float(np.quantile(gap.numpy(), share))


def edit_json(path: Path, fn) -> None:
    d = json.loads(path.read_text())
    fn(d)
    path.write_text(json.dumps(d))


class Joint:
    """Records the joint's logits of every step of ``generate`` ([B, V] each)."""

    def __init__(self, model):
        self.steps = []
        self._hook = model.joint.register_forward_hook(self._record)

    def _record(self, module, args, out):
        self.steps.append(out.detach().reshape(out.shape[0], -1).double())

    def close(self):
        self._hook.remove()


def margins(logits: torch.Tensor) -> np.ndarray:
    """Top-two gap of each row of ``logits`` [B, V]."""
    top = torch.topk(logits, 2, dim=-1).values
    return (top[:, 0] - top[:, 1]).numpy()


def hf_inputs(processor, clips, language=None):
    kw = {} if language is None else {"language": language}
    return processor(clips, sampling_rate=16000, return_tensors="pt", **kw)


def hf_results(processor, sequences, durations, logits, vocabulary, forced=None, lengths=None):
    """Per row: dict(tokens, frames, text, language, margins) from ``generate``'s output.
    ``margins``: the top-two gap of each of the row's steps while its frame is below its
    ``lengths`` entry (encoder frames; past it a batch's row only pads); ``steps``: the step
    of each token."""
    blank = VOCAB
    out = []
    for b in range(sequences.shape[0]):
        limit = float("inf") if lengths is None else lengths[b]
        seq = sequences[b, 1:].tolist()  # after the decoder's start
        adv = durations[b, 1:].tolist()
        frame, tokens, frames, steps, gaps, past = 0, [], [], [], [], 0
        for k, (t, a) in enumerate(zip(seq, adv)):
            if frame >= limit:
                # Transformers' batched generate goes on decoding a row that has reached its
                # length while longer rows decode (on the padding's frames; alone, the same
                # clip stops there): those tokens are not the clip's.
                past += t != blank
                continue
            if k < len(logits):
                gaps.append(float(margins(logits[k][b : b + 1])[0]))
            if t != blank:
                tokens.append(t)
                frames.append(frame)
                steps.append(len(gaps) - 1)
            frame += a
        # Padding steps after the row is done repeat the pad (the blank) without advancing.
        language = next((vocabulary[t][1:-1] for t in tokens if vocabulary[t] in TAGS), forced)
        text = processor.decode(tokens, skip_special_tokens=True)
        row = dict(tokens=tokens, frames=frames, text=text, language=language)
        out.append(dict(row, margins=gaps, steps=steps, past=past))
    return out


def generate(model, processor, clips, language=None, vocabulary=None, lengths=None):
    """Transformers' offline greedy decoding of ``clips`` in one padded batch (``lengths``:
    each clip's encoder frames, for the margins)."""
    inputs = hf_inputs(processor, clips, language)
    joint = Joint(model)
    try:
        with torch.no_grad():
            out = model.generate(**inputs, return_dict_in_generate=True)
    finally:
        joint.close()
    if lengths is not None:
        # generate's buffer is max_symbols_per_step x frames long, the start token included: a
        # run that fills it was cut short (a limit of Transformers', not of the greedy loop).
        assert out.sequences.shape[1] < model.max_symbols_per_step * max(lengths), (
            "Transformers' generate filled its output buffer; choose another seed"
        )
    forced = language if language not in (None, "auto") else None
    return hf_results(
        processor, out.sequences, out.durations, joint.steps, vocabulary, forced, lengths
    )


def stream_chunks(processor, x: np.ndarray):
    """The mel chunks Transformers' cache-aware streaming generate takes for ``x``: the first
    ``1 + 8 r`` frames centred, then ``8 (r + 1)`` frames each uncentred, the last one with
    ``is_last_audio_chunk``; ``x`` must fill whole chunks."""
    fe = processor.feature_extractor
    hop, half = fe.hop_length, fe.n_fft // 2
    first = processor.num_mel_frames_first_audio_chunk
    per = processor.num_mel_frames_per_audio_chunk
    total = len(x) // hop
    assert (total - first) % per == 0 and total > first, "x must fill whole chunks"
    out = [fe(x[: processor.num_samples_first_audio_chunk], sampling_rate=16000,
              return_tensors="pt").input_features[:, :first]]
    for f in range(first, total, per):
        piece = x[hop * f - half : hop * f - half + processor.num_samples_per_audio_chunk]
        feats = fe(piece, sampling_rate=16000, return_tensors="pt", center=False,
                   is_last_audio_chunk=f + per >= total).input_features
        assert feats.shape[1] == per, feats.shape
        out.append(feats)
    return out


def generate_streaming(model, processor, x, language=None, vocabulary=None):
    """Transformers' cache-aware streaming generate over :func:`stream_chunks` of ``x``."""
    chunks = stream_chunks(processor, x)
    kw = {}
    if language is not None:
        kw["prompt_ids"] = torch.tensor([processor.prompt_dictionary[language]])
    joint = Joint(model)
    try:
        with torch.no_grad():
            out = model.generate(
                input_features=(c for c in chunks),
                num_lookahead_tokens=processor.default_num_lookahead_tokens,
                return_dict_in_generate=True,
                **kw,
            )
    finally:
        joint.close()
    forced = language if language not in (None, "auto") else None
    return hf_results(processor, out.sequences, out.durations, joint.steps, vocabulary, forced)[0]


def log_mel64(fe, x: np.ndarray) -> np.ndarray:
    """The feature extractor's log-mel of one clip in float64 (its window and filterbank
    rounded to ``mel_filters_dtype`` first, as it does): [floor(n / hop), n_mels]."""
    low = getattr(torch, fe.mel_filters_dtype)
    y = np.asarray(x, np.float64)
    y = np.concatenate([y[:1], y[1:] - fe.preemphasis * y[:-1]])
    window = torch.hann_window(fe.win_length, periodic=False).to(low).double().numpy()
    pad = (fe.n_fft - fe.win_length) // 2
    window = np.pad(window, (pad, fe.n_fft - fe.win_length - pad))
    half = fe.n_fft // 2
    y = np.pad(y, (half, half))
    n = len(x) // fe.hop_length
    frames = np.stack([y[i * fe.hop_length : i * fe.hop_length + fe.n_fft] for i in range(n)])
    power = np.abs(np.fft.rfft(frames * window, axis=-1)) ** 2
    fb = fe.mel_filters.to(low).double().numpy()  # [n_mels, bins]
    return np.log(power @ fb.T + 2.0**-24)
