import math

import numpy as np
import pytest
import torch

from privlm.mechanisms import (
    BucketizedExponentialMechanism,
    ExponentialMechanism,
    bucketize,
    bucketized_log_probabilities,
    bucketized_pair_bound,
    exact_privacy_loss,
)
from tests.conftest import BAD_POSITIVE_REALS, assert_draws_follow


def test_handworked_example_with_an_empty_bucket():
    u = torch.tensor([0.0, 0.1, 0.2, 0.9, 1.0], dtype=torch.float64)
    eps = 2.0
    # Width 0.25: buckets {0, .1, .2}, {}, {}, {.9, 1}; scores 0.1 and 0.95; the empty ones are skipped.
    log_p, buckets = bucketized_log_probabilities(u, epsilon=eps, sensitivity=1.0, n_buckets=4)
    assert buckets.sizes.tolist() == [3, 0, 0, 2]
    assert buckets.bucket_of.tolist() == [0, 0, 0, 3, 3]
    low, high = math.exp(eps * 0.1 / 2), math.exp(eps * 0.95 / 2)
    expected = [low / (low + high) / 3] * 3 + [high / (low + high) / 2] * 2
    np.testing.assert_allclose(log_p.exp().numpy(), expected, rtol=1e-12)
    assert buckets.eps_prime.item() == pytest.approx(math.log(3 / 2))
    assert buckets.non_empty.item() == 2


def test_one_bucket_is_uniform():
    """N_b = 1: a single bucket, so the draw is uniform (the plain mechanism at eps = 0)."""
    u = torch.rand(2, 40, dtype=torch.float64)
    p = BucketizedExponentialMechanism(epsilon=3.0, n_buckets=1).probabilities(u)
    torch.testing.assert_close(p, torch.full_like(p, 1 / 40), rtol=1e-12, atol=0)


def test_singleton_buckets_equal_the_plain_mechanism():
    """One token per bucket: P(y) = exp(eps u_y / 2 Delta) / Z exactly, and eps' = 0."""
    n = 64
    u = torch.arange(n, dtype=torch.float64) / (n - 1) * 2.0  # evenly spaced: one per bucket
    mechanism = BucketizedExponentialMechanism(epsilon=1.7, sensitivity=2.0, n_buckets=n)
    log_p, buckets = mechanism.log_probabilities(u), mechanism.bucketing(u)
    assert (buckets.sizes == 1).all()
    assert buckets.eps_prime.item() == 0.0
    plain = ExponentialMechanism(epsilon=1.7, sensitivity=2.0).probabilities(u)
    torch.testing.assert_close(log_p.exp(), plain, rtol=1e-12, atol=0)


def test_sampled_frequencies_match_exact_probabilities(generator):
    u = torch.rand(60, generator=generator, dtype=torch.float64)
    mechanism = BucketizedExponentialMechanism(epsilon=6.0, n_buckets=7)
    n = 300_000
    assert_draws_follow(mechanism.sample(u, num_samples=n, generator=generator), mechanism.probabilities(u))
    assert mechanism.bucketing(u).eps_prime.item() == pytest.approx(bucketize(u, n_buckets=7).eps_prime.item())


def _random_pairs(generator, rows=400, vocab=120, clustered=False):
    u = torch.rand(rows, vocab, generator=generator, dtype=torch.float64)
    u_prime = torch.rand(rows, vocab, generator=generator, dtype=torch.float64)
    if clustered:  # squash most candidates together so the count of non-empty buckets differs
        u = u ** 6
        u_prime = u_prime ** 0.5
    return u, u_prime


@pytest.mark.parametrize("n_buckets", [1, 5, 50])
def test_exact_loss_within_paper_bound_when_bucket_counts_agree(n_buckets, generator):
    eps = 1.0
    u, u_prime = _random_pairs(generator, vocab=2000)
    log_p, bx = bucketized_log_probabilities(u, epsilon=eps, sensitivity=1.0, n_buckets=n_buckets)
    log_q, bxp = bucketized_log_probabilities(u_prime, epsilon=eps, sensitivity=1.0, n_buckets=n_buckets)
    same_k = bx.non_empty == bxp.non_empty
    assert same_k.sum() > 100
    eps_prime = (torch.maximum(bx.largest, bxp.largest).double()
                 / torch.minimum(bx.smallest, bxp.smallest).double()).log()
    loss = exact_privacy_loss(log_p, log_q)
    assert (loss[same_k] <= eps + eps_prime[same_k] + 1e-9).all()


@pytest.mark.parametrize("clustered", [False, True])
@pytest.mark.parametrize("n_buckets", [2, 10, 50])
def test_exact_loss_within_sound_pair_bound(clustered, n_buckets, generator):
    eps = 2.0
    u, u_prime = _random_pairs(generator, clustered=clustered)
    log_p, bx = bucketized_log_probabilities(u, epsilon=eps, sensitivity=1.0, n_buckets=n_buckets)
    log_q, bxp = bucketized_log_probabilities(u_prime, epsilon=eps, sensitivity=1.0, n_buckets=n_buckets)
    loss = exact_privacy_loss(log_p, log_q)
    assert (loss <= bucketized_pair_bound(bx, bxp, epsilon=eps) + 1e-9).all()


def test_paper_bound_fails_when_bucket_counts_differ():
    """Cape's Thm 4.1 (eps + ln max|b|/min|b|) omits ln(K'/K); this pair exceeds it, ours holds."""
    eps, vocab, n_buckets = 1.0, 200, 50
    u = torch.zeros(vocab, dtype=torch.float64)
    u[0] = 1.0  # K = 2: {0} alone at the top, everything else at the bottom
    u_prime = torch.zeros(vocab, dtype=torch.float64)
    u_prime[1:50] = torch.arange(1, 50, dtype=torch.float64) / 49  # K' = 50, token 0 in a crowd
    log_p, bx = bucketized_log_probabilities(u, epsilon=eps, sensitivity=1.0, n_buckets=n_buckets)
    log_q, bxp = bucketized_log_probabilities(u_prime, epsilon=eps, sensitivity=1.0, n_buckets=n_buckets)
    assert (bx.non_empty.item(), bxp.non_empty.item()) == (2, 50)
    loss = exact_privacy_loss(log_p, log_q).item()
    paper = eps + math.log(max(bx.largest, bxp.largest).item() / min(bx.smallest, bxp.smallest).item())
    assert loss > paper
    assert loss <= bucketized_pair_bound(bx, bxp, epsilon=eps).item()


def test_utilities_wider_than_the_sensitivity_are_refused():
    with pytest.raises(ValueError, match="sensitivity"):
        BucketizedExponentialMechanism(epsilon=1.0, sensitivity=1.0).probabilities(torch.tensor([0.0, 1.5]))


@pytest.mark.parametrize("bad", BAD_POSITIVE_REALS)
def test_bad_parameters_are_rejected_by_name(bad):
    with pytest.raises(ValueError, match="epsilon"):
        BucketizedExponentialMechanism(epsilon=bad)
    with pytest.raises(ValueError, match="sensitivity"):
        BucketizedExponentialMechanism(epsilon=1.0, sensitivity=bad)


@pytest.mark.parametrize("bad", [0, -3, 2.5, None, True])
def test_bad_bucket_counts_are_rejected_by_name(bad):
    with pytest.raises(ValueError, match="n_buckets"):
        BucketizedExponentialMechanism(epsilon=1.0, n_buckets=bad)


def test_bad_utilities_are_rejected_by_name():
    for bad in (torch.tensor([]), torch.tensor([0.0, float("nan")]), torch.tensor([0, 1])):
        with pytest.raises(ValueError, match="utility"):
            bucketize(bad, n_buckets=3)
