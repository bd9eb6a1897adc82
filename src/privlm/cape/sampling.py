"""Drawing from Cape's bucketized exponential mechanism fast, with its exact law.

The law is P(y) = P(b(y)) / |b(y)|, with P(b) proportional to exp(eps * score_b / (2 Delta)) over the
non-empty buckets (:mod:`privlm.mechanisms.bucketized`). Drawing a bucket from its exact (float64)
probability, then a member of it uniformly, is that law exactly; it needs the (n, N_b) bucket
probabilities rather than (n, |C|) float64 rows, and one comparison pass to list the chosen
buckets' members. ``CapeBucketizedMechanism`` also computes the buckets on the float32 utilities
(:func:`bucketize_float32`); its ``log_probabilities`` is the exact law of its ``sample``, its claims
(``privacy_bound``, ``spend``) are the parent's, and the tests check the draws against
``log_probabilities`` by chi-square.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from privlm.mechanisms import Bucketing, BucketizedExponentialMechanism
from privlm.mechanisms.randomness import resolve_generator
from privlm.validation import check_float_tensor, check_positive_int

_WIDTH_TOLERANCE = 1e-9


def bucket_probabilities(buckets: Bucketing, *, epsilon: float, sensitivity: float) -> torch.Tensor:
    """(..., N_b) float64: P(b) proportional to exp(eps * score_b / (2 Delta)); 0 for empty buckets."""
    logits = torch.where(buckets.sizes > 0, buckets.scores * (epsilon / (2 * sensitivity)), -math.inf)
    return torch.softmax(logits, dim=-1)


def uniform_members(bucket_of: torch.Tensor, sizes: torch.Tensor, chosen: torch.Tensor,
                    generator: torch.Generator) -> torch.Tensor:
    """A uniform member of bucket ``chosen[r, j]`` of row r, for every (r, j): shape of ``chosen``.

    bucket_of: (n, |C|); sizes: (n, N_b); chosen: (n, S). Members of each distinct (row, bucket) pair
    are listed once, in ascending candidate order, by one ``nonzero``; a draw takes the k-th, k uniform.
    """
    n_buckets = sizes.shape[-1]
    rows = torch.arange(chosen.shape[0], device=chosen.device)[:, None].expand_as(chosen)
    pairs, which = torch.unique(rows * n_buckets + chosen, return_inverse=True)
    pair_rows, pair_buckets = pairs // n_buckets, pairs % n_buckets
    rows_of_pairs = bucket_of if pairs.numel() == bucket_of.shape[0] else bucket_of[pair_rows]  # one pair per row
    members = (rows_of_pairs == pair_buckets[:, None]).nonzero()[:, 1]  # grouped by pair, ascending
    pair_sizes = sizes[pair_rows, pair_buckets]
    starts = pair_sizes.cumsum(0) - pair_sizes
    size = pair_sizes[which]
    uniform = torch.rand(chosen.shape, dtype=torch.float64, device=chosen.device, generator=generator)
    rank = torch.minimum((uniform * size).long(), size - 1)  # uniform in {0, .., |b| - 1}
    return members[starts[which] + rank]


def sample_bucketized(buckets: Bucketing, *, epsilon: float, sensitivity: float, num_samples: int,
                      generator: torch.Generator) -> torch.Tensor:
    """(n, num_samples) candidate ids for n rows of buckets: bucket by its exact probability, then a member."""
    n_candidates, n_buckets = buckets.bucket_of.shape[-1], buckets.sizes.shape[-1]
    bucket_of = buckets.bucket_of.reshape(-1, n_candidates)
    sizes = buckets.sizes.reshape(-1, n_buckets)
    probabilities = bucket_probabilities(buckets, epsilon=epsilon, sensitivity=sensitivity).reshape(-1, n_buckets)
    chosen = torch.multinomial(probabilities, num_samples, replacement=True, generator=generator)
    return uniform_members(bucket_of, sizes, chosen, generator)


def check_width(utility: torch.Tensor, sensitivity: float) -> None:
    """Every row within one interval of width ``sensitivity`` (what the guarantee assumes)."""
    span = (utility.amax(dim=-1).double() - utility.amin(dim=-1).double()).max().item()
    if span > sensitivity * (1 + _WIDTH_TOLERANCE):
        raise ValueError(f"utility spans {span:.6g} within a row, more than sensitivity={sensitivity:.6g}; "
                         "the guarantee needs all utilities in one interval of width sensitivity")


def bucketize_float32(utility: torch.Tensor, *, n_buckets: int) -> Bucketing:
    """Equal-width buckets over [min u, max u] of each row, computed on the float32 utilities themselves.

    The same buckets as :func:`privlm.mechanisms.bucketize` (which converts to float64 first) but for
    candidates within float32 rounding of a bucket edge, which may land in the neighbouring bucket.
    Scores are float64 means. NaN and inf are refused (they would show in the row's min or max).
    """
    low, high = utility.amin(dim=-1, keepdim=True), utility.amax(dim=-1, keepdim=True)
    if not (torch.isfinite(low).all() and torch.isfinite(high).all()):
        raise ValueError("utility contains NaN or inf")
    scale = n_buckets / (high - low).clamp_min(torch.finfo(utility.dtype).tiny)  # a constant row: all in bucket 0
    bucket_of = (utility - low).mul_(scale).long().clamp_(0, n_buckets - 1)  # >= 0, so truncation is floor
    shape = (*utility.shape[:-1], n_buckets)
    sizes = torch.zeros(shape, dtype=torch.long, device=utility.device)
    sizes.scatter_add_(-1, bucket_of, torch.ones((), dtype=torch.long, device=utility.device).expand_as(bucket_of))
    sums = torch.zeros(shape, dtype=torch.float64, device=utility.device)
    sums.scatter_add_(-1, bucket_of, utility.double())
    scores = torch.where(sizes > 0, sums / sizes.clamp_min(1), torch.nan)
    return Bucketing(bucket_of=bucket_of, sizes=sizes, scores=scores)


@dataclass(frozen=True, kw_only=True)
class CapeBucketizedMechanism(BucketizedExponentialMechanism):
    """:class:`BucketizedExponentialMechanism` with float32 buckets (:func:`bucketize_float32`), sampled in two stages.

    ``log_probabilities`` is the exact law of ``sample``: P(y) = P(b(y)) / |b(y)| over these buckets. The
    claims (``privacy_bound``, ``spend``) are those of the parent: they hold for any partition into
    buckets whose scores lie in [0, Delta], so the float32 edges change nothing.
    """

    def bucketing(self, utility: torch.Tensor) -> Bucketing:
        if not isinstance(utility, torch.Tensor) or not utility.is_floating_point() or utility.numel() == 0:
            raise ValueError("utility must be a non-empty floating-point tensor")
        return bucketize_float32(utility.float(), n_buckets=self.n_buckets)

    def log_probabilities(self, utility: torch.Tensor) -> torch.Tensor:
        """Exact output log-probabilities (float64), shape of ``utility``."""
        check_width(utility, self.sensitivity)
        buckets = self.bucketing(utility)
        log_bucket = bucket_probabilities(buckets, epsilon=self.epsilon, sensitivity=self.sensitivity).log()
        per_bucket = log_bucket - buckets.sizes.to(torch.float64).log()  # -inf for empty buckets (never gathered)
        return per_bucket.gather(-1, buckets.bucket_of)

    def release_rows(self, utility: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, Bucketing]:
        """One draw per row of ``utility`` (n, |C|), and the bucketing it was drawn from."""
        if utility.ndim != 2:
            raise ValueError(f"utility must have 2 dimensions, got shape {tuple(utility.shape)}")
        buckets = self.bucketing(utility)  # checks that every utility is a finite number
        check_width(utility, self.sensitivity)
        draws = sample_bucketized(buckets, epsilon=self.epsilon, sensitivity=self.sensitivity, num_samples=1,
                                  generator=generator)
        return draws[:, 0], buckets

    def sample(self, utility: torch.Tensor, *, num_samples: int | None = None,
               generator: torch.Generator | None = None) -> torch.Tensor:
        """Sampled candidate ids: shape (...) for utility (..., |C|); ``num_samples=n``: (n, ...)."""
        check_float_tensor("utility", utility)
        check_width(utility, self.sensitivity)
        generator = resolve_generator(generator, utility.device)
        n = 1 if num_samples is None else check_positive_int("num_samples", num_samples)
        draws = sample_bucketized(self.bucketing(utility), epsilon=self.epsilon, sensitivity=self.sensitivity,
                                  num_samples=n, generator=generator)  # (rows, n)
        batch = utility.shape[:-1]
        return draws.reshape(batch) if num_samples is None else draws.T.reshape(n, *batch)
