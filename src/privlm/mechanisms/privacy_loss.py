"""Exact privacy loss of a discrete mechanism between two inputs."""

from __future__ import annotations

import math

import torch


def exact_privacy_loss(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """max_y |ln P(y|x) - ln P(y|x')| over the last axis.

    Outputs impossible under both inputs are ignored; an output possible under only one
    gives an infinite loss (no pure DP guarantee).
    """
    if log_p.shape != log_q.shape:
        raise ValueError(f"log_p and log_q must have the same shape, got {tuple(log_p.shape)} "
                         f"and {tuple(log_q.shape)}")
    both_impossible = torch.isneginf(log_p) & torch.isneginf(log_q)
    diff = torch.where(both_impossible, 0.0, (log_p - log_q).abs())
    return diff.nan_to_num(nan=math.inf, posinf=math.inf).max(dim=-1).values
