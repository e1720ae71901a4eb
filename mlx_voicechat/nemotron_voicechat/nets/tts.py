"""EAR-TTS (``tts_model.tts_model.*``): text ids and previous codes in, one frame of codes out.

A Gemma-3 backbone (:mod:`.tts_backbone`) reads the gated fusion of the previous frame's code
embedding and the subword's character-aware embedding in guidance pairs; the MoG head
(:mod:`.mog`) fills the codebooks. Per conversation: ``cache = tts.make_cache()``,
``prev, cache = tts.warmup(latent, init_codes, cache)``, then per frame
``codes, cache = tts.step(text_id, prev, cache, noise, silence_codes)``. A batch stacks the
conversations' rows, caches (:class:`~.caches.RowCaches`) and noise (``RowNoise``).
"""

from __future__ import annotations

from typing import Tuple, Union

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ...config import TTSConfig
from ...noise import NoiseSource
from .char_encoder import CharAwareSubwordEncoder, OffsetRMSNorm
from .mog import CodeSampler, MoGHead
from .tts_backbone import Backbone

TextId = Union[int, np.integer, mx.array]


class GatedFusion(nn.Module):
    """``gated_fusion_audio_text``: a learned per-channel mix of the code and text streams."""

    def __init__(self, hidden_size: int, num_codebooks: int, eps: float):
        super().__init__()
        self.num_codebooks = num_codebooks
        self.audio_proj = nn.Linear(hidden_size, hidden_size)
        self.text_proj = nn.Linear(hidden_size, hidden_size)
        self.gate = mx.zeros((hidden_size,))
        self.residual_scale = mx.array(0.0)
        self.final_norm = OffsetRMSNorm(hidden_size, eps)

    def __call__(self, audio: mx.array, text: mx.array) -> mx.array:
        a = self.audio_proj(audio / self.num_codebooks)
        t = self.text_proj(text)
        # NeMo keeps the gate parameters in float32 and casts the sigmoids to the model dtype.
        gate = mx.sigmoid(self.gate.astype(mx.float32)).astype(a.dtype)
        res = mx.sigmoid(self.residual_scale.astype(mx.float32)).astype(a.dtype)
        return self.final_norm(res * (gate * a + (1 - gate) * t))


class EarTTS(nn.Module):
    def __init__(
        self, tts_cfg: TTSConfig, vocab_size: int, text_eos_id: int = 2, text_pad_id: int = 12
    ):
        super().__init__()
        cfg = self.cfg = tts_cfg
        H = cfg.hidden_size
        self.text_eos_id, self.text_pad_id = text_eos_id, text_pad_id
        self.backbone = Backbone(cfg)
        self.embed_code = nn.Linear(cfg.latent_size, H, bias=False)
        self.embed_subword = CharAwareSubwordEncoder(
            cfg.character_encoder,
            H,
            vocab_size,
            use_subword_flag_emb=cfg.use_subword_flag_emb,
            use_bos_eos_emb=cfg.use_bos_eos_emb,
        )
        if cfg.use_gated_fusion_for_text_audio:
            self.gated_fusion_audio_text = GatedFusion(H, cfg.num_quantizers, cfg.rms_norm_eps)
        self.mog_head = MoGHead(H, cfg.latent_size, cfg.mog_head)
        self.rvq_embs = mx.zeros((cfg.num_quantizers, cfg.codebook_size, cfg.latent_size))
        self.bos_emb = mx.zeros((H,))
        self.null_emb = mx.zeros((H,))
        self.sampler = CodeSampler(self)

    def make_cache(self) -> list:
        return self.backbone.make_cache()

    def set_vocabulary(self, tokenizer) -> None:
        self.embed_subword.set_vocabulary(tokenizer)

    # -- code embeddings -------------------------------------------------------------------

    def depthsum(self, codes: mx.array) -> mx.array:
        """``sum_q rvq_embs[q][codes[..., q]]`` in float32; the mask index adds nothing."""
        table, _ = self.sampler.tables()
        Q, V = self.cfg.num_quantizers, self.cfg.codebook_size
        flat = codes.astype(mx.int32) + mx.arange(Q, dtype=mx.int32) * (V + 1)
        return table[flat].sum(axis=-2)

    def embed_codes(self, codes: mx.array) -> mx.array:
        return self.embed_code(self.depthsum(codes).astype(self.embed_code.weight.dtype))

    # -- inputs ----------------------------------------------------------------------------

    def condition(self, text: mx.array) -> mx.array:
        """Text embeddings ``[B, T, H]`` -> guidance pairs ``[2 B, T, H]`` (odd rows ``null_emb``)."""
        null = mx.broadcast_to(self.null_emb.astype(text.dtype), text.shape)
        B, T, H = text.shape
        return mx.stack([text, null], axis=1).reshape(2 * B, T, H)

    def fuse(self, code_embeds: mx.array, cond: mx.array) -> mx.array:
        """Each conversation's code embedding ``[B, T, H]`` with both rows of its pair."""
        code_embeds = mx.repeat(code_embeds, 2, axis=0)
        if "gated_fusion_audio_text" in self:
            return self.gated_fusion_audio_text(code_embeds, cond)
        return code_embeds + cond

    @staticmethod
    def prepare_init_codes(codec_codes: mx.array, mask_id: int) -> mx.array:
        """Warm-up codes from the codec codes of ``T + 1`` frames of zero audio ``[1, T + 1, Q]``:
        the last frame dropped, frames 0 and ``T - 1`` set to the mask index (errata 4)."""
        codes = codec_codes[:, :-1].astype(mx.int32)
        T = codes.shape[1]
        edge = (mx.arange(T) == 0) | (mx.arange(T) == T - 1)
        return mx.where(edge[None, :, None], mask_id, codes)

    def warmup_inputs(self, prompt_latent: mx.array, init_codes: mx.array) -> mx.array:
        """Backbone input ``[2, T, H]`` of the voice-prompt warm-up (errata 4).

        Subwords ``[pad] * (T - 1) + [eos]`` with only the last two spelled; the prompt latent
        stands in for every frame before the BOS frame (the last), which gets the embedding of
        the shifted codes plus ``bos_emb``.
        """
        T = init_codes.shape[1]
        pos = mx.arange(T)
        shifted = mx.concatenate([mx.zeros_like(init_codes[:, :1]), init_codes[:, :-1]], axis=1)
        code_embed = self.embed_codes(shifted)
        is_bos = (pos == T - 1)[None, :, None]
        code_embed = mx.where(is_bos, code_embed, prompt_latent.astype(code_embed.dtype))
        bos = is_bos.astype(code_embed.dtype) * self.bos_emb.astype(code_embed.dtype)
        code_embed = code_embed + bos
        ids = mx.where(pos == T - 1, self.text_eos_id, self.text_pad_id)[None]
        text = self.embed_subword(ids, (pos >= T - 2)[None])
        return self.fuse(code_embed, self.condition(text.astype(code_embed.dtype)))

    def warmup(
        self, prompt_latent: mx.array, init_codes: mx.array, cache: list
    ) -> Tuple[mx.array, list]:
        """Fill ``cache`` with the voice prompt; returns the first previous code ``[1, Q]``."""
        self.backbone(self.warmup_inputs(prompt_latent, init_codes), cache)
        return init_codes[:, -1].astype(mx.int32), cache

    def step_inputs(
        self, text_id: TextId, previous_code: mx.array, silence_codes: mx.array
    ) -> mx.array:
        """Backbone input ``[2 B, 1, H]`` of one frame of ``B`` conversations; an EOS text id
        swaps a conversation's previous code for the codec's silence codes.

        ``text_id``: an int (one conversation; its character embedding is memoized on the
        host) or a device array ``[B]`` (embedded on the device: no host read needed)."""
        B = previous_code.shape[0]
        previous_code = previous_code.reshape(B, 1, -1).astype(mx.int32)
        silence = silence_codes.reshape(1, 1, -1).astype(mx.int32)
        if isinstance(text_id, (int, np.integer)):
            text = self.embed_subword.embed_ids([int(text_id)])[None]
            if int(text_id) == self.text_eos_id:
                previous_code = mx.broadcast_to(silence, previous_code.shape)
        else:
            ids = text_id.reshape(B, 1).astype(mx.int32)
            text = self.embed_subword(ids)
            previous_code = mx.where(ids[..., None] == self.text_eos_id, silence, previous_code)
        code_embed = self.embed_codes(previous_code)
        return self.fuse(code_embed, self.condition(text.astype(code_embed.dtype)))

    # -- sampling --------------------------------------------------------------------------

    def generate_codes(self, hidden: mx.array, noise: NoiseSource) -> mx.array:
        """Codes ``[B, Q]`` for the last position of ``hidden`` ``[2 B, T, H]`` (guidance
        pairs); see :mod:`.mog`."""
        return self.sampler(hidden, noise)

    def step(
        self,
        text_id: TextId,
        previous_code: mx.array,
        cache: list,
        noise: NoiseSource,
        silence_codes: mx.array,
    ) -> Tuple[mx.array, list]:
        """One frame: codes ``[B, Q]`` for the current text ids. No host sync inside."""
        hidden = self.backbone(self.step_inputs(text_id, previous_code, silence_codes), cache)
        return self.generate_codes(hidden, noise), cache
