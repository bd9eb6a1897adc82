"""SANTEXT and SANTEXT+: exact laws, their claims, sampling, the auditor, the report, and public frequencies."""

import math
import sys

import numpy as np
import pytest
import torch
from scipy import stats

from privlm.accounting import Ledger
from privlm.attacks import audit_mechanism
from privlm.baselines.frequency import (
    frequency_source,
    least_frequent,
    least_frequent_mask,
    token_frequencies,
    word_frequencies,
)
from privlm.baselines.santext import SanText, SanTextMechanism, SanTextPlus, SanTextPlusMechanism
from privlm.mechanisms import DiscreteMechanism, PrivacyUnit, exact_privacy_loss, make_generator
from privlm.models.language import LanguageModel
from privlm.models.perturbation import TokenOutcome
from privlm.models.vocabulary import CandidateVocabulary
from tests.conftest import BAD_POSITIVE_REALS, P_THRESHOLD, assert_draws_follow

TEXT = "My neighbour Alice Smith paid 1984 dollars for the blue car in Boston last week."


# --- shared with test_inferdpt.py --------------------------------------------------------------
@pytest.fixture(scope="session")
def vocabulary(smollm2_lm: LanguageModel) -> CandidateVocabulary:
    return smollm2_lm.vocabulary


def token(vocabulary: CandidateVocabulary, word: str) -> torch.Tensor:
    """The 0-d id of a word that is one token (checked)."""
    ids = vocabulary.tokenizer(word, add_special_tokens=False)["input_ids"]
    assert len(ids) == 1, f"{word!r} is {len(ids)} tokens"
    return torch.tensor(ids[0])


def line_vocabulary(points: list[float]) -> CandidateVocabulary:
    """A constructed vocabulary of 1-D embedding rows; every id is a candidate (no tokenizer needed)."""
    rows = torch.tensor(points, dtype=torch.float32)[:, None]
    return CandidateVocabulary(tokenizer=None, embeddings=rows, candidate_ids=torch.arange(len(points)))  # type: ignore[arg-type]


def chi_square_cells(probabilities: torch.Tensor, n: int, min_expected: float = 5.0) -> np.ndarray:
    """A cell per output, fixed before drawing: outputs in order of probability, each cell closed once it is
    expected ``min_expected`` times in ``n`` draws (a likely output is a cell of its own)."""
    p = probabilities.double().flatten().numpy()
    cell, current, filled = np.empty(p.size, dtype=np.int64), 0, 0.0
    for i in np.argsort(-p, kind="stable"):
        cell[i], filled = current, filled + p[i] * n
        if filled >= min_expected:
            current, filled = current + 1, 0.0
    if current > 0 and (cell == current).any():  # the unfinished last cell (impossible outputs too) joins its neighbour
        cell[cell == current] = current - 1
    return cell


def assert_pooled_draws_follow(draws: torch.Tensor, probabilities: torch.Tensor) -> None:
    """Chi-square at the project's threshold on :func:`chi_square_cells`.

    Pearson's statistic is chi-square distributed only when expected counts are not tiny; pooling keeps the
    test valid on a 49,135-output law where most outputs are rare.
    """
    assert (probabilities.flatten()[draws.flatten()] > 0).all(), "an impossible output was drawn"
    cell = chi_square_cells(probabilities, draws.numel())
    expected = np.bincount(cell, weights=probabilities.double().flatten().numpy())
    assert expected.size >= min(10, probabilities.numel()), "too few cells for a meaningful test"
    assert_draws_follow(torch.from_numpy(cell)[draws.flatten()], torch.from_numpy(expected / expected.sum()))


# --- public word frequencies -------------------------------------------------------------------
def test_frequency_table_comes_from_wordfreq_and_is_cached(vocabulary):
    table = token_frequencies(vocabulary)
    assert table.shape == (vocabulary.size,) and table.dtype == torch.float64
    assert token_frequencies(vocabulary) is table  # built once per process
    words = {w: float(table[vocabulary.candidate_index[token(vocabulary, w)]]) for w in (" the", " cat", "ivid")}
    source = frequency_source()
    assert words[" the"] == source("the") > words[" cat"] == source("cat") > 0
    assert words["ivid"] == 0  # a word piece wordfreq does not know: frequency 0, least frequent
    sensitive = least_frequent(vocabulary, 0.9)
    assert int(sensitive.sum()) == math.ceil(0.9 * vocabulary.size)
    assert not sensitive[vocabulary.candidate_index[token(vocabulary, " the")]]
    assert sensitive[vocabulary.candidate_index[token(vocabulary, "ivid")]]


def test_least_frequent_breaks_ties_by_token_id():
    frequencies = torch.tensor([0.5, 0.0, 0.2, 0.0, 0.0, 0.1], dtype=torch.float64)
    assert least_frequent_mask(frequencies, 0.5).tolist() == [False, True, False, True, True, False]
    assert least_frequent_mask(frequencies, 0.3).tolist() == [False, True, False, True, False, False]
    assert least_frequent_mask(frequencies, 1.0).all()
    assert word_frequencies(["  the ", "", "\n"]).tolist()[1:] == [0.0, 0.0]


def test_missing_wordfreq_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "wordfreq", None)  # import wordfreq now raises ImportError
    with pytest.raises(ModuleNotFoundError, match="wordfreq"):
        frequency_source()


# --- SANTEXT: the exact law and its claim ------------------------------------------------------
def test_santext_probabilities_are_the_formula():
    vocabulary = line_vocabulary([0.0, 1.0, 3.0, 3.5])
    eps = 1.3
    log_p = SanTextMechanism(vocabulary, eps).log_probabilities(torch.tensor([1, 3]))
    for row, x in zip(log_p, (1.0, 3.5), strict=True):
        weights = np.exp(-eps * np.abs(np.array([0.0, 1.0, 3.0, 3.5]) - x) / 2)
        np.testing.assert_allclose(row.exp().numpy(), weights / weights.sum(), rtol=1e-6)


def test_santext_exact_loss_is_within_the_claim_and_nearly_attains_it():
    """Outputs beyond x' as seen from x: every ratio d(x, y) - d(x', y) equals d(x, x'), so eps d is attained."""
    eps = 2.0
    vocabulary = line_vocabulary([0.0, 1.0] + [3.0] * 2000)
    mechanism = SanTextMechanism(vocabulary, eps)
    x, x_prime = torch.tensor(0), torch.tensor(1)
    loss = exact_privacy_loss(mechanism.log_probabilities(x), mechanism.log_probabilities(x_prime)).item()
    claim = mechanism.privacy_bound(x, x_prime)
    assert claim == pytest.approx(eps * 1.0)
    assert 0.97 * claim <= loss <= claim * (1 + 1e-9)


def test_santext_exact_loss_is_within_the_claim_on_real_tokens(vocabulary, generator):
    eps = 3.0
    mechanism = SanTextMechanism(vocabulary, eps)
    x = vocabulary.candidate_ids[torch.randint(vocabulary.size, (24,), generator=generator)]
    x_prime = vocabulary.candidate_ids[torch.randint(vocabulary.size, (24,), generator=generator)]
    loss = exact_privacy_loss(mechanism.log_probabilities(x), mechanism.log_probabilities(x_prime))
    claim = torch.tensor([mechanism.privacy_bound(a, b) for a, b in zip(x, x_prime, strict=True)], dtype=torch.float64)
    # The distance rows come from a float32 matrix product: allow its rounding (1e-5 of a distance).
    assert (loss <= claim * (1 + 1e-5) + 1e-6).all()
    assert mechanism.privacy_bound(x, x_prime) == pytest.approx(float(claim.sum()))


def test_santext_draws_follow_the_exact_law(vocabulary, generator):
    mechanism = SanTextMechanism(vocabulary, 6.0)
    x = torch.stack([token(vocabulary, " cat"), token(vocabulary, "1")])
    draws = mechanism.sample(x, num_samples=30_000, generator=generator)
    assert draws.shape == (30_000, 2) and draws.dtype == torch.long
    probabilities = mechanism.log_probabilities(x).exp()
    for column in range(2):
        assert_pooled_draws_follow(draws[:, column], probabilities[column])
    assert mechanism.sample(x[0], generator=generator).shape == ()


def test_santext_audit_stays_within_the_claim(vocabulary):
    mechanism = SanTextMechanism(vocabulary, 4.0)
    assert isinstance(mechanism, DiscreteMechanism)
    x, x_prime = token(vocabulary, " cat"), token(vocabulary, " dog")
    result = audit_mechanism(mechanism, x, x_prime, n_samples=20_000, generator=make_generator(11))
    assert result.claimed_epsilon == pytest.approx(4.0 * float((vocabulary.rows_of(x) - vocabulary.rows_of(x_prime))
                                                                .double().norm()))
    assert result.exact_epsilon <= result.claimed_epsilon
    assert result.eps_lower <= result.claimed_epsilon


def test_santext_spends_eps_per_token_in_eta_token_units(vocabulary):
    mechanism = SanTextMechanism(vocabulary, 2.5)
    spend = mechanism.spend(torch.tensor([5, 6, 7]))
    assert spend.unit is PrivacyUnit.ETA_TOKEN and spend.amount == pytest.approx(7.5)


# --- SANTEXT+: the exact law and its claim -----------------------------------------------------
@pytest.fixture(scope="module")
def plus(vocabulary) -> SanTextPlusMechanism:
    return SanTextPlusMechanism.from_frequencies(vocabulary, 3.0, w=0.9, p=0.3)


def test_santext_plus_law_keeps_frequent_tokens_and_outputs_only_sensitive_ones(vocabulary, plus):
    frequent, rare = token(vocabulary, " the"), token(vocabulary, "ivid")
    assert not plus.is_sensitive(frequent) and plus.is_sensitive(rare)
    log_p = plus.log_probabilities(torch.stack([frequent, rare]))
    p = log_p.exp()
    torch.testing.assert_close(p.sum(dim=-1), torch.ones(2, dtype=torch.float64))
    assert p[0, vocabulary.candidate_index[frequent]].item() == pytest.approx(1 - 0.3)  # kept: the only way out
    restricted = plus.restricted_log_probabilities(frequent).exp()
    others = torch.ones(vocabulary.size, dtype=torch.bool)
    others[vocabulary.candidate_index[frequent]] = False
    torch.testing.assert_close(p[0, others], 0.3 * restricted[others])
    assert (p[:, ~plus.sensitive & others] == 0).all()  # outputs are sensitive (or the kept input itself)
    # The sensitive input's law is SANTEXT's restricted to S.
    santext = SanTextMechanism(vocabulary, 3.0).log_probabilities(rare)
    expected = torch.where(plus.sensitive, santext, -math.inf)
    torch.testing.assert_close(log_p[1], expected - torch.logsumexp(expected, dim=-1))


def test_santext_plus_claim_holds_between_sensitive_tokens_and_fails_for_frequent_ones(vocabulary, plus):
    a, b = token(vocabulary, "ivid"), token(vocabulary, " authent")
    assert plus.is_sensitive(a) and plus.is_sensitive(b)
    loss = exact_privacy_loss(plus.log_probabilities(a), plus.log_probabilities(b)).item()
    assert 0 < loss <= plus.privacy_bound(a, b) * (1 + 1e-5)
    frequent = token(vocabulary, " the")
    # A kept frequent token is an output no other input produces: no DP guarantee at all.
    assert exact_privacy_loss(plus.log_probabilities(frequent), plus.log_probabilities(a)).item() == math.inf
    with pytest.raises(ValueError, match="no DP guarantee"):
        plus.privacy_bound(frequent, a)
    assert plus.privacy_bound(torch.stack([frequent, a]), torch.stack([frequent, b])) == pytest.approx(
        plus.privacy_bound(a, b))


def test_santext_plus_draws_follow_the_exact_law(vocabulary, plus, generator):
    x = torch.stack([token(vocabulary, " the"), token(vocabulary, "ivid")])
    draws = plus.sample(x, num_samples=30_000, generator=generator)
    probabilities = plus.log_probabilities(x).exp()
    for column in range(2):
        assert_pooled_draws_follow(draws[:, column], probabilities[column])


def test_santext_plus_audit_stays_within_the_claim_between_sensitive_tokens(vocabulary, plus):
    a, b = token(vocabulary, "ivid"), token(vocabulary, " authent")
    result = audit_mechanism(plus, a, b, n_samples=20_000, generator=make_generator(12))
    assert result.claimed_epsilon == pytest.approx(plus.privacy_bound(a, b))
    assert result.eps_lower <= result.claimed_epsilon


def test_santext_plus_extremes_of_p_and_w(vocabulary, generator):
    frequent = token(vocabulary, " the")
    own = vocabulary.candidate_index[frequent]
    never = SanTextPlusMechanism.from_frequencies(vocabulary, 3.0, p=0.0)
    assert (never.sample(frequent, num_samples=50, generator=generator) == own).all()
    always = SanTextPlusMechanism.from_frequencies(vocabulary, 3.0, p=1.0)
    assert not always.draw_kept(frequent, num_samples=200, generator=generator).any()
    everything = SanTextPlusMechanism.from_frequencies(vocabulary, 3.0, w=1.0)
    assert everything.is_sensitive(vocabulary.candidate_ids).all()


# --- the perturbers and their report -----------------------------------------------------------
def test_santext_report_covers_every_token_and_perturbs_numbers(smollm2_lm, vocabulary, tmp_path):
    ledger = Ledger(tmp_path / "ledger.db", budgets={PrivacyUnit.ETA_TOKEN: 1e6})
    santext = SanText.from_model(smollm2_lm, epsilon=2.0, generator=make_generator(1), ledger=ledger)
    assert santext.name == "santext" and santext.vocabulary is vocabulary
    out = santext.perturb(TEXT)
    report = out.report
    ids = vocabulary.tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    assert [t.original_id for t in report.tokens] == ids  # nothing dropped
    assert all(t.outcome is TokenOutcome.PERTURBED for t in report.tokens)  # no stopword list, numbers too
    assert report.n_perturbed == len(ids) and report.candidate_set_size == vocabulary.size
    assert report.accounting == {"paper": 2.0 * len(ids), "privlm": 2.0 * len(ids)}
    assert ledger.spent("local", PrivacyUnit.ETA_TOKEN) == pytest.approx(2.0 * len(ids)) == report.spent
    assert out.text == vocabulary.tokenizer.decode([t.released_id for t in report.tokens])
    assert all(vocabulary.candidate_index[t.released_id] >= 0 for t in report.tokens)
    assert report.n_changed > 0


def test_santext_plus_report_counts_kept_tokens(vocabulary):
    texts = ["the cat and the dog were in the house, and then they went to the park with all of their friends"] * 25
    perturber = SanTextPlus(vocabulary, epsilon=2.0, p=0.3, generator=make_generator(2))
    reports = [out.report for out in perturber.perturb_batch(texts)]
    ids = torch.tensor(vocabulary.tokenizer(texts[0], add_special_tokens=False)["input_ids"])
    frequent = ~perturber.mechanism.is_sensitive(ids)
    assert frequent.sum() >= 10
    kept = 0
    for report in reports:
        assert report.n_tokens == len(ids)
        assert report.count(TokenOutcome.KEPT) + report.n_perturbed == report.n_tokens
        for record, is_frequent in zip(report.tokens, frequent.tolist(), strict=True):
            if record.outcome is TokenOutcome.KEPT:
                assert is_frequent and record.released_id == record.original_id and record.epsilon is None
            else:
                assert perturber.mechanism.is_sensitive(torch.tensor(record.released_id))  # outputs lie in S
        # Charged before the coins: eps for every token, whatever the coins then keep.
        assert report.accounting["privlm"] == pytest.approx(2.0 * report.n_tokens)
        kept += report.count(TokenOutcome.KEPT)
    # Each frequent token is kept with probability 1 - p, independently.
    trials = int(frequent.sum()) * len(texts)
    assert stats.binomtest(kept, trials, 1 - 0.3).pvalue > P_THRESHOLD


def test_seeded_generators_reproduce_and_different_seeds_differ(vocabulary):
    for make in (lambda g: SanText(vocabulary, epsilon=1.0, generator=g),
                 lambda g: SanTextPlus(vocabulary, epsilon=1.0, generator=g)):
        first, second = make(make_generator(5)).perturb(TEXT), make(make_generator(5)).perturb(TEXT)
        assert first == second
        assert make(make_generator(6)).perturb(TEXT).text != first.text


@pytest.mark.parametrize("epsilon", BAD_POSITIVE_REALS)
def test_bad_epsilon_is_refused(vocabulary, epsilon):
    with pytest.raises(ValueError, match="epsilon"):
        SanText(vocabulary, epsilon=epsilon)
    with pytest.raises(ValueError, match="epsilon"):
        SanTextPlus(vocabulary, epsilon=epsilon)
    with pytest.raises(ValueError, match="epsilon"):
        SanTextMechanism(vocabulary, epsilon)


@pytest.mark.parametrize("w", [0, 0.0, -0.1, 1.01, float("nan"), float("inf"), "0.5", None])
def test_bad_w_is_refused(vocabulary, w):
    with pytest.raises(ValueError, match="w"):
        SanTextPlus(vocabulary, epsilon=1.0, w=w)


@pytest.mark.parametrize("p", [-0.1, 1.01, float("nan"), float("inf"), "0.3", None])
def test_bad_p_is_refused(vocabulary, p):
    with pytest.raises(ValueError, match="p"):
        SanTextPlus(vocabulary, epsilon=1.0, p=p)


def test_bad_texts_and_token_ids_are_refused(vocabulary):
    santext = SanText(vocabulary, epsilon=1.0)
    for texts in ([""], ["   "], []):
        with pytest.raises(ValueError, match="texts"):
            santext.perturb_batch(texts)
    mechanism = santext.mechanism
    for x in (torch.tensor([1.0]), torch.tensor([[1, 2]]), torch.tensor([], dtype=torch.long),
              torch.tensor([-1]), torch.tensor([vocabulary.embeddings.shape[0]]), [1, 2]):
        with pytest.raises(ValueError, match="x"):
            mechanism.log_probabilities(x)
    for num_samples in (0, -1, 2.0):
        with pytest.raises(ValueError, match="num_samples"):
            mechanism.sample(torch.tensor(5), num_samples=num_samples)
    with pytest.raises(ValueError, match="sensitive"):
        SanTextPlusMechanism(vocabulary, 1.0, torch.zeros(vocabulary.size, dtype=torch.bool))
