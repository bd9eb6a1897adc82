import math

import numpy as np
import pytest
from scipy import stats

from privlm.attacks import AttackResult, ScoreResult, binomial_ci, score_result


@pytest.mark.parametrize(("successes", "trials"), [(0, 1), (1, 1), (0, 20), (3, 20), (20, 20), (7, 1000), (512, 999)])
@pytest.mark.parametrize("confidence", [0.95, 0.99])
def test_binomial_ci_matches_scipy_exact_interval(successes, trials, confidence):
    expected = stats.binomtest(successes, trials).proportion_ci(confidence_level=confidence, method="exact")
    low, high = binomial_ci(successes, trials, confidence)
    assert low == pytest.approx(expected.low, abs=1e-12)
    assert high == pytest.approx(expected.high, abs=1e-12)


@pytest.mark.parametrize("p", [0.001, 0.05, 0.3, 0.5, 0.93])
def test_binomial_ci_covers_at_least_the_nominal_level(p):
    """Exact coverage, summed over every outcome (no sampling): Clopper-Pearson is conservative."""
    n = 60
    intervals = [binomial_ci(s, n) for s in range(n + 1)]
    coverage = sum(stats.binom.pmf(s, n, p) for s, (low, high) in enumerate(intervals) if low <= p <= high)
    assert coverage >= 0.95


def test_attack_result_rate_interval_and_empirical_privacy():
    result = AttackResult(name="x", successes=30, trials=120, chance=0.1, details={"k": 1})
    assert result.rate == 0.25
    assert result.empirical_privacy == 0.75
    assert (result.ci_low, result.ci_high) == binomial_ci(30, 120)
    assert result.ci_low < 0.25 < result.ci_high
    row = result.to_dict()
    assert row["rate"] == 0.25 and row["ci_low"] == result.ci_low and row["details"] == {"k": 1}
    assert "25.00%" in str(result) and "chance 0.1" in str(result)


def test_attack_result_accepts_numpy_counts_and_flattens_nested_results():
    score = score_result("rouge", [0.5, 1.0])
    result = AttackResult(name="x", successes=np.int64(2), trials=np.int64(4), details={"rouge_l": score})
    assert (result.successes, result.trials) == (2, 4) and type(result.trials) is int
    assert result.to_dict()["details"]["rouge_l"] == score.to_dict()


def test_attack_result_is_frozen():
    result = AttackResult(name="x", successes=1, trials=2)
    with pytest.raises(AttributeError):
        result.successes = 2  # type: ignore[misc]


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"successes": 3, "trials": 2}, "successes"),
    ({"successes": -1, "trials": 2}, "successes"),
    ({"successes": 1.0, "trials": 2}, "successes"),
    ({"successes": 0, "trials": 0}, "trials"),
    ({"successes": 0, "trials": 2, "chance": 1.5}, "chance"),
    ({"successes": 0, "trials": 2, "confidence": 1.0}, "confidence"),
])
def test_attack_result_rejects_bad_counts(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AttackResult(name="x", **kwargs)


def test_binomial_ci_rejects_bad_confidence():
    with pytest.raises(ValueError, match="confidence"):
        binomial_ci(1, 2, confidence=0)


def test_normal_interval_is_mean_plus_minus_z_standard_error():
    values = np.random.default_rng(0).normal(2.0, 3.0, size=400)
    result = score_result("s", values, ci_method="normal")
    half = stats.norm.ppf(0.975) * values.std(ddof=1) / math.sqrt(400)
    assert result.mean == pytest.approx(values.mean())
    assert result.ci_low == pytest.approx(values.mean() - half)
    assert result.ci_high == pytest.approx(values.mean() + half)


def test_bootstrap_interval_is_seeded_and_close_to_the_normal_one():
    values = np.random.default_rng(1).exponential(1.0, size=500)
    a = score_result("s", values, seed=3)
    b = score_result("s", values, seed=3)
    c = score_result("s", values, seed=4)
    normal = score_result("s", values, ci_method="normal")
    assert isinstance(a, ScoreResult) and a.ci_method == "bootstrap"
    assert (a.ci_low, a.ci_high) == (b.ci_low, b.ci_high)
    assert (a.ci_low, a.ci_high) != (c.ci_low, c.ci_high)
    assert a.ci_low < a.mean < a.ci_high
    assert abs(a.ci_low - normal.ci_low) < 0.02 and abs(a.ci_high - normal.ci_high) < 0.02


def test_score_result_of_one_value_is_a_point():
    result = score_result("s", [0.4])
    assert (result.mean, result.ci_low, result.ci_high, result.n) == (0.4, 0.4, 0.4, 1)


@pytest.mark.parametrize(("values", "kwargs", "match"), [
    ([], {}, "values"),
    ([1.0, float("nan")], {}, "values"),
    ([1.0, 2.0], {"ci_method": "t"}, "ci_method"),
    ([1.0, 2.0], {"n_resamples": 0}, "n_resamples"),
    ([1.0, 2.0], {"confidence": 2}, "confidence"),
])
def test_score_result_rejects_bad_input(values, kwargs, match):
    with pytest.raises(ValueError, match=match):
        score_result("s", values, **kwargs)
