"""The shared driver of the token-level baselines (SANTEXT, CUSTEXT, InferDPT, Text2Text).

A baseline says, per token, whether it is perturbed (``outcomes``) and how a perturbed token is
released (``release``: one draw per position, vectorised; by default a draw of its ``mechanism``). The driver
tokenizes with :func:`~privlm.models.prompts.tokenize_prompt`, charges the ledger before anything is drawn, and
builds the text and the report of :mod:`privlm.models.perturbation`. Every token gets an outcome;
none is dropped, and none is kept unless a rule says so and the report shows it. The ledger is charged for
a whole batch before anything is drawn, for every token that may go through the mechanism.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Self

import torch

from privlm.accounting import Ledger
from privlm.mechanisms import Mechanism, PrivacyUnit, make_generator
from privlm.models import check_texts
from privlm.models.language import LanguageModel
from privlm.models.perturbation import (
    NOTHING_SPENT,
    Accounting,
    PerturbedPrompt,
    PromptReport,
    TokenOutcome,
    charge_prompts,
    released_text,
    token_records,
)
from privlm.models.prompts import NonSensitiveTokens, PromptTokens, tokenize_prompt
from privlm.models.text_mechanisms import check_epsilon
from privlm.models.vocabulary import CandidateVocabulary


class TokenLevelBaseline:
    """Tokenize, choose outcomes, spend, release, report. Subclasses give ``outcomes`` and ``mechanism`` (a
    token-id mechanism whose outputs are candidate indices), or their own ``release``."""

    name: str = "token-level"
    unit: PrivacyUnit  # what the ledger counts: each subclass reads its mechanism class's unit
    guarantee: str = ""
    mechanism: Mechanism

    def __init__(self, vocabulary: CandidateVocabulary, *, epsilon: float,
                 non_sensitive: NonSensitiveTokens | None = None, generator: torch.Generator | None = None,
                 ledger: Ledger | None = None, principal: str = "local") -> None:
        self._vocabulary = vocabulary
        self.epsilon = check_epsilon(epsilon)
        self.non_sensitive = non_sensitive  # None: every token is perturbed
        self.generator = generator or make_generator(device=vocabulary.device)
        self.ledger, self.principal = ledger, principal

    @classmethod
    def check(cls, vocabulary: CandidateVocabulary, *, epsilon: float) -> None:
        """Refuse what the constructor, with its defaults, would refuse on ``vocabulary`` at ``epsilon``, building
        nothing (the registry's check)."""
        check_epsilon(epsilon)

    @classmethod
    def from_model(cls, model: LanguageModel, **options: Any) -> Self:
        """On the device model's candidate vocabulary (the same as Cape's)."""
        return cls(model.vocabulary, **options)

    @property
    def vocabulary(self) -> CandidateVocabulary:
        return self._vocabulary

    # --- what a subclass decides ---------------------------------------------------------------
    def outcomes(self, prompt: PromptTokens) -> list[TokenOutcome]:
        """Per token: PERTURBED (UNKNOWN for the tokenizer's unknown token), or NON_SENSITIVE when listed."""
        listed = prompt.non_sensitive if self.non_sensitive is not None else (False,) * len(prompt)
        return [TokenOutcome.UNKNOWN if unknown else TokenOutcome.NON_SENSITIVE if kept else TokenOutcome.PERTURBED
                for kept, unknown in zip(listed, prompt.unknown, strict=True)]

    def release(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Released token ids (n,) for input token ids (n,): one independent draw per position."""
        return self.vocabulary.candidate_ids[self.mechanism.sample(token_ids, generator=self.generator)]

    def per_token_cost(self) -> float:
        """What one perturbed token costs in the ledger, in ``unit``."""
        return self.epsilon

    def accounting(self, n_perturbed: int) -> dict[str, float]:
        """Per-prompt totals: the paper's and privlm's (equal unless a subclass says otherwise)."""
        total = self.per_token_cost() * n_perturbed
        return {Accounting.PAPER: total, Accounting.PRIVLM: total}

    # --- the driver ----------------------------------------------------------------------------
    def perturb(self, text: str) -> PerturbedPrompt:
        return self.perturb_batch([text])[0]

    def perturb_batch(self, texts: Sequence[str]) -> list[PerturbedPrompt]:
        """Charge the ledger for the whole batch first, then draw. A batch that would pass the budget is refused
        whole (BudgetExhaustedError: nothing charged, nothing drawn)."""
        check_texts(texts)
        prompts = [tokenize_prompt(self.vocabulary.tokenizer, text, self.non_sensitive) for text in texts]
        # The charge depends only on which tokens may go through the mechanism (a public, fixed rule),
        # never on a draw: a mechanism's own coins (SANTEXT+'s keep-or-resample) come after it.
        accountings = [self.accounting(len(self._chargeable(prompt))) for prompt in prompts]
        totals = [a[Accounting.PRIVLM] if self._chargeable(p) else 0.0
                  for a, p in zip(accountings, prompts, strict=True)]
        spent = charge_prompts(self.ledger, self.principal, self.unit, totals, note=self.name)
        return [self._perturb_one(prompt, accounting, charged)
                for prompt, accounting, charged in zip(prompts, accountings, spent, strict=True)]

    def _chargeable(self, prompt: PromptTokens) -> list[int]:
        """Positions that may go through the mechanism: every one the non-sensitive list does not keep."""
        listed = TokenLevelBaseline.outcomes(self, prompt)
        return [i for i, outcome in enumerate(listed) if outcome is not TokenOutcome.NON_SENSITIVE]

    def _perturb_one(self, prompt: PromptTokens, accounting: dict[str, float], spent: float | None) -> PerturbedPrompt:
        outcomes = self.outcomes(prompt)
        drawn = [i for i, o in enumerate(outcomes) if o in (TokenOutcome.PERTURBED, TokenOutcome.UNKNOWN)]
        released = list(prompt.ids)
        if drawn:
            ids = torch.tensor([prompt.ids[i] for i in drawn], dtype=torch.long, device=self.vocabulary.device)
            for i, token in zip(drawn, self.release(ids).tolist(), strict=True):
                released[i] = int(token)
        in_drawn = set(drawn)
        epsilon = [self.epsilon if i in in_drawn else None for i in range(len(prompt))]
        records = token_records(prompt, self.vocabulary, released, outcomes, epsilon=epsilon)
        report = PromptReport(mechanism=self.name, tokens=records, candidate_set_size=self.vocabulary.size,
                              accounting=accounting, guarantee=self.guarantee, uncovered=prompt.uncovered,
                              spent=spent, notes=() if self._chargeable(prompt) else (NOTHING_SPENT,))
        return PerturbedPrompt(text=released_text(self.vocabulary, released), report=report)
