"""Token-level Text2Text: d_chi noise on the embedding row, released as the nearest candidate.

Its law has no closed form in d > 1 (Voronoi cells). In d = 1 it has one: Laplace noise and intervals between
midpoints, so on a 1-D vocabulary the sampled law and the exact privacy loss are checked against the math; in
higher dimension the auditor checks the claim through the protocol.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import BertTokenizerFast

from privlm.attacks import audit_mechanism
from privlm.baselines.text2text import Text2Text, Text2TextMechanism, Text2TextPerturber, release_nearest
from privlm.mechanisms import (
    DChiLaplace,
    DiscreteMechanism,
    Mechanism,
    PrivacyUnit,
    exact_privacy_loss,
    make_generator,
    project_to_vocabulary,
)
from privlm.models.language import LanguageModel
from privlm.models.perturbation import TextPerturber, TokenOutcome
from privlm.models.prompts import NonSensitiveTokens, tokenize_prompt
from privlm.models.vocabulary import CandidateVocabulary
from tests.conftest import BAD_POSITIVE_REALS, assert_draws_follow
from tests.models.tiny import VOCAB, WORDS

PROMPT = "My friend Alice Johnson lives at 42 Baker Street, and she works for the bank."


@pytest.fixture(scope="session")
def smollm2_vocabulary(smollm2_lm: LanguageModel) -> CandidateVocabulary:
    return smollm2_lm.vocabulary


def small_vocabulary(table: torch.Tensor) -> CandidateVocabulary:
    """94 candidates (WordPiece ids 5..98; ids 0..4 are special) with the given (99, d) embedding rows."""
    words = WORDS + [f"w{i}" for i in range(VOCAB - len(WORDS))]
    return CandidateVocabulary.from_tokenizer(BertTokenizerFast(vocab={w: i for i, w in enumerate(words)}), table)


@pytest.fixture(scope="module")
def line() -> CandidateVocabulary:
    """A 1-D vocabulary: candidates 0.02 to 0.08 apart around 0; the special rows sit on candidates.

    Spacings well above float32's resolution of the squared-distance identity (the projection's): small norms.
    """
    gaps = 0.02 + 0.06 * torch.rand(VOCAB, generator=torch.Generator().manual_seed(4))
    positions = gaps.cumsum(0)
    positions = (positions - positions.mean())[torch.randperm(VOCAB, generator=torch.Generator().manual_seed(5))]
    positions[:5] = positions[[10, 20, 30, 40, 50]]  # a special row on a candidate is never released
    return small_vocabulary(positions.unsqueeze(1))


@pytest.fixture(scope="module")
def cloud() -> CandidateVocabulary:
    return small_vocabulary(torch.randn(VOCAB, 16, generator=torch.Generator().manual_seed(5)))


def exact_log_law_1d(vocabulary: CandidateVocabulary, token: int, eta: float) -> torch.Tensor:
    """log P(candidate | token) in d = 1: Laplace(1/eta) noise mass on each candidate's interval of midpoints."""
    points = vocabulary.candidate_embeddings[:, 0].double()
    order = points.argsort()
    sorted_points = points[order]
    middle = (sorted_points[1:] + sorted_points[:-1]) / 2
    infinity = torch.tensor([math.inf], dtype=torch.float64)
    x = vocabulary.rows_of(torch.tensor(token))[0].double()
    low, high = torch.cat([-infinity, middle]) - x, torch.cat([middle, infinity]) - x  # each cell, relative to x

    def cdf(t: torch.Tensor) -> torch.Tensor:
        return torch.where(t < 0, 0.5 * torch.exp(eta * t.clamp(max=0)), 1 - 0.5 * torch.exp(-eta * t.clamp(min=0)))

    right = 0.5 * (torch.exp(-eta * low.clamp(min=0)) - torch.exp(-eta * high.clamp(min=0)))  # cells past x
    left = 0.5 * (torch.exp(eta * high.clamp(max=0)) - torch.exp(eta * low.clamp(max=0)))  # cells before x
    mass = torch.where(low >= 0, right, torch.where(high <= 0, left, cdf(high) - cdf(low)))
    law = torch.empty_like(mass)
    law[order] = mass
    return law.log()


def merged(draws: torch.Tensor, probabilities: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pool the outputs expected fewer than 5 times into one last cell (the chi-square needs counts)."""
    kept = probabilities * n >= 5
    cell = torch.full_like(probabilities, int(kept.sum()), dtype=torch.long)
    cell[kept] = torch.arange(int(kept.sum()))
    if bool(kept.all()):
        return cell[draws], probabilities
    return cell[draws], torch.cat([probabilities[kept], probabilities[~kept].sum().reshape(1)])


# --- the mechanism -------------------------------------------------------------------------------

def test_the_mechanism_implements_the_protocol_without_an_exact_law(line):
    mechanism = Text2TextMechanism(line, eta=2.0)
    assert isinstance(mechanism, Mechanism) and mechanism.output_kind == "discrete"
    assert not isinstance(mechanism, DiscreteMechanism)  # no closed-form log_probabilities
    x = torch.tensor([6, 7, 8])
    assert mechanism.sample(x, generator=make_generator(0)).shape == (3,)
    assert mechanism.sample(x, num_samples=5, generator=make_generator(0)).shape == (5, 3)
    assert mechanism.sample(torch.tensor(6), num_samples=5, generator=make_generator(0)).shape == (5,)
    spend = mechanism.spend(x)
    assert spend.unit is PrivacyUnit.ETA_TOKEN and spend.amount == 6.0


def test_the_release_is_the_candidate_nearest_to_the_noisy_row(cloud):
    rows = cloud.rows_of(torch.tensor([1, 6, 50]))
    noise = DChiLaplace(eta=3.0)
    noisy = noise.sample(rows, num_samples=200, generator=make_generator(8))
    released = release_nearest(noise, rows, cloud.candidate_embeddings, generator=make_generator(8), num_samples=200)
    assert torch.equal(released, torch.cdist(noisy.double(), cloud.candidate_embeddings.double()).argmin(-1))


def test_both_text2text_classes_release_the_shared_projection_of_their_noisy_rows(cloud, tiny_bert):
    """The one nearest-row projection (ties to the lowest id), whatever the chunking."""
    mechanism = Text2TextMechanism(cloud, eta=3.0, chunk_size=7)
    x = torch.tensor([1, 6, 50])
    noisy = mechanism.noise.sample(cloud.rows_of(x), num_samples=50, generator=make_generator(3))
    expected = project_to_vocabulary(noisy, cloud.candidate_embeddings, chunk_size=1)
    assert torch.equal(mechanism.sample(x, num_samples=50, generator=make_generator(3)), expected)
    released = Text2Text(tiny_bert, eta=5.0, generator=make_generator(4), chunk_size=3).privatize(["a b c"])
    clean = tiny_bert.embed_tokens(released.batch.input_ids[released.perturbed])
    noisy = DChiLaplace(eta=5.0).sample(clean, generator=make_generator(4))
    assert torch.equal(released.released_ids[released.perturbed],
                       project_to_vocabulary(noisy, tiny_bert.embedding_matrix))


def test_sampled_outputs_follow_the_exact_1d_law(line):
    mechanism, eta, n = Text2TextMechanism(line, eta=1.5), 1.5, 60_000
    for token in (7, 60, 1):  # a special id too: its noisy row is released as a candidate
        draws = mechanism.sample(torch.tensor(token), num_samples=n, generator=make_generator(token))
        law = exact_log_law_1d(line, token, eta).exp()
        assert torch.allclose(law.sum(), torch.tensor(1.0, dtype=torch.float64))
        assert_draws_follow(*merged(draws, law, n))


def test_the_exact_1d_privacy_loss_stays_within_the_claim(line):
    mechanism = Text2TextMechanism(line, eta=2.0)
    for x, x_prime in [(7, 8), (6, 90), (1, 33)]:
        claim = mechanism.privacy_bound(torch.tensor(x), torch.tensor(x_prime))
        distance = (line.rows_of(torch.tensor(x)) - line.rows_of(torch.tensor(x_prime))).norm().item()
        assert claim == pytest.approx(2.0 * distance)
        loss = exact_privacy_loss(exact_log_law_1d(line, x, 2.0), exact_log_law_1d(line, x_prime, 2.0)).item()
        assert 0.99 * claim <= loss <= claim + 1e-9  # reached in the tails, never exceeded


@pytest.mark.parametrize("vocabulary_name", ["line", "cloud"])
def test_the_auditor_stays_below_the_claim(vocabulary_name, request):
    vocabulary = request.getfixturevalue(vocabulary_name)
    mechanism = Text2TextMechanism(vocabulary, eta=1.0 if vocabulary_name == "line" else 2.0)
    x, x_prime = torch.tensor(6), torch.tensor(7)
    result = audit_mechanism(mechanism, x, x_prime, n_samples=30_000, generator=make_generator(21))
    assert result.claimed_epsilon == pytest.approx(mechanism.privacy_bound(x, x_prime))
    assert result.exact_epsilon is None and not result.exceeds_claim
    assert result.eps_lower <= result.claimed_epsilon


def test_special_rows_are_never_released(line):
    mechanism = Text2TextMechanism(line, eta=0.3)
    draws = mechanism.sample(torch.tensor([10, 1]), num_samples=5_000, generator=make_generator(2))
    released = line.candidate_ids[draws]
    assert int(released.min()) >= 5  # ids 0..4 are special, though rows 0..4 sit on candidates
    assert released.unique().numel() > 20  # and the noise does move the release around


# --- the perturber -------------------------------------------------------------------------------

def test_text2text_perturbs_every_token_into_a_candidate(smollm2_vocabulary, tmp_path):
    from privlm.accounting import Ledger

    ledger = Ledger(tmp_path / "ledger.db", budgets={PrivacyUnit.ETA_TOKEN: 1000.0})
    text2text = Text2TextPerturber(smollm2_vocabulary, epsilon=5.0, generator=make_generator(1), ledger=ledger,
                                   principal="carol")
    assert isinstance(text2text, TextPerturber) and text2text.name == "text2text" and text2text.eta == 5.0
    result = text2text.perturb(PROMPT)
    prompt = tokenize_prompt(smollm2_vocabulary.tokenizer, PROMPT)
    report = result.report
    assert [t.original_id for t in report.tokens] == list(prompt.ids)
    assert {t.outcome for t in report.tokens} == {TokenOutcome.PERTURBED}
    released = torch.tensor([t.released_id for t in report.tokens])
    assert bool((smollm2_vocabulary.candidate_index[released] >= 0).all())
    assert report.accounting == {"paper": 5.0 * len(prompt), "privlm": 5.0 * len(prompt)}
    assert report.spent == ledger.spent("carol", PrivacyUnit.ETA_TOKEN) == 5.0 * len(prompt)
    assert result.text != PROMPT


def test_with_negligible_noise_every_token_is_released_unchanged(smollm2_vocabulary):
    text2text = Text2TextPerturber(smollm2_vocabulary, epsilon=1e7, generator=make_generator(2))
    assert text2text.perturb(PROMPT).text == PROMPT


def test_non_sensitive_tokens_are_kept_when_asked(smollm2_vocabulary):
    text2text = Text2TextPerturber(smollm2_vocabulary, epsilon=1.0, non_sensitive=NonSensitiveTokens.english(),
                                   generator=make_generator(3))
    report = text2text.perturb(PROMPT).report
    kept = [t for t in report.tokens if t.outcome is TokenOutcome.NON_SENSITIVE]
    assert {t.original.strip() for t in kept} >= {"at", "and", "for", "the", ",", "."}
    assert all(t.released_id == t.original_id for t in kept)
    assert report.accounting["privlm"] == 1.0 * report.n_perturbed


def test_a_seeded_generator_reproduces_the_release(smollm2_vocabulary):
    def run(seed: int) -> list[str]:
        text2text = Text2TextPerturber(smollm2_vocabulary, epsilon=20.0, generator=make_generator(seed))
        return [p.text for p in text2text.perturb_batch([PROMPT, "Call me at noon."])]

    assert run(3) == run(3) != run(4)


# --- bad input -----------------------------------------------------------------------------------

@pytest.mark.parametrize("value", BAD_POSITIVE_REALS)
def test_bad_levels_are_refused(line, value):
    with pytest.raises(ValueError, match="epsilon"):
        Text2TextPerturber(line, epsilon=value)
    with pytest.raises(ValueError, match="eta"):
        Text2TextMechanism(line, eta=value)


@pytest.mark.parametrize("texts", [[""], ["  "], []])
def test_empty_texts_are_refused(line, texts):
    with pytest.raises(ValueError, match="texts"):
        Text2TextPerturber(line, epsilon=1.0).perturb_batch(texts)


@pytest.mark.parametrize("x", [torch.tensor([0.5]), torch.tensor([VOCAB]), torch.tensor([-1]), [5]])
def test_bad_token_ids_are_refused(line, x):
    with pytest.raises(ValueError, match="x must"):
        Text2TextMechanism(line, eta=1.0).sample(x)


def test_inputs_of_different_shapes_are_refused(line):
    with pytest.raises(ValueError, match="same shape"):
        Text2TextMechanism(line, eta=1.0).privacy_bound(torch.tensor([5, 6]), torch.tensor([5]))
