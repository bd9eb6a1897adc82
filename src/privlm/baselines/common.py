"""Shared pieces of the embedding baselines: which positions carry user text."""

from __future__ import annotations

import torch

from privlm.models import SplitModel, TokenBatch


def text_positions(model: SplitModel, batch: TokenBatch) -> torch.Tensor:
    """True where a position holds user text: not padding and not a tokenizer-added special token."""
    special = torch.tensor(sorted(model.require_tokenizer().all_special_ids), device=batch.input_ids.device)
    return batch.attention_mask.bool() & ~torch.isin(batch.input_ids, special)
