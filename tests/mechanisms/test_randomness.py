import pytest
import torch

from privlm.mechanisms import ExponentialMechanism, make_generator
from privlm.mechanisms.randomness import resolve_generator


def test_default_generators_are_seeded_from_os_entropy():
    seeds = {make_generator().initial_seed() for _ in range(20)}
    assert len(seeds) == 20


def test_explicit_seed_reproduces():
    u = torch.rand(30)
    mechanism = ExponentialMechanism(epsilon=1.0)
    a = mechanism.sample(u, num_samples=50, generator=make_generator(3))
    b = mechanism.sample(u, num_samples=50, generator=make_generator(3))
    assert torch.equal(a, b)


def test_global_rng_is_untouched():
    state = torch.get_rng_state()
    ExponentialMechanism(epsilon=1.0).sample(torch.rand(30, generator=make_generator(1)), num_samples=10)
    assert torch.equal(state, torch.get_rng_state())


@pytest.mark.parametrize("seed", [-1, 1.5, "7", True])
def test_bad_seeds_are_rejected(seed):
    with pytest.raises(ValueError, match="seed"):
        make_generator(seed)


def test_generator_must_match_the_data_device():
    with pytest.raises(ValueError, match="generator"):
        resolve_generator("not a generator", torch.device("cpu"))  # type: ignore[arg-type]
