"""What a token-level text mechanism returns: the released text and a report of every token.

Cape and the token-level baselines (SANTEXT, CUSTEXT, InferDPT, Text2Text) share this interface,
:class:`TextPerturber`, so one benchmark and one service can drive any of them. The report stays on
the client: it holds the original text of every token.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol, runtime_checkable

from privlm.accounting import Ledger, charge
from privlm.mechanisms import PrivacyUnit, Spend
from privlm.models.prompts import PromptTokens
from privlm.models.vocabulary import CandidateVocabulary


class Accounting(StrEnum):
    """The accountings a report prices its release under (its ``accounting`` keys)."""

    PRIVLM = "privlm"  # sound: what the ledger is charged, an epsilon-DP bound under the report's guarantee
    PAPER = "paper"  # the published method's own total, where it has one (Cape: eps + eps' per token)
    TRANSCRIPT = "transcript"  # DP-Prompt: what the tokens actually generated cost, at most the privlm total


class TokenOutcome(StrEnum):
    """What happened to one token."""

    PERTURBED = "perturbed"  # released by the mechanism (the release may equal the original)
    NON_SENSITIVE = "non-sensitive"  # in the non-sensitive list: released unchanged, costs nothing
    UNKNOWN = "unknown"  # the tokenizer's unknown token: perturbed from the unknown token's row
    KEPT = "kept"  # released unchanged by the mechanism's own rule (SANTEXT+: a frequent word kept)
    REWRITTEN = "rewritten"  # the whole prompt was rewritten (DP-Prompt's paraphrase): no released token of its own


@dataclass(frozen=True, kw_only=True)
class TokenRecord:
    """One token of a prompt and its release."""

    position: int
    original: str  # the prompt's text of this token (its character span)
    original_id: int
    released: str  # the released token's own text ("" when rewritten)
    released_id: int  # -1 when rewritten
    outcome: TokenOutcome
    epsilon: float | None = None  # the mechanism's epsilon for this token (None when not perturbed)
    eps_prime: float | None = None  # Cape: the paper's realised eps' = ln(max_b |b| / min_b |b|)
    non_empty_buckets: int | None = None  # Cape: K, the number of non-empty buckets
    chunk: int = 0  # which chunk of a long prompt the token was processed in

    @property
    def changed(self) -> bool:
        return self.released_id != self.original_id


@dataclass(frozen=True, kw_only=True)
class PromptReport:
    """Per token and per prompt: what was released, and what it cost under each accounting."""

    mechanism: str
    tokens: tuple[TokenRecord, ...]
    candidate_set_size: int
    accounting: Mapping[str, float]  # per-prompt totals, by accounting (:class:`Accounting`)
    guarantee: str  # the neighbouring relation and the meaning of the privlm total, in one sentence
    chunks: int = 1
    uncovered: tuple[tuple[int, int], ...] = ()  # character spans no token covers (not released)
    spent: float | None = None  # what the ledger was charged (None: no ledger)
    notes: tuple[str, ...] = field(default=())

    def count(self, outcome: TokenOutcome) -> int:
        return sum(1 for t in self.tokens if t.outcome is outcome)

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    @property
    def n_perturbed(self) -> int:
        """Tokens that went through the mechanism (unknown and rewritten tokens included)."""
        return sum(self.count(o) for o in (TokenOutcome.PERTURBED, TokenOutcome.UNKNOWN, TokenOutcome.REWRITTEN))

    @property
    def n_changed(self) -> int:
        return sum(1 for t in self.tokens if t.changed)

    @property
    def n_unchanged(self) -> int:
        """Tokens that went through the mechanism and were released as themselves (it may draw the original)."""
        return sum(1 for t in self.tokens
                   if t.outcome in (TokenOutcome.PERTURBED, TokenOutcome.UNKNOWN) and not t.changed)


@dataclass(frozen=True)
class PerturbedPrompt:
    """The text to send, and the report to keep."""

    text: str
    report: PromptReport


@runtime_checkable
class TextPerturber(Protocol):
    """A token-level text mechanism: ``perturb`` one prompt, ``perturb_batch`` many (same order). ``unit``: what
    its ledger charges count (each report's ``accounting`` is its own price of the release, in that unit)."""

    name: str
    unit: PrivacyUnit

    @property
    def vocabulary(self) -> CandidateVocabulary: ...

    def perturb(self, text: str) -> PerturbedPrompt: ...

    def perturb_batch(self, texts: Sequence[str]) -> list[PerturbedPrompt]: ...


@runtime_checkable
class SharedPreparation(Protocol):
    """A :class:`TextPerturber` whose work that depends neither on epsilon nor on the draw (Cape: the forward passes
    and distances) may be done once for the texts of several requests, then released request by request.

    ``preparation_key(scope)``: perturbers whose keys are equal may share one preparation; ``scope`` identifies the
    request (its principal and epsilon), for a perturber whose preparation of a text depends on the others sharing
    it; None: this perturber never shares. ``prepare(texts)`` neither charges nor draws; ``release(prepared)``
    charges and draws as ``perturb_batch`` of the same texts would."""

    def preparation_key(self, scope: Hashable) -> Hashable | None: ...

    def prepare(self, texts: Sequence[str]) -> Sequence[object]: ...

    def release(self, prepared: Sequence[Any]) -> list[PerturbedPrompt]: ...


def perturb_one(perturber: TextPerturber, text: str) -> PerturbedPrompt:
    """One prompt through ``perturber``'s batch path; a non-string or blank text is refused first."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError("text must be a non-empty, non-blank string")
    return perturber.perturb_batch([text])[0]


def charge_prompts(ledger: Ledger | None, principal: str, unit: PrivacyUnit, totals: Sequence[float], *,
                   note: str) -> list[float | None]:
    """Charge every prompt's total (its report's "privlm" accounting) in one ledger transaction, before anything is
    drawn: all, or none (BudgetExhaustedError). Per prompt, what its report's ``spent`` says (None: nothing)."""
    charged = bool(charge(ledger, principal, [Spend(unit, total) for total in totals], note=note))
    return [total if charged and total > 0 else None for total in totals]


NOTHING_SPENT = "every token is non-sensitive: nothing was perturbed and nothing was spent"


def released_text(vocabulary: CandidateVocabulary, ids: Sequence[int]) -> str:
    """The tokenizer's decoding of the released ids (lossless for byte-level BPE)."""
    return str(vocabulary.tokenizer.decode(list(ids), clean_up_tokenization_spaces=False))


def token_records(prompt: PromptTokens, vocabulary: CandidateVocabulary, released_ids: Sequence[int],
                  outcomes: Sequence[TokenOutcome], *, epsilon: Sequence[float | None] | None = None,
                  eps_prime: Sequence[float | None] | None = None,
                  non_empty_buckets: Sequence[int | None] | None = None,
                  chunks: Sequence[int] | None = None) -> tuple[TokenRecord, ...]:
    """One record per token of ``prompt``; optional columns default to None (chunk 0)."""
    n = len(prompt)
    if not (len(released_ids) == len(outcomes) == n):
        raise ValueError(f"need one released id and one outcome per token ({n}), got {len(released_ids)} "
                         f"and {len(outcomes)}")
    known = iter(vocabulary.token_texts([i for i in released_ids if i >= 0]))
    texts = [next(known) if i >= 0 else "" for i in released_ids]  # -1: rewritten, no token of its own
    def column(values: Sequence[object] | None, i: int) -> object:
        return None if values is None else values[i]
    records = []
    for i in range(n):
        eps = column(epsilon, i)
        if eps is not None and not (isinstance(eps, float | int) and math.isfinite(eps)):
            raise ValueError(f"epsilon of token {i} must be finite, got {eps!r}")
        records.append(TokenRecord(
            position=i, original=prompt.piece(i), original_id=prompt.ids[i], released=texts[i],
            released_id=int(released_ids[i]), outcome=outcomes[i], epsilon=None if eps is None else float(eps),
            eps_prime=column(eps_prime, i), non_empty_buckets=column(non_empty_buckets, i),  # type: ignore[arg-type]
            chunk=0 if chunks is None else int(chunks[i])))
    return tuple(records)
