import math

import pytest
import torch
from scipy import stats

from privlm.mechanisms import DChiLaplace, make_generator, sample_dchi_noise
from tests.conftest import BAD_POSITIVE_REALS, P_THRESHOLD

N = 20_000


@pytest.mark.parametrize("d", [2, 384])
@pytest.mark.parametrize("eta", [0.5, 25.0])
def test_norms_follow_gamma_d_over_eta(d, eta, generator):
    z = sample_dchi_noise((N, d), eta=eta, generator=generator, dtype=torch.float64)
    norms = z.norm(dim=-1).numpy()
    assert stats.kstest(norms, "gamma", args=(d, 0, 1 / eta)).pvalue > P_THRESHOLD
    # E||z|| = d / eta: z-test with the Gamma standard deviation sqrt(d) / eta.
    z_score = (norms.mean() - d / eta) / (math.sqrt(d) / eta / math.sqrt(N))
    assert 2 * stats.norm.sf(abs(z_score)) > P_THRESHOLD


@pytest.mark.parametrize("d", [2, 384])
def test_directions_are_isotropic(d, generator):
    z = sample_dchi_noise((N, d), eta=3.0, generator=generator, dtype=torch.float64)
    v = z / z.norm(dim=-1, keepdim=True)
    # For v uniform on S^{d-1}: v_1^2 ~ Beta(1/2, (d-1)/2).
    first = (v[:, 0] ** 2).numpy()
    assert stats.kstest(first, "beta", args=(0.5, (d - 1) / 2)).pvalue > P_THRESHOLD
    # Cov(v) = I/d, so N * d * ||mean v||^2 is approximately chi-square with d degrees of freedom.
    statistic = N * d * v.mean(dim=0).pow(2).sum().item()
    assert stats.chi2.sf(statistic, d) > P_THRESHOLD
    if d == 2:
        angles = torch.atan2(v[:, 1], v[:, 0]).numpy()
        assert stats.kstest(angles, "uniform", args=(-math.pi, 2 * math.pi)).pvalue > P_THRESHOLD


def test_one_radius_per_vector(generator):
    z = sample_dchi_noise((4, 50, 8), eta=1.0, generator=generator)
    assert z.shape == (4, 50, 8)
    norms = z.norm(dim=-1)
    assert norms.unique().numel() == 200  # every vector has its own radius


def test_legacy_sampler_matches_the_reference_code_distribution(generator):
    """Legacy: z_j = G_j * U_j, G_j ~ Gamma(d, 1/eta), U_j ~ U[-1, 1], independently per coordinate."""
    d, eta = 8, 2.0
    z = sample_dchi_noise((N // 8, d), eta=eta, sampler="legacy", generator=generator, dtype=torch.float64)
    magnitude = z.abs().flatten().numpy()
    gamma_d, gamma_d_minus_1 = stats.gamma(d, scale=1 / eta), stats.gamma(d - 1, scale=1 / eta)

    def cdf(t):  # P(G |U| <= t) = F_d(t) + t * eta / (d - 1) * (1 - F_{d-1}(t))
        return gamma_d.cdf(t) + t * eta / (d - 1) * gamma_d_minus_1.sf(t)

    assert stats.kstest(magnitude, cdf).pvalue > P_THRESHOLD
    assert stats.binomtest(int((z > 0).sum()), z.numel()).pvalue > P_THRESHOLD
    # Independent radii per coordinate: |z_1| and |z_2| are uncorrelated (a shared radius is not).
    assert stats.spearmanr(z[:, 0].abs(), z[:, 1].abs()).pvalue > P_THRESHOLD


def test_legacy_noise_is_about_16x_larger_at_d_768(generator):
    d, eta = 768, 10.0
    correct = sample_dchi_noise((2000, d), eta=eta, generator=generator).norm(dim=-1).mean().item()
    legacy = sample_dchi_noise((2000, d), eta=eta, sampler="legacy", generator=generator)
    # ||z||^2 / d -> E[G^2] E[U^2] = d (d + 1) / (3 eta^2), so the ratio to d / eta is sqrt((d + 1) / 3).
    ratio = legacy.norm(dim=-1).mean().item() / correct
    assert ratio == pytest.approx(math.sqrt((d + 1) / 3), rel=0.02)
    assert 15.5 < ratio < 16.5


def test_privacy_loss_of_density_is_bounded_by_eta_distance(generator):
    """ln p(y|x) - ln p(y|x') = eta (||y - x'|| - ||y - x||) <= eta ||x - x'|| on sampled outputs."""
    eta, d = 2.0, 16
    x = torch.randn(d, generator=generator, dtype=torch.float64)
    x_prime = x + torch.randn(d, generator=generator, dtype=torch.float64)
    y = DChiLaplace(eta=eta).sample(x.expand(5000, d).clone(), generator=generator)
    loss = eta * ((y - x_prime).norm(dim=-1) - (y - x).norm(dim=-1))
    bound = eta * (x - x_prime).norm().item()
    assert loss.max().item() <= bound + 1e-9
    assert loss.max().item() > 0.5 * bound  # the bound is approached along the x - x' direction


def test_seeded_generators_reproduce_and_default_is_fresh():
    a = sample_dchi_noise((3, 5), eta=1.0, generator=make_generator(7))
    b = sample_dchi_noise((3, 5), eta=1.0, generator=make_generator(7))
    assert torch.equal(a, b)
    c = sample_dchi_noise((3, 5), eta=1.0)
    d = sample_dchi_noise((3, 5), eta=1.0)
    assert not torch.equal(c, d)


def test_does_not_touch_the_global_rng():
    state = torch.get_rng_state()
    DChiLaplace(eta=1.0).sample(torch.zeros(4, 3))
    assert torch.equal(state, torch.get_rng_state())


@pytest.mark.parametrize("eta", BAD_POSITIVE_REALS)
def test_bad_eta_is_rejected_by_name(eta):
    with pytest.raises(ValueError, match="eta"):
        DChiLaplace(eta=eta)
    with pytest.raises(ValueError, match="eta"):
        sample_dchi_noise((2, 3), eta=eta)


def test_bad_shapes_and_sampler_are_rejected():
    with pytest.raises(ValueError, match="size"):
        sample_dchi_noise((), eta=1.0)
    with pytest.raises(ValueError, match="size"):
        sample_dchi_noise((0, 3), eta=1.0)
    with pytest.raises(ValueError, match="sampler"):
        sample_dchi_noise((2, 3), eta=1.0, sampler="uniform")
    with pytest.raises(ValueError, match="x"):
        DChiLaplace(eta=1.0).sample(torch.tensor([[float("nan"), 0.0]]))
    with pytest.raises(ValueError, match="x"):
        DChiLaplace(eta=1.0).sample(torch.ones(2, 3, dtype=torch.long))


def test_parameters_are_keyword_only():
    with pytest.raises(TypeError):
        DChiLaplace(1.0)  # type: ignore[misc]


def test_per_row_eta_gives_each_row_its_own_gamma_law(generator):
    """eta as a tensor: row i's noise norm follows Gamma(d, 1/eta_i)."""
    d, etas = 16, torch.tensor([[0.5], [4.0]], dtype=torch.float64)
    x = torch.zeros(2, N, d, dtype=torch.float64)
    z = DChiLaplace(eta=etas).sample(x, generator=generator)
    for row, eta in enumerate(etas.flatten().tolist()):
        norms = z[row].norm(dim=-1).numpy()
        assert stats.kstest(norms, "gamma", args=(d, 0, 1 / eta)).pvalue > P_THRESHOLD


def test_noise_at_any_eta_is_the_unit_draw_divided_by_eta():
    """Gamma(d, 1/eta) = Gamma(d, 1) / eta: one seeded generator gives common random numbers across etas."""
    unit = sample_dchi_noise((6, 5), eta=1.0, generator=make_generator(4))
    for eta in (0.3, 7.0):
        assert torch.equal(sample_dchi_noise((6, 5), eta=eta, generator=make_generator(4)), unit / eta)
    per_row = torch.tensor([2.0, 3.0, 5.0, 7.0, 11.0, 13.0])
    assert torch.equal(sample_dchi_noise((6, 5), eta=per_row, generator=make_generator(4)),
                       unit / per_row.unsqueeze(-1))


@pytest.mark.parametrize("bad", [torch.tensor([1.0, 0.0]), torch.tensor([1.0, float("nan")]), torch.tensor([1, 2]),
                                 torch.tensor([])])
def test_bad_per_row_eta_is_rejected(bad):
    with pytest.raises(ValueError, match="eta"):
        DChiLaplace(eta=bad)


def test_per_row_eta_must_broadcast_to_the_rows():
    with pytest.raises(ValueError, match="broadcast"):
        DChiLaplace(eta=torch.tensor([1.0, 2.0, 3.0])).sample(torch.zeros(2, 4))


def test_privacy_bound_and_spend_compose_over_rows():
    x = torch.zeros(3, 4)
    x_prime = torch.zeros(3, 4)
    x_prime[:, 0] = torch.tensor([1.0, 2.0, 0.0])
    assert DChiLaplace(eta=2.0).privacy_bound(x, x_prime) == pytest.approx(2.0 * (1 + 2 + 0))
    per_row = DChiLaplace(eta=torch.tensor([1.0, 10.0, 100.0]))
    assert per_row.privacy_bound(x, x_prime) == pytest.approx(1 * 1 + 10 * 2)
    assert per_row.spend(x).unit == "eta-token" and per_row.spend(x).amount == pytest.approx(111.0)
    assert DChiLaplace(eta=2.5).spend(torch.zeros(2, 7, 4)).amount == pytest.approx(2.5 * 14)


def test_num_samples_stacks_independent_releases_first(generator):
    x = torch.randn(3, 4, generator=generator)
    y = DChiLaplace(eta=1.0).sample(x, num_samples=5, generator=generator)
    assert y.shape == (5, 3, 4)
    assert not torch.equal(y[0], y[1])
