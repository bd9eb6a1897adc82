"""InferDPT (RANTEXT): the law given r, the law of r, the integrated law, the paper's claim against exact losses,
privlm's sound bound, the auditor, and the report."""

import itertools
import math

import numpy as np
import pytest
import torch
from scipy import integrate, stats

import privlm.baselines.inferdpt as inferdpt
from privlm.accounting import Ledger
from privlm.attacks import audit_mechanism
from privlm.baselines.inferdpt import InferDPT, InferDPTMechanism
from privlm.mechanisms import DiscreteMechanism, PrivacyUnit, exact_privacy_loss, make_generator
from privlm.models.language import LanguageModel
from privlm.models.perturbation import TokenOutcome
from privlm.models.vocabulary import CandidateVocabulary
from tests.baselines.test_santext import (
    TEXT,
    assert_pooled_draws_follow,
    chi_square_cells,
    line_vocabulary,
    token,
)
from tests.conftest import BAD_POSITIVE_REALS, P_THRESHOLD

LINE = [0.0, 0.3, 0.7, 1.0, 1.6, 2.5]


@pytest.fixture(scope="session")
def vocabulary(smollm2_lm: LanguageModel) -> CandidateVocabulary:
    return smollm2_lm.vocabulary


def exact_line_law(points: list[float], t: int, eps: float) -> np.ndarray:
    """P(y | t) on a one-dimensional vocabulary, where r = |z| ~ Exp(scale Delta / eps) exactly.

    Between two consecutive distances from t the candidate set is fixed and P(y | t, r) is smooth in r,
    so the integral over r is a sum of smooth pieces, each integrated by adaptive quadrature.
    """
    x = np.array(points)
    d, b, a = np.abs(x - x[t]), (x.max() - x.min()) / eps, eps / 2

    def integrand(r: float) -> np.ndarray:
        w = np.where(d <= r, np.exp(-a * d / max(r, 1e-300)), 0.0)
        return math.exp(-r / b) / b * w / w.sum()
    cuts = sorted(set(d.tolist()))
    return sum(integrate.quad_vec(integrand, lo, hi, epsabs=1e-15, epsrel=1e-12)[0]
               for lo, hi in zip(cuts, [*cuts[1:], math.inf], strict=True))


# --- the law given r, and the law of r -----------------------------------------------------------
def test_law_given_the_radius_is_the_formula_and_sampling_follows_it(vocabulary, generator):
    eps, r = 10.0, 2.7
    mechanism = InferDPTMechanism(vocabulary, eps)
    x = token(vocabulary, " cat")
    d = vocabulary.distances(x.reshape(1))[0].double()
    d[vocabulary.candidate_index[x]] = 0.0
    inside = d <= r
    assert 10 < int(inside.sum()) < vocabulary.size // 2  # a real choice, and not the whole vocabulary
    weights = torch.where(inside, torch.exp(eps * (r - d) / (2 * r)), 0.0)
    law = mechanism.conditional_log_probabilities(x, torch.tensor(r, dtype=torch.float64)).exp()
    torch.testing.assert_close(law, weights / weights.sum(), rtol=1e-9, atol=0)
    draws = mechanism.sample_given_radius(x, torch.full((40_000,), r, dtype=torch.float64), generator=generator)
    assert inside[draws].all()
    assert_pooled_draws_follow(draws, law)


def test_an_input_that_is_no_candidate_keeps_its_nearest_candidate(vocabulary, generator):
    mechanism = InferDPTMechanism(vocabulary, 10.0)
    unknown = torch.tensor(vocabulary.tokenizer.unk_token_id)
    assert vocabulary.candidate_index[unknown] < 0
    nearest = int(vocabulary.distances(unknown.reshape(1))[0].argmin())
    law = mechanism.conditional_log_probabilities(unknown, torch.tensor(1e-6)).exp()
    assert law[nearest].item() == 1.0
    draws = mechanism.sample_given_radius(unknown, torch.full((20,), 1e-6), generator=generator)
    assert (draws == nearest).all()


def test_the_numerical_law_of_r_is_exact_in_mean_and_the_sampler_follows_it(vocabulary, generator):
    mechanism = InferDPTMechanism(vocabulary, 4.0)
    law = mechanism.radius
    radii, masses = law._grid
    b = mechanism.ranges / 4.0
    assert masses.sum() == pytest.approx(1.0, abs=1e-11)
    assert float((masses * radii**2).sum()) == pytest.approx(float(2 * (b**2).sum()), rel=1e-9)  # E r^2 = 2 sum b^2
    draws = law.sample((30_000,), generator=generator).numpy()
    assert stats.kstest(draws, law.cdf).pvalue > P_THRESHOLD
    # r is proportional to 1 / eps: one law, scaled
    s = np.linspace(0.8, 1.2, 9) * float(np.median(draws))
    np.testing.assert_allclose(InferDPTMechanism(vocabulary, 8.0).radius.cdf(s / 2), law.cdf(s), atol=1e-12)


# --- the integrated law --------------------------------------------------------------------------
@pytest.mark.parametrize("eps", [1.0, 3.0, 8.0])
def test_integrated_law_matches_an_exact_integral_on_a_line(eps):
    mechanism = InferDPTMechanism(line_vocabulary(LINE), eps)
    numerical = mechanism.log_probabilities(torch.arange(len(LINE))).exp().numpy()
    exact = np.stack([exact_line_law(LINE, t, eps) for t in range(len(LINE))])
    np.testing.assert_allclose(exact.sum(axis=1), 1.0, atol=1e-9)
    assert 0.5 * np.abs(numerical - exact).sum(axis=1).max() < 1e-3  # total variation, per input
    for s, t in itertools.combinations(range(len(LINE)), 2):
        loss = np.abs(np.log(exact[s]) - np.log(exact[t])).max()
        assert abs(np.abs(np.log(numerical[s]) - np.log(numerical[t])).max() - loss) < 0.05


@pytest.mark.parametrize("few_draws", [0, 10**9], ids=["sorted-rows", "unsorted-rows"])
def test_sampling_follows_the_exact_law_on_a_line(generator, monkeypatch, few_draws):
    """Both sampling paths: prefixes of a sorted row (many releases of a token) and one pass over the row."""
    monkeypatch.setattr(inferdpt, "FEW_DRAWS", few_draws)
    eps = 3.0
    mechanism = InferDPTMechanism(line_vocabulary(LINE), eps)
    x = torch.tensor([0, 5])
    draws = mechanism.sample(x, num_samples=100_000, generator=generator)
    assert draws.shape == (100_000, 2)
    for column, t in enumerate(x.tolist()):
        assert_pooled_draws_follow(draws[:, column], torch.from_numpy(exact_line_law(LINE, t, eps)))


def test_integrated_law_on_smollm2_is_stable_and_sampling_follows_it(vocabulary, generator, monkeypatch):
    """The chi-square is run against the numerical law; it is valid because the integration error moves the
    expected counts by far less than the test can see: the noncentrality n sum (P - P')^2 / P, with P' a rule
    4 times finer, is checked to be below 1 on the test's own cells."""
    eps, n = 14.0, 30_000
    x = token(vocabulary, " cat")
    p = InferDPTMechanism(vocabulary, eps).log_probabilities(x).exp()
    monkeypatch.setattr(inferdpt, "MASS_BINS", 4 * inferdpt.MASS_BINS)
    monkeypatch.setattr(inferdpt, "WIDTH_BINS", 4 * inferdpt.WIDTH_BINS)
    finer = InferDPTMechanism(vocabulary, eps).log_probabilities(x).exp()
    assert 0.5 * float((p - finer).abs().sum()) < 1e-3
    cell = chi_square_cells(p, n)
    cells, cells_finer = np.bincount(cell, weights=p.numpy()), np.bincount(cell, weights=finer.numpy())
    assert n * float(((cells - cells_finer) ** 2 / cells).sum()) < 1  # the noncentrality the error could add
    draws = InferDPTMechanism(vocabulary, eps).sample(x, num_samples=n, generator=generator)
    assert_pooled_draws_follow(draws, p)


# --- privacy: the paper's claim, the sound bound, the auditor ------------------------------------
@pytest.mark.parametrize("eps", [1.0, 3.0, 8.0])
def test_on_a_line_the_sound_bound_holds_and_the_papers_claim_fails(eps):
    vocabulary = line_vocabulary(LINE)
    mechanism = InferDPTMechanism(vocabulary, eps)
    exact = [exact_line_law(LINE, t, eps) for t in range(len(LINE))]
    worst = 0.0
    for s, t in itertools.permutations(range(len(LINE)), 2):
        loss = float(np.abs(np.log(exact[s]) - np.log(exact[t])).max())
        assert loss <= mechanism.privacy_bound(torch.tensor(s), torch.tensor(t))
        worst = max(worst, loss)
    assert worst > mechanism.paper_bound(torch.tensor(0), torch.tensor(1)) == eps


def test_on_real_tokens_the_papers_claim_fails_and_the_sound_bound_holds(vocabulary):
    """' Paris' and ' the' at eps = 6: every output's probability is resolved under both inputs (all finite)."""
    eps = 6.0
    mechanism = InferDPTMechanism(vocabulary, eps)
    x, x_prime = token(vocabulary, " Paris"), token(vocabulary, " the")
    log_p, log_q = mechanism.log_probabilities(x), mechanism.log_probabilities(x_prime)
    assert torch.isfinite(log_p).all() and torch.isfinite(log_q).all()
    loss = exact_privacy_loss(log_p, log_q).item()
    assert loss > 1.5 * mechanism.paper_bound(x, x_prime)  # well beyond the integration's error (about 0.05)
    assert loss <= mechanism.privacy_bound(x, x_prime)
    assert mechanism.privacy_bound(x, x_prime) <= mechanism.per_token_bound


def test_auditor_through_the_protocol_stays_within_the_sound_bound(vocabulary):
    mechanism = InferDPTMechanism(vocabulary, 14.0)
    assert isinstance(mechanism, DiscreteMechanism) and "sound" in mechanism.claim_source
    x, x_prime = token(vocabulary, " cat"), token(vocabulary, " dog")
    result = audit_mechanism(mechanism, x, x_prime, n_samples=12_000, generator=make_generator(13))
    assert result.claimed_epsilon == pytest.approx(mechanism.privacy_bound(x, x_prime))
    assert result.eps_lower <= result.claimed_epsilon


def test_spend_charges_the_sound_worst_case_per_token(vocabulary):
    mechanism = InferDPTMechanism(vocabulary, 3.0)
    spend = mechanism.spend(torch.tensor([10, 11]))
    assert spend.unit is PrivacyUnit.EPSILON and spend.amount == pytest.approx(2 * mechanism.per_token_bound)
    assert mechanism.per_token_bound >= mechanism.privacy_bound(token(vocabulary, " Paris"), token(vocabulary, " the"))


# --- the perturber and its report ----------------------------------------------------------------
def test_report_covers_every_token_with_both_accountings(smollm2_lm, vocabulary, tmp_path):
    ledger = Ledger(tmp_path / "ledger.db", budgets={PrivacyUnit.EPSILON: 1e9})
    perturber = InferDPT.from_model(smollm2_lm, epsilon=10.0, generator=make_generator(3), ledger=ledger)
    out = perturber.perturb(TEXT)
    report = out.report
    ids = vocabulary.tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    assert perturber.name == "inferdpt" and [t.original_id for t in report.tokens] == ids
    assert all(t.outcome is TokenOutcome.PERTURBED and t.epsilon == 10.0 for t in report.tokens)
    n = len(ids)
    assert report.accounting["paper"] == pytest.approx(10.0 * n)
    assert report.accounting["privlm"] == pytest.approx(perturber.mechanism.per_token_bound * n)
    assert ledger.spent("local", PrivacyUnit.EPSILON) == pytest.approx(report.accounting["privlm"]) == report.spent
    assert out.text == vocabulary.tokenizer.decode([t.released_id for t in report.tokens])


def test_seeded_generators_reproduce(vocabulary):
    first = InferDPT(vocabulary, epsilon=10.0, generator=make_generator(4)).perturb(TEXT)
    assert InferDPT(vocabulary, epsilon=10.0, generator=make_generator(4)).perturb(TEXT) == first
    assert InferDPT(vocabulary, epsilon=10.0, generator=make_generator(5)).perturb(TEXT).text != first.text


@pytest.mark.parametrize("epsilon", BAD_POSITIVE_REALS)
def test_bad_epsilon_is_refused(vocabulary, epsilon):
    with pytest.raises(ValueError, match="epsilon"):
        InferDPT(vocabulary, epsilon=epsilon)
    with pytest.raises(ValueError, match="epsilon"):
        InferDPTMechanism(vocabulary, epsilon)


def test_bad_inputs_are_refused(vocabulary):
    mechanism = InferDPTMechanism(vocabulary, 5.0)
    x = token(vocabulary, " cat")
    for radius in (torch.tensor(0.0), torch.tensor(-1.0), torch.tensor(math.nan), torch.tensor(1), 1.0):
        with pytest.raises(ValueError, match="radius"):
            mechanism.sample_given_radius(x, radius)  # type: ignore[arg-type]
    for bad in (torch.tensor([0.5]), torch.tensor([[1, 2]]), torch.tensor([-3])):
        with pytest.raises(ValueError, match="x"):
            mechanism.sample(bad)
    for num_samples in (0, -1, 2.0):
        with pytest.raises(ValueError, match="num_samples"):
            mechanism.sample(x, num_samples=num_samples)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="texts"):
        InferDPT(vocabulary, epsilon=1.0).perturb("")
    with pytest.raises(ValueError, match="distinct"):
        InferDPTMechanism(line_vocabulary([1.0, 1.0]), 1.0)
