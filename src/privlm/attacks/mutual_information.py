"""Mutual information between token embeddings and their privatized versions (SnD, Section 4.3.1 and A.6).

Setting. X~ = X + Z with the noise Z independent of X and continuous (the d_chi Laplace noise).
Then h(X~ | X) = h(Z), so

    I(X; X~) = h(X~) - h(X~ | X) = h(X~) - h(Z),

which holds even though X (a token embedding row) is discrete. Clipping is post-processing and
can only lower I (data processing), so pass the unclipped X + Z and Z.

Estimator. The Kozachenko-Leonenko (KL) k-nearest-neighbour estimate of a differential entropy
from N samples in R^d is

    h^ = psi(N) - psi(k) + log c_d + (d/N) sum_i log eps(i),   c_d = pi^(d/2) / Gamma(d/2 + 1),

with eps(i) the L2 distance from sample i to its k-th nearest neighbour among the other samples.
With the same N, k and d for X~ and Z the constants cancel and

    I^ = (d/N) sum_i log eps_X~(i) - (d/N) sum_i log eps_Z(i)      (SnD eq. 13 / 22).

Assumptions: the N pairs (X~_i, Z_i) are independent draws (one per distinct token in SnD: pass
``token_ids`` to keep the first occurrence of each); the densities of X~ and Z are regular enough
for the KL estimator (it is consistent, with a bias that grows with d and shrinks with N). The
estimate can be slightly negative when I is near 0. Zero noise is refused: Z then has no density,
every eps_Z(i) = 0 and I^ would be +inf (I(X; X) = H(X) is a discrete entropy, not this estimate).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from scipy.special import digamma

from privlm.attacks._checks import check_ids
from privlm.attacks.results import ScoreResult, score_result
from privlm.mechanisms import squared_distances
from privlm.validation import check_float_tensor, check_positive_int

MI_DEFAULT_K = 1  # the SnD paper does not state k; k = 1 is Kozachenko and Leonenko's original estimator


def _as_float64(name: str, value: object) -> torch.Tensor:
    if isinstance(value, np.ndarray):
        value = torch.from_numpy(value)
    return check_float_tensor(name, value, ndim=2).to(torch.float64)


def kth_neighbour_distances(points: torch.Tensor, *, k: int = MI_DEFAULT_K, chunk_size: int = 1024) -> torch.Tensor:
    """eps(i): the L2 distance from each row of ``points`` (N, d) to its k-th nearest other row.

    Neighbours are ranked with one matrix product per chunk of rows (memory chunk_size x N); the
    returned distances are recomputed exactly as ||p_i - p_j|| (float64), so duplicates give 0.
    """
    points = _as_float64("points", points)
    k = check_positive_int("k", k)
    chunk_size = check_positive_int("chunk_size", chunk_size)
    if points.shape[0] <= k:
        raise ValueError(f"k must be < the number of samples {points.shape[0]}, got {k}")
    sq_norms = points.pow(2).sum(dim=-1)
    out = []
    for start in range(0, points.shape[0], chunk_size):
        chunk = points[start:start + chunk_size]
        sq = squared_distances(chunk, points, sq_norms)
        rows = torch.arange(chunk.shape[0], device=points.device)
        sq[rows, start + rows] = math.inf  # a sample is not its own neighbour
        _, neighbours = torch.topk(sq, k, dim=-1, largest=False)
        exact = (chunk.unsqueeze(1) - points[neighbours]).norm(dim=-1)
        out.append(exact.max(dim=-1).values)
    return torch.cat(out)


def kozachenko_leonenko_entropy(samples: torch.Tensor | np.ndarray, *, k: int = MI_DEFAULT_K,
                                chunk_size: int = 1024) -> float:
    """h^ = psi(N) - psi(k) + log c_d + (d/N) sum_i log eps(i), in nats (rows of ``samples`` are draws)."""
    samples = _as_float64("samples", samples)
    n, d = samples.shape
    eps = kth_neighbour_distances(samples, k=k, chunk_size=chunk_size)
    if (eps <= 0).any():
        raise ValueError("samples have duplicate rows (a k-th neighbour at distance 0): no density to estimate")
    log_unit_ball = (d / 2) * math.log(math.pi) - math.lgamma(d / 2 + 1)
    return float(digamma(n) - digamma(k) + log_unit_ball + d * eps.log().mean().item())


def _distinct_rows(token_ids: object, n: int) -> torch.Tensor:
    ids = check_ids("token_ids", token_ids, shape=(n,))
    _, first = np.unique(ids.cpu().numpy(), return_index=True)
    return torch.from_numpy(np.sort(first))


def mutual_information(
    privatized: torch.Tensor | np.ndarray,
    noise: torch.Tensor | np.ndarray,
    *,
    token_ids: torch.Tensor | None = None,
    k: int = MI_DEFAULT_K,
    chunk_size: int = 1024,
    confidence: float = 0.95,
) -> ScoreResult:
    """I^(X; X~) = (d/N) sum_i log eps_X~(i) - (d/N) sum_i log eps_Z(i) in nats (see the module docstring).

    ``privatized`` holds the rows X~_i = X_i + Z_i (N, d) and ``noise`` the matching Z_i. With
    ``token_ids`` (N,), only the first occurrence of each distinct token is used. The interval is
    the normal approximation over the per-sample terms d (log eps_X~(i) - log eps_Z(i)); it ignores
    the weak dependence between nearest-neighbour distances and the estimator's bias.
    Raises ``ValueError`` for zero (or duplicated) noise, whose estimate would be infinite.
    """
    privatized = _as_float64("privatized", privatized)
    noise = _as_float64("noise", noise).to(privatized.device)
    if noise.shape != privatized.shape:
        raise ValueError(f"noise has shape {tuple(noise.shape)}, expected {tuple(privatized.shape)} like privatized")
    if token_ids is not None:
        keep = _distinct_rows(token_ids, privatized.shape[0]).to(privatized.device)
        privatized, noise = privatized[keep], noise[keep]
    n, d = privatized.shape
    eps_privatized = kth_neighbour_distances(privatized, k=k, chunk_size=chunk_size)
    eps_noise = kth_neighbour_distances(noise, k=k, chunk_size=chunk_size)
    if (eps_noise <= 0).any():
        raise ValueError("noise has a k-th nearest neighbour at distance 0 (zero or duplicated noise): "
                         "the estimate would be +inf; the KL estimator needs continuous noise")
    if (eps_privatized <= 0).any():
        raise ValueError("privatized has duplicate rows (a k-th neighbour at distance 0): the estimate would be -inf")
    terms = d * (eps_privatized.log() - eps_noise.log())
    return score_result("mutual-information-kl", terms.cpu().numpy(), confidence=confidence, ci_method="normal",
                        details={"k": k, "n_samples": n, "dim": d, "unit": "nats"})
