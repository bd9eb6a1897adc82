"""The privacy step of a chat gateway, without HTTP: texts in, perturbed texts and their report out.

Each call builds a fresh perturber (:data:`PerturberFactory`) with a fresh OS-seeded generator, charging the
caller's principal: nothing random and nothing about the caller outlives the call, so concurrent callers
share no state but the read-only device model and the ledger. The perturber charges the ledger the whole
call's sound total, in one transaction, before it draws anything (``Ledger.spend_all``): a call that would
pass the budget is refused whole (``BudgetExhaustedError``) and releases nothing.

It fails closed: if perturbing fails for any reason, :meth:`PromptPrivacy.privatize` raises
:class:`PrivacyStepError`, whose message names the kind of failure and never the text; the caller must not
forward anything.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from privlm._validation import check_positive_int
from privlm.accounting import BudgetExhaustedError, Ledger
from privlm.cape.calibration import LogitBound
from privlm.mechanisms import PrivacyUnit, Spend, make_generator
from privlm.models.device import resolve_device
from privlm.models.language import LanguageModel
from privlm.models.perturbation import PromptReport, TextPerturber
from privlm.models.text_mechanisms import CalibratedBound, MechanismContext, check_epsilon, text_mechanism
from privlm.service import ServiceError

PerturberFactory = Callable[[float, torch.Generator, Ledger | None, str], TextPerturber]
"""``(epsilon, generator, ledger, principal)`` -> a fresh perturber that charges ``ledger`` under ``principal``."""

PRIVLM = "privlm"  # the sound accounting's key in a report
PAPER = "paper"
MAX_PROMPT_TOKENS = 8192


class PrivacyStepError(ServiceError):
    """Perturbation failed: nothing may be forwarded. The message names the failure's type, never the text."""

    def __init__(self, error: BaseException, *, charged: bool = False) -> None:
        # With a ledger the mechanism may have charged before it failed, and the charge stands (it cannot tell
        # what it drew): a retry would be charged again, so OpenAI's SDKs are told not to.
        super().__init__(500, f"the privacy step failed ({type(error).__name__}); nothing was sent upstream",
                         type="server_error", code="privacy_step_failed",
                         headers={"x-should-retry": "false"} if charged else None)


@dataclass(frozen=True)
class PrivateTexts:
    """The released texts, in order, and what they cost. A blank text is released as it is (no report)."""

    texts: list[str]
    reports: list[PromptReport | None]
    mechanism: str
    epsilon: float
    unit: PrivacyUnit
    budget_remaining: float | None
    seconds: float = 0.0  # the privacy step's own time: the charge, the perturbation and the checks

    @property
    def spent(self) -> float:
        """The sound total of the call (privlm's accounting): what the ledger was charged."""
        return sum(r.accounting.get(PRIVLM, 0.0) for r in self.reports if r is not None)

    @property
    def paper_total(self) -> float | None:
        """The paper's own total, where the mechanism reports one (Cape: eps + eps' per token)."""
        values = [r.accounting[PAPER] for r in self.reports if r is not None and PAPER in r.accounting]
        return sum(values) if values else None

    @property
    def tokens(self) -> int:
        return sum(r.n_tokens for r in self.reports if r is not None)

    @property
    def tokens_perturbed(self) -> int:
        return sum(r.n_perturbed for r in self.reports if r is not None)

    @property
    def tokens_changed(self) -> int:
        return sum(r.n_changed for r in self.reports if r is not None)

    @property
    def tokens_unchanged(self) -> int:
        """Perturbed tokens released as themselves: sensitive words that crossed as they were."""
        return sum(r.n_unchanged for r in self.reports if r is not None)


def token_counter(device_model: LanguageModel) -> Callable[[str], int]:
    """A text's token count on ``device_model``'s tokenizer, as the mechanisms tokenize it (no special tokens)."""
    tokenizer = device_model.tokenizer
    return lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])


class PromptPrivacy:
    """Perturb texts at ``epsilon`` per token (the most a request may ask for; it may ask for less).

    ``factory`` builds the mechanism per call; ``mechanism`` is its name for reports; ``count_tokens`` counts
    a text's tokens on the mechanism's tokenizer (a text over ``max_prompt_tokens`` in all is refused before
    any work); ``ledger``: per-principal budgets in ``unit`` (None: unlimited, nothing recorded).
    """

    def __init__(self, factory: PerturberFactory, *, mechanism: str, epsilon: float,
                 count_tokens: Callable[[str], int], ledger: Ledger | None = None,
                 unit: PrivacyUnit = PrivacyUnit.EPSILON, max_prompt_tokens: int = MAX_PROMPT_TOKENS,
                 device: torch.device | str = "auto") -> None:
        self.factory, self.mechanism = factory, mechanism
        self.epsilon = check_epsilon(epsilon)
        self.count_tokens, self.ledger, self.unit = count_tokens, ledger, unit
        self.max_prompt_tokens = check_positive_int("max_prompt_tokens", max_prompt_tokens)
        self.device = resolve_device(device)  # the generators': where the mechanism draws
        if ledger is not None:
            ledger.budget(unit)  # a ledger without a budget in this unit is refused now, not on the first request

    @classmethod
    def of(cls, mechanism: str, device_model: LanguageModel, *, epsilon: float,
           logit_bound: CalibratedBound | float | None, ledger: Ledger | None = None,
           max_prompt_tokens: int = MAX_PROMPT_TOKENS) -> PromptPrivacy:
        """The mechanism the registry (:mod:`privlm.models.text_mechanisms`) names ``mechanism``, on
        ``device_model`` with Cape's logit bound B; ``ledger`` must budget the unit it registered. It is built
        once now (a bad epsilon, or a bound calibrated on another model, fails here), then afresh for every call."""
        chosen = text_mechanism(mechanism)
        context = MechanismContext(device_model=device_model, logit_bound=logit_bound)

        def build(eps: float, generator: torch.Generator, ledger_: Ledger | None, principal: str) -> TextPerturber:
            return chosen.build(context, epsilon=eps, generator=generator, ledger=ledger_, principal=principal)

        build(epsilon, make_generator(device=device_model.device), None, "local")
        return cls(build, mechanism=chosen.name, epsilon=epsilon, count_tokens=token_counter(device_model),
                   ledger=ledger, unit=chosen.unit, max_prompt_tokens=max_prompt_tokens, device=device_model.device)

    @classmethod
    def cape(cls, device_model: LanguageModel, *, epsilon: float, logit_bound: float | LogitBound | None,
             ledger: Ledger | None = None, max_prompt_tokens: int = MAX_PROMPT_TOKENS) -> PromptPrivacy:
        """Cape on ``device_model`` with its logit bound B (a :class:`LogitBound` of this model, or a number)."""
        return cls.of("cape", device_model, epsilon=epsilon, logit_bound=logit_bound, ledger=ledger,
                      max_prompt_tokens=max_prompt_tokens)

    def resolve_epsilon(self, requested: float | None, *, param: str = "privlm.epsilon") -> float:
        """The epsilon of one request: the configured one, or a lower one it asks for (a higher one is refused)."""
        if requested is None:
            return self.epsilon
        try:
            requested = check_epsilon(requested, name=param)  # as a 400 here
        except ValueError:
            raise ServiceError(400, f"{param} must be a finite number > 0", param=param,
                               code="invalid_epsilon") from None
        if requested > self.epsilon:
            raise ServiceError(400, f"{param} may lower epsilon, never raise it: this gateway allows at most "
                                    f"{self.epsilon:g} per token", param=param, code="epsilon_above_limit")
        return float(requested)

    def check_lengths(self, texts: Sequence[str], *, param: str = "messages") -> None:
        """Refuse (400 ``context_length_exceeded``) texts over ``max_prompt_tokens`` in all, before any work."""
        total = 0
        for text in texts:
            total += self.count_tokens(text)
            if total > self.max_prompt_tokens:
                raise ServiceError(400, f"the text to perturb holds more than {self.max_prompt_tokens} tokens "
                                        f"(at least {total})", param=param, code="context_length_exceeded")

    def remaining(self, principal: str) -> float | None:
        return None if self.ledger is None else self.ledger.remaining(principal, self.unit)

    def refund(self, result: PrivateTexts, *, principal: str) -> float | None:
        """Give back what ``result`` cost ``principal``: its texts were never published (the upstream received
        nothing). Returns the budget left (None without a ledger). Blocking."""
        if self.ledger is not None and result.spent > 0:
            self.ledger.refund(principal, [Spend(self.unit, result.spent)],
                               note="refund: the upstream received nothing")
        return self.remaining(principal)

    def privatize(self, texts: Sequence[str], *, principal: str, epsilon: float | None = None) -> PrivateTexts:
        """Every non-blank text perturbed by one fresh perturber, charged to ``principal`` first (blocking)."""
        started = time.perf_counter()
        eps = self.epsilon if epsilon is None else epsilon
        wanted = [i for i, text in enumerate(texts) if text.strip()]
        released, reports = list(texts), [None] * len(texts)
        reports_out: list[PromptReport | None] = list(reports)
        if wanted:
            try:
                generator = make_generator(device=self.device)  # fresh, OS-seeded, per call
                perturber = self.factory(eps, generator, self.ledger, principal)
                results = perturber.perturb_batch([texts[i] for i in wanted])
                _check_results(results, len(wanted), charged=self.ledger is not None)
            except BudgetExhaustedError:
                raise
            except Exception as error:  # fail closed: whatever went wrong, nothing leaves
                raise PrivacyStepError(error, charged=self.ledger is not None) from None
            for i, result in zip(wanted, results, strict=True):
                released[i], reports_out[i] = result.text, result.report
        return PrivateTexts(texts=released, reports=reports_out, mechanism=self.mechanism, epsilon=eps,
                            unit=self.unit, budget_remaining=self.remaining(principal),
                            seconds=time.perf_counter() - started)


def _check_results(results: Sequence[object], expected: int, *, charged: bool) -> None:
    """What the gateway relies on: one result per text and, with a ledger, every cost charged to it."""
    if len(results) != expected:
        raise RuntimeError("the mechanism returned a different number of texts")
    for result in results:
        report = getattr(result, "report", None)
        if not isinstance(report, PromptReport):
            raise RuntimeError("the mechanism returned no report")
        if charged and report.accounting.get(PRIVLM, 0.0) > 0 and report.spent is None:
            raise RuntimeError("the mechanism did not charge the ledger")
