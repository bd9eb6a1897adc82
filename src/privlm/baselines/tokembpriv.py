"""TokEmbPriv: d_chi noise on every token embedding; no clipping, no denoiser.

The client sends X~ = X + Z for every position of the attention mask (special tokens too: the
client treats every position the same, so nothing about the text decides what is noised).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from privlm.mechanisms import DChiLaplace, NoiseSampler, make_generator
from privlm.models import SplitModel, TokenBatch
from privlm.models.batching import map_in_length_order


@dataclass
class PrivatizedTokens:
    """What leaves the client: noisy token embeddings and the mask, plus (client-only) the truth."""

    batch: TokenBatch
    clean: torch.Tensor
    noisy: torch.Tensor


class TokEmbPriv:
    """Sentence embeddings from noisy token embeddings, with the same ``encode`` shape as sentence-transformers."""

    def __init__(self, model: SplitModel, *, eta: float, sampler: NoiseSampler = "gamma",
                 generator: torch.Generator | None = None) -> None:
        self.model = model
        self.mechanism = DChiLaplace(eta=eta, sampler=sampler)
        self.generator = generator or make_generator(device=model.device)

    @torch.inference_mode()
    def privatize(self, texts: Sequence[str]) -> PrivatizedTokens:
        batch = self.model.tokenize(texts)
        clean = self.model.embed_tokens(batch.input_ids)
        noisy = self.mechanism.sample(clean, generator=self.generator)
        return PrivatizedTokens(batch=batch, clean=clean, noisy=noisy)

    @torch.inference_mode()
    def encode(self, texts: Sequence[str], *, batch_size: int = 64) -> np.ndarray:
        """(n, d) float32 sentence embeddings, rows in the order of ``texts``."""
        def encode_batch(chunk: list[str]) -> np.ndarray:
            private = self.privatize(chunk)
            return self.model.encode(private.noisy, private.batch.attention_mask).float().cpu().numpy()
        return map_in_length_order(texts, encode_batch, batch_size=batch_size)
