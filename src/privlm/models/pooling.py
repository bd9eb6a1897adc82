"""Sentence pooling of hidden states (batch, seq, d) under an attention mask (batch, seq)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch

Pooling = Literal["mean", "cls", "last"]
POOLINGS: tuple[Pooling, ...] = ("mean", "cls", "last")


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
