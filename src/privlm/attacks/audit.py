"""Empirical privacy auditing: a statistically valid lower bound on a mechanism's epsilon.

A mechanism M is eps-DP for a pair of inputs x, x' when, for every output set S,
    ln( P[M(x) in S] / P[M(x') in S] ) <= eps      (and the same with x, x' swapped).
The auditor looks for an S that violates this as much as possible:

1. draw n outputs of M(x) and n of M(x'), shuffle each and split it into halves;
2. on the first halves, choose a direction (x over x', or x' over x) and an event S:
   - continuous outputs: threshold tests {T(y) >= t} and {T(y) <= t} on a scalar statistic T,
     by default the distance difference T(y) = ||y - x'|| - ||y - x|| (the exact log-likelihood
     ratio, up to the factor eta, of the d_chi mechanism) or the projection <y, x - x'>;
   - discrete outputs: single outputs, and the top-j outputs ranked by their first-half ratio;
   the score of a candidate is a Clopper-Pearson bound (below, at a stricter level) on its
   first-half counts: an estimate of the log ratio that is penalised for small counts;
3. count S on the held-out halves: c of m draws of M(x), c' of m draws of M(x'), and report
       eps_lower = ln( p_lower(c, m) / p_upper(c', m) )
   with one-sided Clopper-Pearson bounds at level alpha / 2 each (Bonferroni), computed with
   scipy.stats.beta.ppf. Because S was chosen on data independent of the held-out halves, the
   held-out counts are binomial given S, so with probability >= 1 - alpha over the held-out
   samples p_lower <= P[M(x) in S] and p_upper >= P[M(x') in S], hence eps_lower <= the true
   epsilon of the pair. A sound mechanism's claim is exceeded with probability <= alpha.

eps_lower is reported as computed: a value <= 0 means the samples give no evidence of privacy loss.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal

import numpy as np
import torch
from rich.progress import Progress
from scipy import stats

from privlm.mechanisms import DiscreteMechanism, Mechanism, OutputKind, exact_privacy_loss, make_generator
from privlm.validation import check_in_interval, check_non_negative_finite, check_positive_int

Kind = OutputKind  # "continuous" (vectors) or "discrete" (ids)

Statistic = Callable[[np.ndarray], np.ndarray]
Sampler = Callable[[torch.Tensor, int, torch.Generator], torch.Tensor | np.ndarray]

MIN_SAMPLES = 100  # per input; each half must hold enough draws for a meaningful bound
_N_THRESHOLDS = 400  # candidate thresholds per tail of the pooled first-half statistic
# Candidates are scored on the first halves by their Clopper-Pearson bound at a 100x stricter level
# than the final one: among many candidates this favours events with enough mass to hold up on the
# held-out halves (less winner's curse). Selection affects only power, never validity.
_SELECTION_STRICTNESS = 0.01


@dataclass(frozen=True, kw_only=True)
class AuditResult:
    """Outcome of an audit. Counts are of the chosen event on the held-out halves."""

    eps_lower: float  # holds with probability >= 1 - alpha
    event: str
    count_x: int  # held-out draws of M(x) in S
    count_x_prime: int  # held-out draws of M(x') in S
    held_out: int  # held-out draws per input
    n_samples: int  # draws per input
    alpha: float
    p_lower: float  # lower bound on P[favoured input's output in S]
    p_upper: float  # upper bound on P[other input's output in S]
    claimed_epsilon: float | None = None
    exceeds_claim: bool = False  # eps_lower > claimed_epsilon
    exact_epsilon: float | None = None  # max_y |ln P(y|x)/P(y|x')| when probabilities are known


def clopper_pearson_lower(count: np.ndarray | int, n: int, level: float) -> np.ndarray:
    """One-sided lower bound p with P[Binomial(n, p) >= count] = level (0 when count = 0)."""
    count = np.asarray(count, dtype=np.float64)
    bound = stats.beta.ppf(level, np.maximum(count, 1), n - count + 1)
    return np.where(count > 0, bound, 0.0)


def clopper_pearson_upper(count: np.ndarray | int, n: int, level: float) -> np.ndarray:
    """One-sided upper bound p with P[Binomial(n, p) <= count] = level (1 when count = n)."""
    count = np.asarray(count, dtype=np.float64)
    bound = stats.beta.ppf(1 - level, count + 1, np.maximum(n - count, 1))
    return np.where(count < n, bound, 1.0)


def _check_alpha(alpha: object) -> float:
    return check_in_interval("alpha", alpha, 0, 1, low_open=True, high_open=True)


def _log_ratio_bound(count_a: np.ndarray, count_b: np.ndarray, n: int, level: float) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.log(clopper_pearson_lower(count_a, n, level)) - np.log(clopper_pearson_upper(count_b, n, level))


def _as_array(name: str, samples: object, kind: Kind) -> np.ndarray:
    if isinstance(samples, torch.Tensor):
        samples = samples.detach().cpu().numpy()
    if not isinstance(samples, np.ndarray):
        raise ValueError(f"{name} must be a torch.Tensor or numpy array, got {type(samples).__name__}")
    if samples.ndim < 1 or samples.shape[0] < MIN_SAMPLES:
        raise ValueError(f"{name} must hold at least {MIN_SAMPLES} samples along axis 0, got shape {samples.shape}")
    if kind == "discrete":
        if samples.ndim != 1 or not np.issubdtype(samples.dtype, np.integer):
            raise ValueError(f"{name} must be a 1-D array of integer output ids for kind='discrete', "
                             f"got shape {samples.shape} and dtype {samples.dtype}")
        return samples.astype(np.int64)
    if not (np.issubdtype(samples.dtype, np.floating) or np.issubdtype(samples.dtype, np.integer)) \
            or not np.isfinite(samples).all():
        raise ValueError(f"{name} must hold finite numbers (no NaN or inf)")
    return samples.reshape(samples.shape[0], -1).astype(np.float64)


def _make_statistic(statistic: Statistic | str | None, reference: tuple[object, object] | None,
                    first_x: np.ndarray, first_x_prime: np.ndarray) -> tuple[Statistic, str]:
    """Resolve the scalar statistic; data-driven choices only look at the first halves."""
    if callable(statistic):
        return statistic, getattr(statistic, "__name__", "user statistic")
    if statistic not in (None, "distance", "projection"):
        raise ValueError(f"statistic must be None, 'distance', 'projection' or a callable, got {statistic!r}")
    if first_x.shape[1] == 1 and statistic is None:
        return (lambda y: y[:, 0]), "y"
    x = x_prime = None
    if reference is not None:
        x, x_prime = (np.asarray(r.detach().cpu() if isinstance(r, torch.Tensor) else r, dtype=np.float64).reshape(-1)
                      for r in reference)
        if x.shape != x_prime.shape or x.shape[0] != first_x.shape[1]:
            raise ValueError(f"reference points must both have {first_x.shape[1]} entries, like one output")
        if statistic is None and np.array_equal(x, x_prime):
            x = x_prime = None  # x == x': both reference statistics are constant, estimate a direction instead
    if x is None or x_prime is None:
        if statistic == "distance":
            raise ValueError("statistic='distance' needs reference=(x, x_prime) with x != x_prime")
        direction = first_x.mean(axis=0) - first_x_prime.mean(axis=0)  # estimated on the first halves
        return (lambda y: y @ direction), "<y, mean(first half x) - mean(first half x')>"
    if statistic == "projection":
        return (lambda y: y @ (x - x_prime)), "<y, x - x'>"
    return (lambda y: np.linalg.norm(y - x_prime, axis=1) - np.linalg.norm(y - x, axis=1)), "||y - x'|| - ||y - x||"


def _evaluate(statistic: Statistic, y: np.ndarray) -> np.ndarray:
    values = np.asarray(statistic(y), dtype=np.float64)
    if values.shape != (y.shape[0],) or not np.isfinite(values).all():
        raise ValueError(f"statistic must map {y.shape[0]} outputs to {y.shape[0]} finite numbers, "
                         f"got shape {values.shape}")
    return values


def _choose_threshold(s_x: np.ndarray, s_xp: np.ndarray, level: float) -> tuple[float, bool, bool]:
    """Best (threshold, upper tail?, x favoured?) on the first halves, by first-half bound."""
    pooled = np.sort(np.concatenate([s_x, s_xp]))
    ranks = np.unique(np.geomspace(1, pooled.size, _N_THRESHOLDS).astype(np.int64) - 1)
    thresholds = np.unique(np.concatenate([pooled[ranks], pooled[::-1][ranks]]))
    n = s_x.size
    sorted_x, sorted_xp = np.sort(s_x), np.sort(s_xp)
    best = (-math.inf, 0.0, True, True)
    for upper in (True, False):
        side: Literal["left", "right"] = "left" if upper else "right"
        below_x, below_xp = np.searchsorted(sorted_x, thresholds, side), np.searchsorted(sorted_xp, thresholds, side)
        c_x, c_xp = (n - below_x, n - below_xp) if upper else (below_x, below_xp)
        for x_favoured, (a, b) in ((True, (c_x, c_xp)), (False, (c_xp, c_x))):
            scores = _log_ratio_bound(a, b, n, level)
            i = int(np.argmax(scores))
            if scores[i] > best[0]:
                best = (float(scores[i]), float(thresholds[i]), upper, x_favoured)
    return best[1:]


def _choose_outputs(first_x: np.ndarray, first_xp: np.ndarray, level: float) -> tuple[np.ndarray, bool, str]:
    """Best (output set, x favoured?, how) among single outputs and top-j sets, on the first halves."""
    ids, inverse = np.unique(np.concatenate([first_x, first_xp]), return_inverse=True)
    c_x = np.bincount(inverse[: first_x.size], minlength=ids.size)
    c_xp = np.bincount(inverse[first_x.size:], minlength=ids.size)
    n = first_x.size
    best: tuple[float, np.ndarray, bool, str] = (-math.inf, ids[:0], True, "")
    for x_favoured, (a, b) in ((True, (c_x, c_xp)), (False, (c_xp, c_x))):
        single = _log_ratio_bound(a, b, n, level)
        order = np.argsort(-(a + 0.5) / (b + 0.5), kind="stable")
        top = _log_ratio_bound(np.cumsum(a[order]), np.cumsum(b[order]), n, level)
        i, j = int(np.argmax(single)), int(np.argmax(top))
        if single[i] > best[0]:
            best = (float(single[i]), ids[[i]], x_favoured, "single output")
        if top[j] > best[0]:
            best = (float(top[j]), ids[order[: j + 1]], x_favoured, f"top-{j + 1} outputs by first-half ratio")
    return best[1:]


def audit_samples(
    samples_x: torch.Tensor | np.ndarray,
    samples_x_prime: torch.Tensor | np.ndarray,
    *,
    kind: Kind,
    alpha: float = 0.05,
    statistic: Statistic | Literal["distance", "projection"] | None = None,
    reference: tuple[torch.Tensor | np.ndarray, torch.Tensor | np.ndarray] | None = None,
    claimed_epsilon: float | None = None,
    rng: np.random.Generator | int | None = None,
) -> AuditResult:
    """Lower-bound epsilon from i.i.d. outputs of M(x) and M(x') (same shape, axis 0 = draws).

    ``kind="continuous"``: outputs are rows (vectors, or scalars); ``statistic`` maps an (n, d)
    array to n scalars. Default: the distance difference if ``reference=(x, x')`` is given, else
    the projection onto the difference of the first halves' means (scalars: the value itself).
    ``kind="discrete"``: outputs are integer ids. ``rng`` shuffles before the split (numpy,
    OS-seeded when None). The bound holds with probability >= 1 - ``alpha``; see the module doc.
    """
    if kind not in ("continuous", "discrete"):
        raise ValueError(f"kind must be 'continuous' or 'discrete', got {kind!r}")
    if kind == "discrete" and (statistic is not None or reference is not None):
        raise ValueError("statistic and reference apply only to kind='continuous'")
    alpha = _check_alpha(alpha)
    if claimed_epsilon is not None:
        claimed_epsilon = check_non_negative_finite("claimed_epsilon", claimed_epsilon)
    x, xp = _as_array("samples_x", samples_x, kind), _as_array("samples_x_prime", samples_x_prime, kind)
    if x.shape != xp.shape:
        raise ValueError(f"samples_x and samples_x_prime must have the same shape, got {x.shape} and {xp.shape}")
    if rng is None or isinstance(rng, int):
        rng = np.random.default_rng(rng)
    elif not isinstance(rng, np.random.Generator):
        raise ValueError(f"rng must be a numpy Generator, an int seed or None, got {type(rng).__name__}")
    n, level = x.shape[0], alpha / 2
    x, xp = x[rng.permutation(n)], xp[rng.permutation(n)]
    half = n // 2
    if kind == "continuous":
        stat, name = _make_statistic(statistic, reference, x[:half], xp[:half])
        s_x, s_xp = _evaluate(stat, x), _evaluate(stat, xp)
        threshold, upper, x_favoured = _choose_threshold(s_x[:half], s_xp[:half], level * _SELECTION_STRICTNESS)
        inside_x, inside_xp = (s_x >= threshold, s_xp >= threshold) if upper else (s_x <= threshold, s_xp <= threshold)
        event = f"{name} {'>=' if upper else '<='} {threshold:.6g}"
    else:
        outputs, x_favoured, how = _choose_outputs(x[:half], xp[:half], level * _SELECTION_STRICTNESS)
        inside_x, inside_xp = np.isin(x, outputs), np.isin(xp, outputs)
        shown = ", ".join(str(i) for i in outputs[:8]) + (", ..." if outputs.size > 8 else "")
        event = f"y in {{{shown}}} ({how})"
    count_x, count_xp = int(inside_x[half:].sum()), int(inside_xp[half:].sum())
    held_out = n - half
    a, b = (count_x, count_xp) if x_favoured else (count_xp, count_x)
    p_lower = float(clopper_pearson_lower(a, held_out, level))
    p_upper = float(clopper_pearson_upper(b, held_out, level))
    eps_lower = math.log(p_lower / p_upper) if p_lower > 0 else -math.inf
    return AuditResult(
        eps_lower=eps_lower, event=f"{event}, favouring {'x over x_prime' if x_favoured else 'x_prime over x'}",
        count_x=count_x, count_x_prime=count_xp, held_out=held_out, n_samples=n, alpha=alpha,
        p_lower=p_lower, p_upper=p_upper, claimed_epsilon=claimed_epsilon,
        exceeds_claim=claimed_epsilon is not None and eps_lower > claimed_epsilon)


def _through_protocol(mechanism: Mechanism) -> Sampler:
    """n independent releases of one input, drawn by the mechanism's own ``sample``."""
    def sample(x: torch.Tensor, n: int, generator: torch.Generator) -> torch.Tensor:
        return mechanism.sample(x, num_samples=n, generator=generator)
    return sample


@dataclass(frozen=True, kw_only=True)
class AuditConfig:
    """How :func:`audit_mechanism` tests and draws; the defaults suit any mechanism."""

    alpha: float = 0.05  # the bound holds with probability >= 1 - alpha
    statistic: Statistic | Literal["distance", "projection"] | None = None  # continuous outputs: see audit_samples
    chunk_size: int = 250_000  # draws per call of the sampler: bounds the memory of one call
    progress: bool = False  # a progress bar while sampling (only with more than one chunk)


@dataclass(frozen=True)
class _Sampling:
    """The sampler of a mechanism, its output kind, the claimed epsilon and the exact one (when known)."""

    sampler: Sampler
    kind: Kind
    claimed_epsilon: float | None
    exact_epsilon: float | None


def _sampling(mechanism: Mechanism | Sampler, x: torch.Tensor, x_prime: torch.Tensor, kind: Kind | None,
              claimed_epsilon: float | None) -> _Sampling:
    """A privlm mechanism derives its kind, claim and exact epsilon; a user sampler needs ``kind``."""
    if isinstance(mechanism, Mechanism):
        claimed = mechanism.privacy_bound(x, x_prime) if claimed_epsilon is None else claimed_epsilon
        exact = None
        if isinstance(mechanism, DiscreteMechanism):
            exact = exact_privacy_loss(mechanism.log_probabilities(x), mechanism.log_probabilities(x_prime)).item()
        return _Sampling(_through_protocol(mechanism), mechanism.output_kind, claimed, exact)
    if callable(mechanism):
        if kind is None:
            raise ValueError("kind must be 'continuous' or 'discrete' for a user-supplied sampler")
        return _Sampling(mechanism, kind, claimed_epsilon, None)
    raise ValueError(f"mechanism must be a privlm mechanism or a callable, got {type(mechanism).__name__}")


def _draw(sampler: Sampler, points: tuple[torch.Tensor, torch.Tensor], n_samples: int, config: AuditConfig,
          generator: torch.Generator) -> list[np.ndarray]:
    """``n_samples`` draws for each point, in chunks of ``config.chunk_size``, as numpy arrays."""
    chunks = [min(config.chunk_size, n_samples - start) for start in range(0, n_samples, config.chunk_size)]
    draws: list[list[torch.Tensor | np.ndarray]] = [[], []]
    with Progress(disable=not config.progress or len(chunks) == 1, transient=True) as bar:
        task = bar.add_task("sampling", total=2 * n_samples)
        for which, point in enumerate(points):
            for size in chunks:
                draws[which].append(sampler(point, size, generator))
                bar.advance(task, size)
    return [np.concatenate([torch.as_tensor(d).detach().cpu().numpy() for d in side]) for side in draws]


def audit_mechanism(
    mechanism: Mechanism | Sampler,
    x: torch.Tensor,
    x_prime: torch.Tensor,
    *,
    n_samples: int = 100_000,
    kind: Kind | None = None,
    claimed_epsilon: float | None = None,
    generator: torch.Generator | None = None,
    config: AuditConfig = AuditConfig(),
) -> AuditResult:
    """Draw ``n_samples`` outputs of M(x) and of M(x') and audit them with :func:`audit_samples`.

    ``mechanism`` is a privlm mechanism (kind, claimed and exact epsilon are derived: d_chi claims
    eta ||x - x'||_2; the exponential mechanism claims its epsilon, so x, x' must be neighbouring
    utility rows unless ``claimed_epsilon`` is given; the bucketized one claims
    :func:`bucketized_pair_bound`, which holds whenever each row spans at most the sensitivity), or any callable
    ``sample(input, n, generator)``, for which ``kind`` is required. ``claimed_epsilon`` overrides
    the derived claim. Draws come from ``generator`` (OS-seeded when None; pass
    ``make_generator(seed)`` only to replay), in chunks of ``config.chunk_size``; so does the split's seed.
    ``config`` holds the level ``alpha`` and the ``statistic`` (see :class:`AuditConfig`).
    """
    n_samples = check_positive_int("n_samples", n_samples)
    check_positive_int("chunk_size", config.chunk_size)
    _check_alpha(config.alpha)  # fail before sampling
    if n_samples < MIN_SAMPLES:
        raise ValueError(f"n_samples must be at least {MIN_SAMPLES}, got {n_samples}")
    for name, point in (("x", x), ("x_prime", x_prime)):
        if not isinstance(point, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(point).__name__}")
    if x.shape != x_prime.shape:
        raise ValueError(f"x and x_prime must have the same shape, got {tuple(x.shape)} and {tuple(x_prime.shape)}")
    sampling = _sampling(mechanism, x, x_prime, kind, claimed_epsilon)
    generator = make_generator(device=x.device) if generator is None else generator
    samples = _draw(sampling.sampler, (x, x_prime), n_samples, config, generator)
    is_output_shaped = sampling.kind == "continuous" and samples[0].ndim == 2 and samples[0].shape[1] == x.numel()
    split_seed = int(torch.randint(0, 2**62, (1,), generator=generator, device=generator.device).item())
    result = audit_samples(samples[0], samples[1], kind=sampling.kind, alpha=config.alpha, statistic=config.statistic,
                           reference=(x, x_prime) if is_output_shaped else None,
                           claimed_epsilon=sampling.claimed_epsilon, rng=split_seed)
    return replace(result, exact_epsilon=sampling.exact_epsilon)
