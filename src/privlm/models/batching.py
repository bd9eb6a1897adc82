"""Batches of token ids: right-padded, and length-sorted so that little compute goes to padding."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import numpy as np
import torch


def pad_ids(rows: Sequence[Sequence[int]], pad_id: int, device: torch.device | str = "cpu"
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded token ids (B, L) and their attention mask (B, L), both int64 on ``device``."""
    width = max(len(row) for row in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        input_ids[i, :len(row)] = torch.tensor(row, dtype=torch.long)
        attention_mask[i, :len(row)] = 1
    return input_ids.to(device), attention_mask.to(device)


def length_sorted_batches(texts: Sequence[str], batch_size: int) -> Iterator[list[int]]:
    """Index batches in order of text length (characters, a cheap proxy for tokens)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
    for start in range(0, len(order), batch_size):
        yield order[start:start + batch_size]


def map_in_length_order(texts: Sequence[str], encode_batch: Callable[[list[str]], np.ndarray], *,
                        batch_size: int) -> np.ndarray:
    """Apply ``encode_batch`` to length-sorted batches and return rows in the original order."""
    rows: dict[int, np.ndarray] = {}
    for indices in length_sorted_batches(texts, batch_size):
        rows |= zip(indices, encode_batch([texts[i] for i in indices]), strict=True)
    return np.stack([rows[i] for i in range(len(texts))])
