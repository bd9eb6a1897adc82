"""Text2Text (Feyisetan et al. 2019): release the vocabulary token nearest to x + z.

Every user-text token is replaced by the nearest (L2) vocabulary row to its noisy embedding.
Tokenizer-added special tokens ([CLS], [SEP]) carry no user text; they are kept and counted
(``kept_special``) rather than perturbed, so the clean model still sees a well-formed input.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from privlm.baselines.common import text_positions
from privlm.mechanisms import DChiLaplace, make_generator, project_to_vocabulary
from privlm.models import SplitModel, TokenBatch
from privlm.models.batching import map_in_length_order


@dataclass
class ReleasedTokens:
    batch: TokenBatch
    released_ids: torch.Tensor
    perturbed: torch.Tensor  # positions that went through the mechanism
    kept_special: int  # special tokens passed through unchanged


class Text2Text:
    def __init__(self, model: SplitModel, *, eta: float, generator: torch.Generator | None = None,
                 chunk_size: int = 1024) -> None:
        self.model = model
        self.mechanism = DChiLaplace(eta=eta)
        self.generator = generator or make_generator(device=model.device)
        self.chunk_size = chunk_size

    @torch.inference_mode()
    def privatize(self, texts: Sequence[str]) -> ReleasedTokens:
        batch = self.model.tokenize(texts)
        perturbed = text_positions(self.model, batch)
        clean = self.model.embed_tokens(batch.input_ids[perturbed])
        noisy = self.mechanism.sample(clean, generator=self.generator)
        released = batch.input_ids.clone()
        released[perturbed] = project_to_vocabulary(noisy, self.model.embedding_matrix, chunk_size=self.chunk_size)
        kept = int((batch.attention_mask.bool() & ~perturbed).sum())
        return ReleasedTokens(batch=batch, released_ids=released, perturbed=perturbed, kept_special=kept)

    @torch.inference_mode()
    def encode(self, texts: Sequence[str], *, batch_size: int = 64) -> np.ndarray:
        """(n, d) float32 embeddings of the released token sequences by the clean model."""
        def encode_batch(chunk: list[str]) -> np.ndarray:
            released = self.privatize(chunk)
            pooled = self.model.forward_ids(released.released_ids, released.batch.attention_mask)
            return pooled.float().cpu().numpy()
        return map_in_length_order(texts, encode_batch, batch_size=batch_size)
