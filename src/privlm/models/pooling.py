"""Sentence pooling of hidden states (batch, seq, d) under an attention mask (batch, seq)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Literal

import torch

from privlm.validation import check_choice

if TYPE_CHECKING:
    from privlm.models.loading import SentenceTransformerConfig

Pooling = Literal["mean", "cls", "last"]
POOLINGS: tuple[Pooling, ...] = ("mean", "cls", "last")
FAMILY_POOLING: dict[str, Pooling] = {"encoder": "cls", "decoder": "last", "t5": "mean"}


def choose_pooling(family: str, requested: Pooling | Literal["auto"] | None = "auto", *,
                   folder: SentenceTransformerConfig | None = None) -> Pooling:
    """The pooling a model computes with: ``requested`` unless it is "auto" (or None), else the one its
    sentence-transformers ``folder`` names, else its family's (encoder: CLS, decoder: last token, T5: mean)."""
    check_choice("pooling", "auto" if requested is None else requested, ("auto", *POOLINGS))
    if requested is None or requested == "auto":
        return folder.pooling if folder is not None else FAMILY_POOLING[family]
    return requested


def mean_pool(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Average of the non-pad positions (sentence-transformers' mean pooling, T5 encoder mean)."""
    weights = attention_mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp_min(1e-9)


def cls_pool(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The first position ([CLS] for BERT-style encoders)."""
    return hidden[:, 0]


def last_token_pool(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The last non-pad position, for either padding side (GPT-2, Llama)."""
    positions = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    last = (attention_mask.bool() * positions).argmax(dim=1)
    return hidden[torch.arange(hidden.shape[0], device=hidden.device), last]


POOLERS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "mean": mean_pool,
    "cls": cls_pool,
    "last": last_token_pool,
}
