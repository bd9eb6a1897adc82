"""Input checks shared by the attacks; every message names the offending parameter."""

from __future__ import annotations

import torch

_INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def check_ids(name: str, value: object, *, shape: torch.Size | tuple[int, ...] | None = None,
              vocab_size: int | None = None) -> torch.Tensor:
    """An integer tensor of token ids, of ``shape`` if given, with values in [0, vocab_size)."""
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{name} must be an integer torch.Tensor, got {type(value).__name__}")
    if value.dtype not in _INT_DTYPES:
        raise ValueError(f"{name} must have an integer dtype, got {value.dtype}")
    if shape is not None and tuple(value.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(value.shape)}, expected {tuple(shape)}")
    if vocab_size is not None and value.numel() and (value.min() < 0 or value.max() >= vocab_size):
        raise ValueError(f"{name} must lie in [0, {vocab_size}), the vocabulary")
    return value.long()


def check_mask(name: str, value: object, *, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
    """A boolean tensor of ``shape`` that selects at least one position."""
    if not isinstance(value, torch.Tensor) or value.dtype != torch.bool:
        raise ValueError(f"{name} must be a boolean torch.Tensor, got "
                         f"{value.dtype if isinstance(value, torch.Tensor) else type(value).__name__}")
    if tuple(value.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(value.shape)}, expected {tuple(shape)}")
    if not value.any():
        raise ValueError(f"{name} selects no positions")
    return value
