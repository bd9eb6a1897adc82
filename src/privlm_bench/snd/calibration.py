"""Calibrating eta against the nearest-neighbour inversion attack.

eta has no universal meaning across models (the papers say so too): what matters is how often an
attacker recovers a token. We measure the inversion rate on a fixed sample of real-text tokens
over a log-spaced eta grid, with the same unit noise at every eta (common random numbers: the
mechanism draws z_1 / eta, and the generator restarts from one seed for each eta), and interpolate
log(eta) against logit(rate) to hit the target rates.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

import numpy as np
import torch

from privlm.attacks import nearest_neighbour_inversion
from privlm.mechanisms import DChiLaplace, make_generator
from privlm.models import SplitModel


@dataclass(frozen=True)
class Calibration:
    grid: list[dict[str, float]]  # eta, rate, ci_low, ci_high, tokens
    targets: dict[float, float]  # target rate -> eta


def sample_text_tokens(model: SplitModel, texts: Sequence[str], *, n_tokens: int, seed: int) -> torch.Tensor:
    """Token ids of real text (no special tokens), drawn in proportion to their frequency."""
    ids = [i for row in model.content_ids(texts) for i in row]
    if len(ids) < n_tokens:
        raise ValueError(f"the texts hold {len(ids)} tokens, fewer than n_tokens={n_tokens}")
    chosen = np.random.default_rng(seed).choice(len(ids), size=n_tokens, replace=False)
    return torch.tensor([ids[i] for i in chosen], device=model.device)


def interpolate_eta(points: Sequence[tuple[float, float]], target: float) -> float:
    """log(eta) linear in logit(rate) between the two (eta, rate) points that bracket ``target`` (rates rising or
    falling with eta); NaN when no two points bracket it."""
    def logit(p: float) -> float:
        p = min(max(p, 1e-6), 1 - 1e-6)
        return math.log(p / (1 - p))
    for (eta_a, rate_a), (eta_b, rate_b) in pairwise(sorted(points)):
        if min(rate_a, rate_b) <= target <= max(rate_a, rate_b) and rate_a != rate_b:
            t = (logit(target) - logit(rate_a)) / (logit(rate_b) - logit(rate_a))
            return math.exp(math.log(eta_a) + t * (math.log(eta_b) - math.log(eta_a)))
    return math.nan


def _interpolate(grid: list[dict[str, float]], target: float) -> float:
    return interpolate_eta([(g["eta"], g["rate"]) for g in grid], target)


@torch.inference_mode()
def calibrate_eta(model: SplitModel, token_ids: torch.Tensor, *, etas: Sequence[float],
                  targets: Sequence[float] = (0.5, 0.1, 0.01, 0.001), seed: int = 0) -> Calibration:
    clean = model.embed_tokens(token_ids)
    grid = []
    for eta in sorted(etas):
        noisy = DChiLaplace(eta=eta).sample(clean, generator=make_generator(seed, device=model.device))
        result = nearest_neighbour_inversion(noisy, token_ids, model.embedding_matrix)
        grid.append({"eta": eta, "rate": result.rate, "ci_low": result.ci_low, "ci_high": result.ci_high,
                     "tokens": result.trials})
    return Calibration(grid=grid, targets={t: _interpolate(grid, t) for t in targets})
