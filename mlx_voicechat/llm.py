"""The Nemotron-H LLM of VoiceChat, run on fused input embeddings.

The blocks, caches and masks are mlx-lm's (``mlx_lm.models.nemotron_h``); VoiceChat only
changes what goes in (a fused embedding row per 80 ms frame, no token lookup) and what comes
out (two heads on the ``norm_f`` output, owned by the caller).
"""

from __future__ import annotations

from typing import Any, List, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache, KVCache
from mlx_lm.models.nemotron_h import ModelArgs, NemotronHModel


class FusedNemotronH(NemotronHModel):
    """Nemotron-H layers + ``norm_f`` on precomputed input embeddings.

    The checkpoint keeps the token embedding beside the LLM (``stt_model.embed_tokens``), so
    the inner lookup is an identity and holds no parameters.
    """

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.embeddings = nn.Identity()

    def __call__(self, embeds: mx.array, cache: Optional[List[Any]] = None) -> mx.array:
        return super().__call__(embeds, cache=cache)

    def make_cache(self) -> List[Any]:
        caches = []
        for layer in self.layers:
            if layer.block_type == "M":
                caches.append(ArraysCache(size=2))
            elif layer.block_type == "*":
                caches.append(KVCache())
        return caches
