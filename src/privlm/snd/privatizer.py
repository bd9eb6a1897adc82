"""SnD client privatization: tokenize, embed, d_chi noise, clip to the vocabulary's max norm.

Only ``noisy`` (X~) and the attention mask leave the client. ``clean`` (X) and ``noise`` (the
effective noise Z~ = X~ - X) stay on the client and feed the denoiser.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from privlm.mechanisms import DChiLaplace, clip_with_effective_noise, make_generator
from privlm.models import TokenBatch, TokenEmbedder


@dataclass
class PrivateBatch:
    batch: TokenBatch
    clean: torch.Tensor  # X (B, n, d): client only
    noisy: torch.Tensor  # X~ (B, n, d): sent to the server
    noise: torch.Tensor  # Z~ = X~ - X (B, n, d): client only
    eta: float

    @property
    def attention_mask(self) -> torch.Tensor:
        return self.batch.attention_mask


class SnDPrivatizer:
    """X -> X~ = clip(X + Z, C) with Z ~ d_chi Laplace(eta); C = the vocabulary's max row norm."""

    def __init__(self, model: TokenEmbedder, *, eta: float, clip: bool = True, sampler: str = "gamma",
                 generator: torch.Generator | None = None) -> None:
        self.model = model
        self.mechanism = DChiLaplace(eta=eta, sampler=sampler)
        self.clip = clip
        self.generator = generator or make_generator(device=model.device)

    @property
    def eta(self) -> float:
        return self.mechanism.eta

    def privatize_embeddings(self, clean: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor,
                                                                                                 torch.Tensor]:
        """(X~, Z~) for token embeddings X; padding positions stay zero noise (the mask hides them)."""
        noisy = self.mechanism.randomise(clean, generator=self.generator)
        if self.clip:
            noisy, noise = clip_with_effective_noise(clean, noisy, max_norm=self.model.max_embedding_norm)
        else:
            noise = noisy - clean
        keep = attention_mask.unsqueeze(-1).to(noisy.dtype)
        return clean + noise * keep, noise * keep

    @torch.inference_mode()
    def privatize(self, texts: Sequence[str], *, truncation: str = "warn") -> PrivateBatch:
        batch = self.model.tokenize(texts, truncation=truncation)
        clean = self.model.embed_tokens(batch.input_ids)
        noisy, noise = self.privatize_embeddings(clean, batch.attention_mask)
        return PrivateBatch(batch=batch, clean=clean, noisy=noisy, noise=noise, eta=self.eta)
