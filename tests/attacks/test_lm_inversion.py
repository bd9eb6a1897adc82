"""LM-prior inversion of noisy rows: exact noise laws, eta estimation, the priors, and that on fluent text the prior
recovers tokens nearest neighbour cannot (and that without the prior it IS nearest neighbour)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import integrate

from privlm.attacks import (
    CausalLMPrior,
    DChiNoise,
    LMInversionConfig,
    NGramPrior,
    ReleasedTokenNoise,
    clip_rate,
    estimate_eta,
    lm_inversion,
    nearest_neighbour_inversion,
    token_id_inversion,
    undo_clip_scale,
)
from privlm.attacks.lm_inversion import _clipped_table, _interpolate, clipped_log_likelihood
from privlm.mechanisms import DChiLaplace, make_generator, project_to_vocabulary
from privlm.mechanisms.clipping import clip_to_norm
from tests.models.tiny import tiny_model

V, D = 200, 16
LIKELIHOOD_ONLY = LMInversionConfig(prior_weight=0.0)


def _world(seed: int = 0) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """A random vocabulary and fluent text: a sparse Markov chain (3 successors per token, probabilities .6 .3 .1);
    the prior's texts and the attacked texts are separate draws."""
    g = make_generator(seed)
    vocabulary = torch.randn(V, D, generator=g)
    successors = torch.stack([torch.randperm(V, generator=g)[:3] for _ in range(V)])
    probs = torch.tensor([0.6, 0.3, 0.1])

    def draw(n: int, length: int) -> list[torch.Tensor]:
        texts = []
        for _ in range(n):
            ids = [int(torch.randint(V, (1,), generator=g))]
            for _ in range(length - 1):
                ids.append(int(successors[ids[-1], torch.multinomial(probs, 1, generator=g)]))
            texts.append(torch.tensor(ids))
        return texts

    return vocabulary, draw(400, 20), draw(50, 16)


@pytest.fixture(scope="module")
def world() -> tuple[torch.Tensor, NGramPrior, list[torch.Tensor]]:
    vocabulary, public, attacked = _world()
    return vocabulary, NGramPrior.fit([t.tolist() for t in public], V), attacked


def _release(vocabulary: torch.Tensor, texts: list[torch.Tensor], eta: float, *, clip: float | None = None,
             seed: int = 1) -> list[torch.Tensor]:
    g = make_generator(seed)
    rows = [DChiLaplace(eta=eta).sample(vocabulary[t], generator=g) for t in texts]
    return rows if clip is None else [clip_to_norm(r, max_norm=clip) for r in rows]


def test_without_the_prior_it_is_nearest_neighbour(world):
    vocabulary, prior, texts = world
    released = _release(vocabulary, texts, 3.0)
    inversion = lm_inversion(released, texts, vocabulary, noise=DChiNoise(3.0), prior=prior, config=LIKELIHOOD_ONLY)
    nn = nearest_neighbour_inversion(torch.cat(released), torch.cat(texts), vocabulary)
    expected = project_to_vocabulary(torch.cat(released), vocabulary)
    assert torch.equal(torch.cat(inversion.guesses), expected)
    assert inversion.result.successes == nn.successes
    assert inversion.result.details["changed_share"] == 0.0


def test_the_prior_beats_nearest_neighbour_on_fluent_text(world):
    vocabulary, prior, texts = world
    released = _release(vocabulary, texts, 3.0)
    nn = nearest_neighbour_inversion(torch.cat(released), torch.cat(texts), vocabulary)
    assert 0.3 <= nn.rate <= 0.6  # the regime where the rows alone are ambiguous
    result = lm_inversion(released, texts, vocabulary, noise=DChiNoise(3.0), prior=prior).result
    assert result.ci_low > nn.ci_high
    assert result.details["max_likelihood_successes"] == nn.successes
    assert 0 < result.details["changed_share"] < 1 and result.details["shortlist_recall"] > result.rate


def test_clipped_rows_exact_law_beats_nearest_neighbour_and_reports_the_clip_rate(world):
    vocabulary, prior, texts = world
    clip = float(vocabulary.norm(dim=-1).max())
    eta = 2.5
    released = _release(vocabulary, texts, eta, clip=clip)
    rows, truth = torch.cat(released), torch.cat(texts)
    nn = nearest_neighbour_inversion(undo_clip_scale(rows, eta=eta, clip_norm=clip, vocabulary=vocabulary), truth,
                                     vocabulary)
    result = lm_inversion(released, texts, vocabulary, noise=DChiNoise(eta, clip_norm=clip), prior=prior).result
    assert result.details["clip_rate"] == pytest.approx(clip_rate(rows, clip)) and result.details["clip_rate"] > 0.5
    assert result.ci_low > nn.ci_high
    alone = lm_inversion(released, texts, vocabulary, noise=DChiNoise(eta, clip_norm=clip), prior=prior,
                         config=LIKELIHOOD_ONLY).result
    assert alone.successes >= nn.successes - 0.02 * nn.trials  # the exact law is no worse than undo-scale NN


def test_clipped_quadrature_matches_scipy():
    eta, dim, clip = 3.0, 5, 1.5
    for a, b in [(1.2, 1.69), (-0.4, 0.8), (0.0, 2.25), (1.5, 2.25)]:
        def integrand(r: float, a: float = a, b: float = b) -> float:
            return math.exp(-eta * math.sqrt(max(r * r - 2 * r * a + b, 0.0)) + (dim - 1) * math.log(r))

        value, _ = integrate.quad(integrand, clip, np.inf, epsabs=0, epsrel=1e-12, limit=200)
        ours = clipped_log_likelihood(torch.tensor(a), torch.tensor(b), eta=eta, dim=dim, clip_norm=clip)
        assert float(ours) == pytest.approx(math.log(value), abs=1e-5)


def test_the_table_interpolates_the_quadrature():
    g = make_generator(3)
    for eta, dim, clip in [(2.0, 16, 6.0), (50.0, 384, 1.7)]:
        norm_min, norm_max = 0.5, clip
        cosine = torch.rand(400, generator=g, dtype=torch.float64) * 2 - 1
        norm = norm_min + torch.rand(400, generator=g, dtype=torch.float64) * (norm_max - norm_min)
        table = _clipped_table(eta, dim, clip, norm_min, norm_max)
        interpolated = _interpolate(table, cosine[:, None], norm[:, None], norm_min, norm_max)[:, 0]
        direct = clipped_log_likelihood(cosine * norm, norm**2, eta=eta, dim=dim, clip_norm=clip, a_max=norm_max)
        assert (interpolated - direct).abs().max() < 1e-4


def test_the_clipped_density_matches_monte_carlo_in_the_plane():
    """d = 2: the share of releases clipped into an angle bin is the integral of eta^2 / (2 pi) exp(h) over it."""
    eta, clip = 2.0, 1.0
    row = torch.tensor([[0.8, 0.3]], dtype=torch.float64)
    n = 400_000
    released = clip_to_norm(DChiLaplace(eta=eta).sample(row.expand(n, 2), generator=make_generator(5)),
                            max_norm=clip)
    angles = torch.atan2(released[:, 1], released[:, 0])[released.norm(dim=-1) >= clip * (1 - 1e-9)]
    edges = torch.linspace(-math.pi, math.pi, 25, dtype=torch.float64)
    observed = torch.histc(angles, bins=24, min=-math.pi, max=math.pi) / n
    fine = torch.linspace(-math.pi, math.pi, 24 * 200 + 1, dtype=torch.float64)
    directions = torch.stack([fine.cos(), fine.sin()], dim=-1)
    density = eta**2 / (2 * math.pi) * clipped_log_likelihood(directions @ row[0], row.pow(2).sum(), eta=eta,
                                                              dim=2, clip_norm=clip).exp()
    mass = torch.tensor([float(torch.trapezoid(density[i * 200:(i + 1) * 200 + 1], fine[i * 200:(i + 1) * 200 + 1]))
                         for i in range(24)])
    assert edges.shape[0] == 25
    assert (observed - mass).abs().max() < 4 * math.sqrt(float(mass.max()) / n)


def test_token_id_releases_use_the_surrogate(world):
    vocabulary, prior, texts = world
    g = make_generator(2)
    eta = 3.0
    ids = [project_to_vocabulary(DChiLaplace(eta=eta).sample(vocabulary[t], generator=g), vocabulary) for t in texts]
    rows = [vocabulary[i] for i in ids]
    baseline = token_id_inversion(torch.cat(ids), torch.cat(texts), vocabulary)
    noise = ReleasedTokenNoise.calibrated(vocabulary, eta, generator=make_generator(3))
    assert noise.scale is not None and noise.scale < eta  # retention is lower than exp(-eta * distance) implies
    alone = lm_inversion(rows, texts, vocabulary, noise=noise, prior=prior, config=LIKELIHOOD_ONLY)
    assert torch.equal(torch.cat(alone.guesses), torch.cat(ids))  # the released token itself
    result = lm_inversion(rows, texts, vocabulary, noise=noise, prior=prior).result
    assert result.ci_low > baseline.ci_high and result.details["clip_rate"] is None


@pytest.mark.parametrize(("eta", "clipped"), [(2.0, False), (6.0, False), (1.5, True), (4.0, True)])
def test_eta_is_estimated_within_ten_percent(world, eta, clipped):
    vocabulary = world[0]
    clip = float(vocabulary.norm(dim=-1).max()) if clipped else None
    tokens = torch.randint(V, (2000,), generator=make_generator(11))  # uniform tokens: frequencies=None is right
    rows = DChiLaplace(eta=eta).sample(vocabulary[tokens], generator=make_generator(12))
    if clip is not None:
        rows = clip_to_norm(rows, max_norm=clip)
        assert clip_rate(rows, clip) > 0.1
    estimate = estimate_eta(rows, vocabulary, clip_norm=clip, generator=make_generator(13))
    assert abs(estimate / eta - 1) < 0.1


def test_the_ngram_prior_is_normalised_and_learns_the_chain():
    _, public, _ = _world()
    prior = NGramPrior.fit([t.tolist() for t in public], V, order=3)
    state = prior.extend(prior.extend(prior.start(), int(public[0][0])), int(public[0][1]))
    unseen = prior.extend(prior.extend(prior.start(), 7), 7)
    log_probs = prior.next_log_probs([prior.start(), state, unseen])
    assert log_probs.shape == (3, V)
    assert torch.allclose(log_probs.exp().sum(-1), torch.ones(3, dtype=torch.float64), atol=1e-9)
    assert bool(torch.isfinite(log_probs).all())
    assert float(log_probs[1, int(public[0][2])]) > math.log(0.05)  # a successor of the chain is likely
    assert int(prior.token_counts.sum()) == sum(len(t) for t in public)
    with pytest.raises(ValueError):
        NGramPrior.fit([[0, V]], V)


def test_the_causal_lm_prior_is_the_models_next_token_distribution():
    model = tiny_model("llama")
    prior = CausalLMPrior(model, start_id=2)
    first = prior.extend(prior.start(), 5)
    second = prior.extend(first, 7)
    other = prior.extend(first, 9)  # a sibling: the parent's cache must be left as it was
    with torch.no_grad():
        expected = model(input_ids=torch.tensor([[2, 5, 7], [2, 5, 9]])).logits[:, -1].log_softmax(-1)
    assert torch.allclose(prior.next_log_probs([second, other]), expected, atol=1e-5)
    assert prior.vocab_size == model.config.vocab_size


def test_a_causal_lm_prior_runs_the_attack():
    model = tiny_model("llama")
    g = make_generator(4)
    vocabulary = torch.randn(model.config.vocab_size, 8, generator=g)
    texts = [torch.randint(5, model.config.vocab_size, (6,), generator=g) for _ in range(3)]
    released = [DChiLaplace(eta=20.0).sample(vocabulary[t], generator=g) for t in texts]
    inversion = lm_inversion(released, texts, vocabulary, noise=DChiNoise(20.0), prior=CausalLMPrior(model, start_id=2),
                             config=LMInversionConfig(beam=3, shortlist=5, prior_weight=0.5))
    assert [guess.shape for guess in inversion.guesses] == [t.shape for t in texts]
    assert inversion.result.rate > inversion.result.chance


def test_inputs_are_checked(world):
    vocabulary, prior, texts = world
    released = _release(vocabulary, texts[:2], 3.0)
    noise = DChiNoise(3.0)
    with pytest.raises(ValueError, match="true_ids"):
        lm_inversion(released, texts[:1], vocabulary, noise=noise, prior=prior)
    with pytest.raises(ValueError, match="shape"):
        lm_inversion(released, [texts[0], texts[1][:-1]], vocabulary, noise=noise, prior=prior)
    with pytest.raises(ValueError, match="dimension"):
        lm_inversion([r[:, :-1] for r in released], texts[:2], vocabulary, noise=noise, prior=prior)
    bad = released[0].clone()
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        lm_inversion([bad, released[1]], texts[:2], vocabulary, noise=noise, prior=prior)
    with pytest.raises(ValueError, match="vocabulary"):
        lm_inversion(released, texts[:2], vocabulary[:-1], noise=noise, prior=prior)
    with pytest.raises(ValueError, match="eta"):
        DChiNoise(0.0)
    with pytest.raises(ValueError, match="noise"):
        estimate_eta(vocabulary[:10], vocabulary)


@pytest.mark.parametrize(("change", "expected"), [
    ({"noise": 3.0}, "noise must be a NoiseModel"),  # eta, not its law
    ({"noise": "dchi"}, "noise must be a NoiseModel"),
    ({"prior": [[1, 2, 3]]}, "prior must be a TokenPrior"),  # the texts, not the fitted prior
    ({"prior": None}, "prior must be a TokenPrior"),
])
def test_a_noise_or_prior_of_the_wrong_type_is_named(world, change, expected):
    vocabulary, prior, texts = world
    args = {"noise": DChiNoise(3.0), "prior": prior, **change}
    with pytest.raises(ValueError, match=expected):
        lm_inversion(_release(vocabulary, texts[:2], 3.0), texts[:2], vocabulary, **args)
