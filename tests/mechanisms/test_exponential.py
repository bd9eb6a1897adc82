import numpy as np
import pytest
import torch

from privlm.mechanisms import ExponentialMechanism, exact_privacy_loss, exponential_log_probabilities
from tests.conftest import BAD_POSITIVE_REALS, assert_draws_follow


def test_probabilities_match_the_formula(generator):
    utility = torch.rand(3, 17, generator=generator, dtype=torch.float64) * 2.0
    eps, delta = 1.5, 2.0
    expected = np.exp(eps * utility.numpy() / (2 * delta))
    expected /= expected.sum(axis=-1, keepdims=True)
    got = ExponentialMechanism(epsilon=eps, sensitivity=delta).probabilities(utility)
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-12)
    assert got.dtype == torch.float64


def test_sampled_frequencies_match_exact_probabilities(generator):
    utility = torch.rand(25, generator=generator) * 3.0
    mechanism = ExponentialMechanism(epsilon=4.0, sensitivity=3.0)
    n = 200_000
    assert_draws_follow(mechanism.sample(utility, num_samples=n, generator=generator),
                        mechanism.probabilities(utility))


def test_batched_rows_are_sampled_independently(generator):
    utility = torch.tensor([[0.0, 0.0, 50.0], [50.0, 0.0, 0.0]])
    draws = ExponentialMechanism(epsilon=10.0, sensitivity=50.0).sample(utility, num_samples=4000,
                                                                         generator=generator)
    assert draws.shape == (4000, 2)  # the sample axis comes first, as in torch.distributions
    assert (draws[:, 0] == 2).float().mean() > 0.9
    assert (draws[:, 1] == 0).float().mean() > 0.9
    one = ExponentialMechanism(epsilon=10.0, sensitivity=50.0).sample(utility, generator=generator)
    assert one.shape == (2,)  # one release per row


@pytest.mark.parametrize("eps", [0.1, 1.0, 8.0])
def test_exact_privacy_loss_is_within_epsilon(eps, generator):
    """Neighbouring inputs: every utility may move by up to Delta."""
    delta, vocab = 2.0, 300
    u = torch.rand(500, vocab, generator=generator, dtype=torch.float64) * 10
    shift = (torch.rand(500, vocab, generator=generator, dtype=torch.float64) * 2 - 1) * delta
    worst = torch.sign(shift) * delta  # the extreme corners of the neighbourhood
    for u_prime in (u + shift, u + worst):
        loss = exact_privacy_loss(exponential_log_probabilities(u, epsilon=eps, sensitivity=delta),
                                  exponential_log_probabilities(u_prime, epsilon=eps, sensitivity=delta))
        assert loss.max().item() <= eps + 1e-12


def test_the_epsilon_bound_is_nearly_attained():
    """u' = u + Delta everywhere except u'_0 = u_0 - Delta: loss -> eps as output 0 becomes rare."""
    eps, delta = 0.5, 1.0
    u = torch.zeros(1000, dtype=torch.float64)
    u_prime = u + delta
    u_prime[0] = u[0] - delta
    loss = exact_privacy_loss(exponential_log_probabilities(u, epsilon=eps, sensitivity=delta),
                              exponential_log_probabilities(u_prime, epsilon=eps, sensitivity=delta))
    assert eps * 0.99 < loss.item() <= eps


def test_a_mechanism_that_drops_the_factor_two_is_caught(generator):
    """Using eps * u / Delta (twice the exponent) breaks eps-DP and the exact check sees it."""
    eps, delta = 1.0, 1.0
    u = torch.rand(200, 50, generator=generator, dtype=torch.float64)
    u_prime = u + torch.sign(torch.randn(200, 50, generator=generator, dtype=torch.float64)) * delta
    broken = exact_privacy_loss(torch.log_softmax(eps * u / delta, -1), torch.log_softmax(eps * u_prime / delta, -1))
    assert broken.max().item() > eps


def test_exact_privacy_loss_handles_impossible_outputs():
    zero = torch.tensor([0.0, -float("inf")])
    assert exact_privacy_loss(zero, zero).item() == 0.0
    assert exact_privacy_loss(zero, torch.tensor([-float("inf"), 0.0])).item() == float("inf")
    with pytest.raises(ValueError, match="same shape"):
        exact_privacy_loss(torch.zeros(2), torch.zeros(3))


@pytest.mark.parametrize("bad", BAD_POSITIVE_REALS)
def test_bad_epsilon_and_sensitivity_are_rejected_by_name(bad):
    with pytest.raises(ValueError, match="epsilon"):
        ExponentialMechanism(epsilon=bad)
    with pytest.raises(ValueError, match="sensitivity"):
        ExponentialMechanism(epsilon=1.0, sensitivity=bad)
    with pytest.raises(ValueError, match="epsilon"):
        exponential_log_probabilities(torch.zeros(3), epsilon=bad, sensitivity=1.0)


@pytest.mark.parametrize("utility", [torch.tensor([]), torch.tensor(1.0), torch.tensor([0.0, float("nan")]),
                                     torch.tensor([float("inf"), 0.0]), torch.tensor([1, 2])])
def test_bad_utilities_are_rejected_by_name(utility):
    with pytest.raises(ValueError, match="utility"):
        ExponentialMechanism(epsilon=1.0).probabilities(utility)
