"""Cape's bucketized exponential mechanism.

Per row of utilities u (one row per token position):
  1. split [min u, max u] into ``n_buckets`` equal-width buckets; empty buckets are skipped;
  2. a bucket's score is the mean utility of its members;
  3. pick bucket b with probability proportional to exp(eps * score_b / (2 Delta));
  4. pick a token uniformly within b, so P(y) = P(b(y)) / |b(y)|.

Guarantee. If every possible utility lies in one interval of width Delta, then for two inputs
x, x' with K, K' non-empty buckets and every output y,
    ln P(y|x) / P(y|x') <= eps + ln(K' / K) + ln(|b_x'(y)| / |b_x(y)|).
The Cape paper (Thm 4.1) states eps + eps' with eps' = ln(max_b |b| / min_b |b|): it drops the
ln(K'/K) term, so it holds when both inputs have the same number of non-empty buckets but can
be exceeded (by up to ln N_b) otherwise. privlm reports the paper's realised eps' per row
(``Bucketing.eps_prime``) and the sound pairwise bound from :func:`bucketized_pair_bound`. Over all
pairs, the bound is at most eps + ln(N_b) + ln(|V|): what a ledger is charged per release.

Limits: with ``n_buckets = 1`` the output is uniform over the vocabulary (the plain mechanism
at eps = 0); when every bucket holds one token it is exactly the plain exponential mechanism.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from privlm.mechanisms.exponential import sample_from_probabilities
from privlm.mechanisms.protocol import OutputKind, PrivacyUnit, Spend, rows_of
from privlm.validation import check_float_tensor, check_positive_finite, check_positive_int

_WIDTH_TOLERANCE = 1e-9


@dataclass(frozen=True)
class Bucketing:
    """The equal-width bucketing of each row of utilities."""

    bucket_of: torch.Tensor  # (..., |V|) bucket index of every candidate
    sizes: torch.Tensor  # (..., n_buckets) member counts (0 = empty, skipped)
    scores: torch.Tensor  # (..., n_buckets) mean utility of members (NaN when empty)

    @property
    def non_empty(self) -> torch.Tensor:
        """Number of non-empty buckets K per row."""
        return (self.sizes > 0).sum(dim=-1)

    @property
    def largest(self) -> torch.Tensor:
        return self.sizes.max(dim=-1).values

    @property
    def smallest(self) -> torch.Tensor:
        big = torch.iinfo(self.sizes.dtype).max
        return torch.where(self.sizes > 0, self.sizes, big).min(dim=-1).values

    @property
    def eps_prime(self) -> torch.Tensor:
        """The paper's realised eps' = ln(max_b |b| / min_b |b|) per row (float64)."""
        return (self.largest.to(torch.float64) / self.smallest.to(torch.float64)).log()


def bucketize(utility: torch.Tensor, *, n_buckets: int) -> Bucketing:
    """Equal-width buckets over [min u, max u] of each row; the maximum goes in the last bucket."""
    check_float_tensor("utility", utility)
    n_buckets = check_positive_int("n_buckets", n_buckets)
    u = utility.to(torch.float64)
    low = u.min(dim=-1, keepdim=True).values
    span = u.max(dim=-1, keepdim=True).values - low
    relative = torch.where(span > 0, (u - low) / span.clamp_min(torch.finfo(u.dtype).tiny), 0.0)
    bucket_of = (relative * n_buckets).floor().long().clamp_(0, n_buckets - 1)
    sizes = torch.zeros((*u.shape[:-1], n_buckets), dtype=torch.long, device=u.device)
    sizes.scatter_add_(-1, bucket_of, torch.ones_like(bucket_of))
    sums = torch.zeros((*u.shape[:-1], n_buckets), dtype=torch.float64, device=u.device)
    sums.scatter_add_(-1, bucket_of, u)
    scores = torch.where(sizes > 0, sums / sizes.clamp_min(1), torch.nan)
    return Bucketing(bucket_of=bucket_of, sizes=sizes, scores=scores)


def bucketized_log_probabilities(
    utility: torch.Tensor, *, epsilon: float, sensitivity: float, n_buckets: int
) -> tuple[torch.Tensor, Bucketing]:
    """Exact per-candidate log-probabilities (float64) and the bucketing that produced them."""
    epsilon = check_positive_finite("epsilon", epsilon)
    sensitivity = check_positive_finite("sensitivity", sensitivity)
    buckets = bucketize(utility, n_buckets=n_buckets)
    span = (utility.max(dim=-1).values - utility.min(dim=-1).values).max().item()
    if span > sensitivity * (1 + _WIDTH_TOLERANCE):
        raise ValueError(f"utility spans {span:.6g} within a row, more than sensitivity={sensitivity:.6g}; "
                         "the guarantee needs all utilities in one interval of width sensitivity")
    bucket_logits = torch.where(buckets.sizes > 0, buckets.scores * (epsilon / (2 * sensitivity)), -math.inf)
    bucket_log_probs = torch.log_softmax(bucket_logits, dim=-1)
    log_uniform_within = -buckets.sizes.to(torch.float64).log()
    per_bucket = bucket_log_probs + torch.where(buckets.sizes > 0, log_uniform_within, -math.inf)
    return per_bucket.gather(-1, buckets.bucket_of), buckets


def bucketized_pair_bound(x: Bucketing, x_prime: Bucketing, *, epsilon: float) -> torch.Tensor:
    """Sound bound on max_y |ln P(y|x) / P(y|x')| for two bucketings (per row, float64)."""
    def one_way(a: Bucketing, b: Bucketing) -> torch.Tensor:
        # ln P_a(y)/P_b(y) <= eps + ln(K_b / K_a) + ln(max |b_b| / min |b_a|)
        k = b.non_empty.to(torch.float64) / a.non_empty.to(torch.float64)
        size = b.largest.to(torch.float64) / a.smallest.to(torch.float64)
        return epsilon + k.log() + size.log()
    return torch.maximum(one_way(x, x_prime), one_way(x_prime, x))


@dataclass(frozen=True, kw_only=True)
class BucketizedExponentialMechanism:
    """Cape's bucketized exponential mechanism; defaults follow Cape (N_b = 50).

    Input: utility rows (..., |V|), one release per row. The guarantee assumes every utility, of every
    input, lies in one interval of width ``sensitivity`` (Cape's u lies in [0, lambda_L + lambda_D]).
    """

    epsilon: float
    sensitivity: float = 1.0
    n_buckets: int = 50

    def __post_init__(self) -> None:
        object.__setattr__(self, "epsilon", check_positive_finite("epsilon", self.epsilon))
        object.__setattr__(self, "sensitivity", check_positive_finite("sensitivity", self.sensitivity))
        check_positive_int("n_buckets", self.n_buckets)

    @property
    def output_kind(self) -> OutputKind:
        return "discrete"

    def bucketing(self, utility: torch.Tensor) -> Bucketing:
        """The buckets of each row: sizes, scores, non-empty count K and the paper's realised eps'."""
        return bucketize(utility, n_buckets=self.n_buckets)

    def log_probabilities(self, utility: torch.Tensor) -> torch.Tensor:
        """Exact output log-probabilities (float64), shape of ``utility``."""
        return bucketized_log_probabilities(utility, epsilon=self.epsilon, sensitivity=self.sensitivity,
                                            n_buckets=self.n_buckets)[0]

    def probabilities(self, utility: torch.Tensor) -> torch.Tensor:
        return self.log_probabilities(utility).exp()

    def sample(self, utility: torch.Tensor, *, num_samples: int | None = None,
               generator: torch.Generator | None = None) -> torch.Tensor:
        """Sampled candidate ids: shape (...) for utility (..., |V|); ``num_samples=n``: (n, ...)."""
        # Sampling a token from P(y) = P(b(y)) / |b(y)| is the same law as bucket-then-uniform.
        return sample_from_probabilities(self.probabilities(utility), num_samples=num_samples, generator=generator)

    def privacy_bound(self, utility: torch.Tensor, utility_prime: torch.Tensor) -> float:
        """The sound pairwise bound of :func:`bucketized_pair_bound`, added over rows."""
        if utility.shape != utility_prime.shape:
            raise ValueError(f"utility rows must have the same shape, got {tuple(utility.shape)} and "
                             f"{tuple(utility_prime.shape)}")
        both = torch.cat([utility, utility_prime], dim=-1).to(torch.float64)
        span = (both.max(dim=-1).values - both.min(dim=-1).values).max().item()
        if span > self.sensitivity * (1 + _WIDTH_TOLERANCE):
            raise ValueError(f"the two inputs' utilities span {span:.6g}, more than sensitivity="
                             f"{self.sensitivity:.6g}; the guarantee needs them in one interval of that width")
        bound = bucketized_pair_bound(self.bucketing(utility), self.bucketing(utility_prime), epsilon=self.epsilon)
        return float(bound.sum())

    def spend(self, utility: torch.Tensor) -> Spend:
        """Per row, the data-independent worst case of the pair bound: eps + ln(n_buckets) + ln(|V|)."""
        per_row = self.epsilon + math.log(self.n_buckets) + math.log(utility.shape[-1])
        return Spend(PrivacyUnit.EPSILON, per_row * rows_of(utility))
