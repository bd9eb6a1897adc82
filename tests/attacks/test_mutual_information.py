import math

import numpy as np
import pytest
import torch
from scipy.spatial import cKDTree

from privlm.attacks import kozachenko_leonenko_entropy, kth_neighbour_distances, mutual_information

N = 4000


@pytest.mark.parametrize("d", [2, 3, 4])
def test_gaussian_signal_plus_gaussian_noise_known_answer(d):
    """X ~ N(0, s^2 I), Z ~ N(0, n^2 I): I(X; X + Z) = (d/2) log(1 + s^2 / n^2)."""
    rng = np.random.default_rng(100 + d)
    s, n = 1.0, 0.7
    x, z = rng.normal(0, s, (N, d)), rng.normal(0, n, (N, d))
    result = mutual_information(x + z, z)
    truth = d / 2 * math.log(1 + s**2 / n**2)
    assert result.mean == pytest.approx(truth, abs=0.15)
    assert result.ci_low < result.mean < result.ci_high
    assert result.details == {"k": 1, "n_samples": N, "dim": d, "unit": "nats"}


def test_discrete_signal_gives_its_entropy():
    """Token-like X: 4 well separated points, so X is recoverable from X + Z and I = H(X) = log 4."""
    rng = np.random.default_rng(7)
    centres = np.array([[0.0, 0.0], [30.0, 0.0], [0.0, 30.0], [30.0, 30.0]])
    z = rng.normal(0, 1, (N, 2))
    result = mutual_information(centres[rng.integers(0, 4, N)] + z, z, k=3)
    assert result.mean == pytest.approx(math.log(4), abs=0.1)


def test_signal_drowned_in_noise_gives_about_zero():
    rng = np.random.default_rng(8)
    x, z = rng.normal(0, 0.01, (N, 3)), rng.normal(0, 1.0, (N, 3))  # true I = 1.5 log(1 + 1e-4) ~ 1.5e-4
    result = mutual_information(torch.from_numpy(x + z), torch.from_numpy(z))
    assert abs(result.mean) < 0.1
    assert result.ci_low < 0 < result.ci_high


def test_constant_signal_gives_zero():
    z = np.random.default_rng(9).normal(0, 1, (500, 3))
    assert mutual_information(z + 5.0, z).mean == pytest.approx(0.0, abs=1e-6)


def test_entropy_of_a_gaussian():
    d, sigma = 3, 2.0
    samples = np.random.default_rng(10).normal(0, sigma, (N, d))
    truth = d / 2 * math.log(2 * math.pi * math.e * sigma**2)
    assert kozachenko_leonenko_entropy(samples) == pytest.approx(truth, abs=0.1)
    assert kozachenko_leonenko_entropy(samples, k=4) == pytest.approx(truth, abs=0.1)


@pytest.mark.parametrize("k", [1, 3])
def test_kth_neighbour_distances_match_a_kd_tree(k, generator):
    points = torch.randn(700, 5, generator=generator, dtype=torch.float64)
    expected = cKDTree(points.numpy()).query(points.numpy(), k=k + 1)[0][:, k]
    for chunk in (64, 2048):
        got = kth_neighbour_distances(points, k=k, chunk_size=chunk)
        np.testing.assert_allclose(got.numpy(), expected, rtol=1e-12)


def test_token_ids_keep_one_sample_per_distinct_token():
    rng = np.random.default_rng(11)
    x, z = rng.normal(0, 1, (300, 2)), rng.normal(0, 1, (300, 2))
    repeated = np.concatenate([x + z, (x + z)[:50]]), np.concatenate([z, z[:50]])
    ids = torch.cat([torch.arange(300), torch.arange(50)])
    with pytest.raises(ValueError, match="duplicate"):
        mutual_information(*repeated)  # duplicated rows: eps = 0
    deduplicated = mutual_information(*repeated, token_ids=ids)
    assert deduplicated.n == 300
    assert deduplicated.mean == pytest.approx(mutual_information(x + z, z).mean)


def test_zero_noise_is_refused():
    x = np.random.default_rng(12).normal(0, 1, (100, 3))
    with pytest.raises(ValueError, match="noise"):
        mutual_information(x, np.zeros_like(x))


def test_duplicated_privatized_rows_are_refused():
    rng = np.random.default_rng(13)
    privatized, noise = rng.normal(0, 1, (100, 3)), rng.normal(0, 1, (100, 3))
    privatized[1] = privatized[0]
    with pytest.raises(ValueError, match="privatized"):
        mutual_information(privatized, noise)


@pytest.mark.parametrize(("privatized", "noise", "kwargs", "match"), [
    (np.zeros((10, 3)) + np.arange(10)[:, None], np.ones((10, 2)), {}, "noise"),
    (np.arange(30.0).reshape(10, 3), np.arange(30.0).reshape(10, 3), {"k": 10}, "k"),
    (np.arange(30.0).reshape(10, 3), np.arange(30.0).reshape(10, 3), {"k": 0}, "k"),
    (np.arange(30).reshape(10, 3), np.arange(30.0).reshape(10, 3), {}, "privatized"),
    (np.arange(30.0), np.arange(30.0), {}, "privatized"),
    (np.arange(30.0).reshape(10, 3), np.arange(30.0).reshape(10, 3), {"token_ids": torch.arange(9)}, "token_ids"),
])
def test_bad_inputs_are_rejected_by_name(privatized, noise, kwargs, match):
    with pytest.raises(ValueError, match=match):
        mutual_information(privatized, noise, **kwargs)
