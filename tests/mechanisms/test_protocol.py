"""Every mechanism implements the one protocol: sample, privacy_bound, spend (and exact laws if discrete)."""

import math

import pytest
import torch

from privlm.mechanisms import (
    BucketizedExponentialMechanism,
    DChiLaplace,
    DiscreteMechanism,
    ExponentialMechanism,
    Mechanism,
    PrivacyUnit,
)

MECHANISMS = [DChiLaplace(eta=2.0), ExponentialMechanism(epsilon=1.5), BucketizedExponentialMechanism(epsilon=1.5)]


@pytest.mark.parametrize("mechanism", MECHANISMS, ids=lambda m: type(m).__name__)
def test_implements_the_protocol(mechanism, generator):
    assert isinstance(mechanism, Mechanism)
    x = torch.rand(3, 10, generator=generator)
    one, many = mechanism.sample(x, generator=generator), mechanism.sample(x, num_samples=4, generator=generator)
    assert many.shape == (4, *one.shape)
    assert isinstance(mechanism, DiscreteMechanism) == (mechanism.output_kind == "discrete")
    if mechanism.output_kind == "discrete":
        assert one.shape == (3,) and mechanism.log_probabilities(x).shape == x.shape
    else:
        assert one.shape == x.shape


def test_claims_and_spends():
    u, u_prime = torch.zeros(2, 8), torch.full((2, 8), 0.5)
    em = ExponentialMechanism(epsilon=1.5)
    assert em.privacy_bound(u, u_prime) == pytest.approx(3.0)  # composition over 2 rows
    assert em.spend(u).unit is PrivacyUnit.EPSILON and em.spend(u).amount == pytest.approx(3.0)
    with pytest.raises(ValueError, match="not neighbours"):
        em.privacy_bound(u, u + 2.0)
    bem = BucketizedExponentialMechanism(epsilon=1.5, n_buckets=4)
    assert bem.spend(u).amount == pytest.approx(2 * (1.5 + math.log(4) + math.log(8)))
    with pytest.raises(ValueError, match="span"):
        bem.privacy_bound(u, u + 1.5)
