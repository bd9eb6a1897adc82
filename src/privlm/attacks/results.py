"""Result objects of the privacy attacks, with confidence intervals.

An attack that succeeds or fails per trial (a token recovered or not, a label guessed or not)
returns an :class:`AttackResult`: ``successes`` out of ``trials``, the rate ``successes / trials``
and its exact (Clopper-Pearson) binomial confidence interval

    [B^{-1}(a/2; s, n - s + 1),  B^{-1}(1 - a/2; s + 1, n - s)],   a = 1 - confidence,

where B^{-1}(q; alpha, beta) is the Beta quantile (the lower end is 0 when s = 0, the upper 1 when
s = n). The interval covers the true rate with probability >= ``confidence`` for every rate; it
treats the trials as independent, which tokens of one sentence are not quite.

A score that is an average of per-item values (a mean Rouge-L F1, a mutual-information estimate)
returns a :class:`ScoreResult` with a bootstrap or normal-approximation interval.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from scipy import stats

from privlm.validation import check_choice, check_in_interval, check_positive_int

CiMethod = Literal["bootstrap", "normal"]
CI_METHODS: tuple[CiMethod, ...] = ("bootstrap", "normal")


def _check_confidence(confidence: object) -> float:
    return check_in_interval("confidence", confidence, 0, 1, low_open=True, high_open=True)


def _check_counts(successes: object, trials: object) -> tuple[int, int]:
    trials = check_positive_int("trials", int(trials) if isinstance(trials, np.integer) else trials)
    if isinstance(successes, bool) or not isinstance(successes, int | np.integer) or not 0 <= successes <= trials:
        raise ValueError(f"successes must be an integer in [0, trials={trials}], got {successes!r}")
    return int(successes), trials


def binomial_ci(successes: int, trials: int, confidence: float = 0.95) -> tuple[float, float]:
    """Exact two-sided Clopper-Pearson interval for a binomial rate ``successes / trials``."""
    successes, trials = _check_counts(successes, trials)
    confidence = _check_confidence(confidence)
    alpha = 1.0 - confidence
    low = 0.0 if successes == 0 else float(stats.beta.ppf(alpha / 2, successes, trials - successes + 1))
    high = 1.0 if successes == trials else float(stats.beta.ppf(1 - alpha / 2, successes + 1, trials - successes))
    return low, high


def _plain(details: dict[str, Any]) -> dict[str, Any]:
    return {key: value.to_dict() if hasattr(value, "to_dict") else value for key, value in details.items()}


@dataclass(frozen=True, kw_only=True)
class AttackResult:
    """``successes`` out of ``trials`` attack attempts, with an exact binomial confidence interval.

    ``chance`` is the success rate of an attacker who ignores the privatized artefact, where it is
    known (k / |V| for top-k inversion, the majority-class rate for attribute inference).
    ``empirical_privacy`` = 1 - rate, as in the SAP and Cape papers.
    """

    name: str
    successes: int
    trials: int
    chance: float | None = None
    confidence: float = 0.95
    details: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        successes, trials = _check_counts(self.successes, self.trials)
        object.__setattr__(self, "successes", successes)
        object.__setattr__(self, "trials", trials)
        object.__setattr__(self, "confidence", _check_confidence(self.confidence))
        if self.chance is not None:
            check_in_interval("chance", self.chance, 0, 1)

    @property
    def rate(self) -> float:
        return self.successes / self.trials

    @property
    def ci_low(self) -> float:
        return binomial_ci(self.successes, self.trials, self.confidence)[0]

    @property
    def ci_high(self) -> float:
        return binomial_ci(self.successes, self.trials, self.confidence)[1]

    @property
    def empirical_privacy(self) -> float:
        return 1.0 - self.rate

    def to_dict(self) -> dict[str, Any]:
        """Plain values for tables and JSON (nested results in ``details`` become dicts too)."""
        low, high = binomial_ci(self.successes, self.trials, self.confidence)
        return {"name": self.name, "successes": self.successes, "trials": self.trials, "rate": self.rate,
                "ci_low": low, "ci_high": high, "confidence": self.confidence, "chance": self.chance,
                "empirical_privacy": self.empirical_privacy, "details": _plain(self.details)}

    def __str__(self) -> str:
        low, high = binomial_ci(self.successes, self.trials, self.confidence)
        chance = "" if self.chance is None else f", chance {self.chance:.4g}"
        return (f"{self.name}: {self.rate:.2%} ({self.successes}/{self.trials}), "
                f"{self.confidence:.0%} CI [{low:.2%}, {high:.2%}]{chance}")


@dataclass(frozen=True, kw_only=True)
class ScoreResult:
    """The mean of ``n`` per-item scores and a confidence interval for it (method in ``ci_method``)."""

    name: str
    mean: float
    ci_low: float
    ci_high: float
    n: int
    confidence: float = 0.95
    ci_method: CiMethod = "bootstrap"
    details: dict[str, Any] = field(default_factory=dict, compare=False)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "mean": self.mean, "ci_low": self.ci_low, "ci_high": self.ci_high, "n": self.n,
                "confidence": self.confidence, "ci_method": self.ci_method, "details": _plain(self.details)}

    def __str__(self) -> str:
        return (f"{self.name}: {self.mean:.4g}, {self.confidence:.0%} CI [{self.ci_low:.4g}, {self.ci_high:.4g}] "
                f"({self.ci_method}, n={self.n})")


def score_result(
    name: str,
    values: Sequence[float] | np.ndarray,
    *,
    confidence: float = 0.95,
    ci_method: CiMethod = "bootstrap",
    n_resamples: int = 2000,
    seed: int = 0,
    details: dict[str, Any] | None = None,
) -> ScoreResult:
    """Mean of ``values`` with a percentile-bootstrap or normal (mean +- z * s / sqrt(n)) interval.

    The bootstrap draws ``n_resamples`` resamples with replacement from ``np.random.default_rng(seed)``
    (never the global RNG), so the interval is reproducible. Both intervals assume independent items.
    """
    array = np.asarray(values, dtype=np.float64).reshape(-1)
    if array.size == 0:
        raise ValueError("values must not be empty")
    if not np.isfinite(array).all():
        raise ValueError("values contain NaN or inf")
    confidence = _check_confidence(confidence)
    check_choice("ci_method", ci_method, CI_METHODS)
    n_resamples = check_positive_int("n_resamples", n_resamples)
    mean = float(array.mean())
    alpha = 1.0 - confidence
    if array.size == 1:
        low = high = mean
    elif ci_method == "normal":
        half = float(stats.norm.ppf(1 - alpha / 2)) * float(array.std(ddof=1)) / math.sqrt(array.size)
        low, high = mean - half, mean + half
    else:
        rng = np.random.default_rng(seed)
        means = np.empty(n_resamples)
        for start in range(0, n_resamples, 256):  # bounded memory: 256 resamples at a time
            stop = min(start + 256, n_resamples)
            means[start:stop] = array[rng.integers(0, array.size, size=(stop - start, array.size))].mean(axis=1)
        low, high = (float(q) for q in np.quantile(means, [alpha / 2, 1 - alpha / 2]))
    return ScoreResult(name=name, mean=mean, ci_low=min(low, mean), ci_high=max(high, mean), n=int(array.size),
                       confidence=confidence, ci_method=ci_method, details=dict(details or {}))
