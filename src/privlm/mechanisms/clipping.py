"""Norm clipping after noise (SnD): x~ = (x + z) * min(1, C / ||x + z||)."""

from __future__ import annotations

import torch

from privlm.validation import check_float_tensor, check_positive_finite


def clip_to_norm(vectors: torch.Tensor, *, max_norm: float) -> torch.Tensor:
    """Scale every vector along the last axis down to L2 norm at most ``max_norm``."""
    check_float_tensor("vectors", vectors)
    max_norm = check_positive_finite("max_norm", max_norm)
    norms = vectors.norm(dim=-1, keepdim=True)
    scale = torch.clamp(max_norm / norms.clamp_min(torch.finfo(vectors.dtype).tiny), max=1.0)
    return vectors * scale


def clip_with_effective_noise(
    clean: torch.Tensor, noisy: torch.Tensor, *, max_norm: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clip ``noisy`` to ``max_norm`` and return (x~, z~ = x~ - x), the noise the denoiser sees.

    Clipping is post-processing of the noisy vector, so it costs no privacy.
    """
    check_float_tensor("clean", clean)
    check_float_tensor("noisy", noisy)
    if clean.shape != noisy.shape:
        raise ValueError(f"clean and noisy must have the same shape, got {tuple(clean.shape)} "
                         f"and {tuple(noisy.shape)}")
    clipped = clip_to_norm(noisy, max_norm=max_norm)
    return clipped, clipped - clean
