"""The driver every token-level baseline shares: outcomes, the ledger first, the report."""

from __future__ import annotations

import pytest
import torch
from transformers import BertTokenizerFast

from privlm.accounting import BudgetExhaustedError, Ledger
from privlm.baselines.token_level import TokenLevelBaseline
from privlm.mechanisms import PrivacyUnit
from privlm.models.perturbation import NOTHING_SPENT, TextPerturber, TokenOutcome
from privlm.models.prompts import NonSensitiveTokens
from privlm.models.vocabulary import CandidateVocabulary
from tests.models.tiny import WORDS


class ToDog(TokenLevelBaseline):
    """Releases "dog" for every perturbed token: a deterministic stand-in to test the driver."""

    name = "to-dog"
    unit = PrivacyUnit.EPSILON  # a test double: no mechanism to read it from
    guarantee = "none: a test double"

    def release(self, token_ids: torch.Tensor) -> torch.Tensor:
        self.calls.append(token_ids.tolist())
        return torch.full_like(token_ids, WORDS.index("dog"))


@pytest.fixture
def vocabulary() -> CandidateVocabulary:
    tokenizer = BertTokenizerFast(vocab={w: i for i, w in enumerate(WORDS)})
    return CandidateVocabulary.from_tokenizer(tokenizer, torch.eye(len(WORDS)))


def make(vocabulary: CandidateVocabulary, **options: object) -> ToDog:
    baseline = ToDog(vocabulary, epsilon=2.0, **options)  # type: ignore[arg-type]
    baseline.calls = []  # type: ignore[attr-defined]
    return baseline


def test_every_token_gets_an_outcome_and_none_is_dropped(vocabulary):
    baseline = make(vocabulary, non_sensitive=NonSensitiveTokens.english())
    assert isinstance(baseline, TextPerturber)
    result = baseline.perturb("the cat sat on zebra .")
    report = result.report
    outcomes = [t.outcome for t in report.tokens]
    assert outcomes == [TokenOutcome.NON_SENSITIVE, TokenOutcome.PERTURBED, TokenOutcome.PERTURBED,
                        TokenOutcome.NON_SENSITIVE, TokenOutcome.UNKNOWN, TokenOutcome.NON_SENSITIVE]
    assert result.text == "the dog dog on dog."  # WordPiece decoding joins punctuation
    assert report.n_perturbed == 3 and report.accounting == {"paper": 6.0, "privlm": 6.0}
    assert [t.epsilon for t in report.tokens] == [None, 2.0, 2.0, None, 2.0, None]
    assert baseline.calls == [[WORDS.index("cat"), WORDS.index("sat"), 1]]  # [UNK] is perturbed too


def test_without_a_list_every_token_is_perturbed(vocabulary):
    report = make(vocabulary).perturb("the cat .").report
    assert {t.outcome for t in report.tokens} == {TokenOutcome.PERTURBED}


def test_only_non_sensitive_tokens_spend_nothing_and_say_so(vocabulary, tmp_path):
    ledger = Ledger(tmp_path / "ledger.db", budgets={PrivacyUnit.EPSILON: 10.0})
    baseline = make(vocabulary, non_sensitive=NonSensitiveTokens.english(), ledger=ledger, principal="alice")
    result = baseline.perturb("the , on")
    assert result.text == "the, on"
    assert result.report.notes == (NOTHING_SPENT,) and result.report.spent is None
    assert ledger.spent("alice", PrivacyUnit.EPSILON) == 0 and baseline.calls == []


def test_the_ledger_is_charged_before_the_release_and_a_refusal_releases_nothing(vocabulary, tmp_path):
    ledger = Ledger(tmp_path / "ledger.db", budgets={PrivacyUnit.EPSILON: 5.0})
    baseline = make(vocabulary, ledger=ledger, principal="alice")
    assert baseline.perturb("cat sat").report.spent == 4.0
    with pytest.raises(BudgetExhaustedError):
        baseline.perturb("cat")
    assert ledger.spent("alice", PrivacyUnit.EPSILON) == 4.0 and len(baseline.calls) == 1


@pytest.mark.parametrize("texts", [[], [""], ["   "], "cat", [3]])
def test_bad_texts_are_refused(vocabulary, texts):
    with pytest.raises(ValueError):
        make(vocabulary).perturb_batch(texts)


@pytest.mark.parametrize("epsilon", [0, -1.0, float("nan"), float("inf")])
def test_bad_epsilons_are_refused(vocabulary, epsilon):
    with pytest.raises(ValueError, match="epsilon"):
        ToDog(vocabulary, epsilon=epsilon)
