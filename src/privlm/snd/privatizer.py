"""SnD client privatization: tokenize, embed, d_chi noise, clip to the vocabulary's max norm.

Only ``noisy`` (X~) and the attention mask leave the client. ``clean`` (X) and ``noise`` (the
effective noise Z~ = X~ - X) stay on the client and feed the denoiser.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from privlm.mechanisms import DChiLaplace, NoiseSampler, Spend, clip_with_effective_noise, make_generator
from privlm.models import TokenBatch, TokenEmbedder, Tokens, TruncationPolicy


@dataclass
class PrivateBatch:
    batch: TokenBatch
    clean: torch.Tensor  # X (B, n, d): client only
    noisy: torch.Tensor  # X~ (B, n, d): sent to the server
    noise: torch.Tensor  # Z~ = X~ - X (B, n, d): client only
    eta: float | torch.Tensor

    @property
    def attention_mask(self) -> torch.Tensor:
        return self.batch.attention_mask


class SnDPrivatizer:
    """X -> X~ = clip(X + Z, C) with Z ~ d_chi Laplace(eta); C = the vocabulary's max row norm.

    ``eta`` is one level, or a tensor of one level per sentence. ``generator``: a stream shared by every
    call (for a reproducible run); None draws each call from a fresh OS-seeded generator, so concurrent
    calls share no state.
    """

    def __init__(self, model: TokenEmbedder, *, eta: float | torch.Tensor, clip: bool = True,
                 sampler: NoiseSampler = "gamma", generator: torch.Generator | None = None) -> None:
        self.model = model
        self.mechanism = DChiLaplace(eta=eta.reshape(-1, 1) if isinstance(eta, torch.Tensor) else eta,
                                     sampler=sampler)
        self.clip = clip
        self.generator = generator

    @property
    def eta(self) -> float | torch.Tensor:
        return self.mechanism.eta

    def spend(self, lengths: Sequence[int]) -> Spend:
        """What releasing sentences of these token lengths costs: the mechanism's price of their token rows
        (special tokens included; padding is never released)."""
        counts = torch.tensor(list(lengths), dtype=torch.long)
        rows = torch.empty(int(counts.sum()), 0)  # one per released token row: only their number is priced
        if not isinstance(self.eta, torch.Tensor):
            return self.mechanism.spend(rows)
        if not rows.shape[0]:
            return Spend(self.mechanism.unit, 0.0)
        per_row = self.eta.detach().cpu().reshape(-1).broadcast_to(counts.shape).repeat_interleave(counts)
        return replace(self.mechanism, eta=per_row).spend(rows)  # each sentence's rows at its own level

    def privatize_embeddings(self, clean: torch.Tensor, attention_mask: torch.Tensor, *,
                             generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(X~, Z~) for token embeddings X; padding positions stay zero noise (the mask hides them)."""
        generator = generator or self.generator or make_generator(device=clean.device)
        noisy = self.mechanism.sample(clean, generator=generator)
        if self.clip:
            noisy, noise = clip_with_effective_noise(clean, noisy, max_norm=self.model.max_embedding_norm)
        else:
            noise = noisy - clean
        keep = attention_mask.unsqueeze(-1).to(noisy.dtype)
        return clean + noise * keep, noise * keep

    @torch.inference_mode()
    def privatize(self, texts: Sequence[str] | Tokens, *, truncation: TruncationPolicy = "warn",
                  generator: torch.Generator | None = None) -> PrivateBatch:
        batch = (self.model.pad(texts) if isinstance(texts, Tokens)
                 else self.model.tokenize(texts, truncation=truncation))
        clean = self.model.embed_tokens(batch.input_ids)
        noisy, noise = self.privatize_embeddings(clean, batch.attention_mask, generator=generator)
        return PrivateBatch(batch=batch, clean=clean, noisy=noisy, noise=noise, eta=self.eta)
