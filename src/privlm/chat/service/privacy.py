"""The privacy step of a chat gateway, without HTTP: texts in, perturbed texts and their report out.

Each call builds a fresh perturber (:data:`PerturberFactory`) with a fresh OS-seeded generator, charging the
caller's principal: nothing random and nothing about the caller outlives the call, so concurrent callers
share no state but the read-only device model and the ledger. The perturber charges the ledger the whole
call's sound total, in one transaction, before it draws anything (``Ledger.spend_all``): a call that would
pass the budget is refused whole (``BudgetExhaustedError``) and releases nothing.

It fails closed: if perturbing fails for any reason, :meth:`PromptPrivacy.privatize` raises
:class:`PrivacyStepError`, whose message names the kind of failure and never the text; the caller must not
forward anything.

Concurrent requests share the device model's forward passes (:meth:`PromptPrivacy.batched`, the async entry point
of the chat gateway and the guardrail): :meth:`PromptPrivacy.privatize_many` gives each request exactly what
:meth:`~PromptPrivacy.privatize` would give it alone (its own perturber, generator, epsilon and principal, its own
all-or-nothing charge before its own draws, its own error), and only the preparation of a mechanism that offers one
(:class:`~privlm.models.perturbation.SharedPreparation`; Cape's: the forward passes and distances that depend
neither on epsilon nor on the draw) is computed once for the texts of several requests. Each row of a fp32 forward
pass is computed from its own text: the other texts of the pass change a text's utilities only through the pass's
padded length (float rounding, a few ulps: 3e-7 measured on SmolLM2), never through their content, as when one
request's own texts are padded together (a test checks both). An int8 model's dynamic quantization scales each
batch as a whole, so a text's utilities depend on the other texts' content: there only requests of one principal at
one epsilon share a preparation.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from privlm.accounting import BudgetExhaustedError, DatabaseUnavailableError, Ledger
from privlm.mechanisms import PrivacyUnit, Spend, make_generator
from privlm.models.device import resolve_device
from privlm.models.language import LanguageModel
from privlm.models.perturbation import Accounting, PerturbedPrompt, PromptReport, SharedPreparation, TextPerturber
from privlm.models.text_mechanisms import CalibratedBound, MechanismContext, check_epsilon, text_mechanism
from privlm.service import ServiceError
from privlm.service.batching import Batcher
from privlm.settings.chat import MAX_PROMPT_TOKENS
from privlm.validation import check_positive_int

PerturberFactory = Callable[[float, torch.Generator, Ledger | None, str], TextPerturber]
"""``(epsilon, generator, ledger, principal)`` -> a fresh perturber that charges ``ledger`` under ``principal``."""

PRIVLM, PAPER = Accounting.PRIVLM, Accounting.PAPER  # the sound accounting's key in a report, the paper's
BATCH_TEXTS = 16  # texts per shared batch: Cape's own batch, one forward pass
BATCH_WAIT_MS = 100.0  # the longest a batch waits for the requests it expects (service.batching)


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


@dataclass(frozen=True)
class PrivacyRequest:
    """One request's texts, the principal its release is charged to, and its epsilon (None: the gateway's)."""

    texts: tuple[str, ...]
    principal: str
    epsilon: float | None = None

    @property
    def wanted(self) -> list[int]:
        """The texts to perturb: every non-blank one (a blank text is released as it is)."""
        return [i for i, text in enumerate(self.texts) if text.strip()]


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
        ``device_model`` with Cape's logit bound B; ``ledger`` must budget the unit it registered. What building it
        would refuse is refused now, by its registry entry's check (a bad epsilon, a bound calibrated on another
        model, a masked model for a causal-only mechanism); it is built afresh for every call."""
        chosen = text_mechanism(mechanism)
        context = MechanismContext(device_model=device_model, logit_bound=logit_bound)
        chosen.check_context(context, epsilon=epsilon)

        def build(eps: float, generator: torch.Generator, ledger_: Ledger | None, principal: str) -> TextPerturber:
            return chosen.build(context, epsilon=eps, generator=generator, ledger=ledger_, principal=principal)

        return cls(build, mechanism=chosen.name, epsilon=epsilon, count_tokens=token_counter(device_model),
                   ledger=ledger, unit=chosen.unit, max_prompt_tokens=max_prompt_tokens, device=device_model.device)

    @classmethod
    def cape(cls, device_model: LanguageModel, *, epsilon: float, logit_bound: CalibratedBound | float | None,
             ledger: Ledger | None = None, max_prompt_tokens: int = MAX_PROMPT_TOKENS) -> PromptPrivacy:
        """The registry's ``cape`` on ``device_model`` with its logit bound B (a bound calibrated on this model, or a
        number)."""
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

    def lowest_epsilon(self, asks: Iterable[tuple[Any, str]] = (), headers: Iterable[tuple[str, str]] = ()
                       ) -> float:
        """The epsilon of a request that asks in several places: the smallest of what it asks, each ``(value,
        param)`` checked by :meth:`resolve_epsilon` (None: the configured epsilon), so that no ask can raise
        another. A header's value holds numbers joined by commas, as HTTP joins a repeated header."""
        chosen = [self.resolve_epsilon(value, param=param) for value, param in asks]
        for value, param in headers:
            for item in value.split(","):
                try:
                    number = float(item)
                except ValueError:
                    raise ServiceError(400, f"{param} must be a number (or numbers, the smallest counting)",
                                       param=param, code="invalid_epsilon") from None
                chosen.append(self.resolve_epsilon(number, param=param))
        return min(chosen, default=self.epsilon)

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
        [outcome] = self.privatize_many([PrivacyRequest(tuple(texts), principal, epsilon)])
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    def privatize_many(self, requests: Sequence[PrivacyRequest]) -> list[PrivateTexts | Exception]:
        """Each request as :meth:`privatize` perturbs it alone, a preparation shared (blocking; module doc).

        Per request, its texts or the error :meth:`privatize` would raise for it (``BudgetExhaustedError``,
        :class:`PrivacyStepError`), which concerns it alone; a shared preparation that fails fails every request
        that shares it, before any of them is charged.
        """
        return list(self.privatize_each(requests))

    def privatize_each(self, requests: Sequence[PrivacyRequest]) -> Iterator[PrivateTexts | Exception]:
        """:meth:`privatize_many`, each request's outcome yielded as soon as it is drawn (a shared preparation is
        made when its first request comes up), so that a batch's first requests go on while the others are drawn."""
        calls = [_Release(self, request) for request in requests]
        sharing: dict[Hashable, list[_Release]] = {}
        keys = [call.preparation_key() for call in calls]
        for call, key in zip(calls, keys, strict=True):
            if key is not None:
                sharing.setdefault(key, []).append(call)
        for call, key in zip(calls, keys, strict=True):
            group = sharing.pop(key, None) if key is not None else None
            if group is not None:
                _prepare_together(group)
            yield call.finish()

    def batched(self, *, max_texts: int = BATCH_TEXTS, max_wait_ms: float = BATCH_WAIT_MS) -> PrivacyBatcher:
        """The async entry point: concurrent requests in shared batches, callers taking turns (one per router)."""
        return PrivacyBatcher(self, max_texts=max_texts, max_wait_ms=max_wait_ms)


class PrivacyBatcher:
    """:meth:`PromptPrivacy.privatize_many` on batches of concurrent requests (:class:`~privlm.service.Batcher`):
    at most ``max_texts`` texts a batch, filled in turns between callers, one batch at a time on the device model.
    """

    def __init__(self, privacy: PromptPrivacy, *, max_texts: int = BATCH_TEXTS,
                 max_wait_ms: float = BATCH_WAIT_MS) -> None:
        self.privacy = privacy
        self.batcher: Batcher[PrivacyRequest, PrivateTexts | Exception] = Batcher(
            privacy.privatize_each, max_size=max_texts, max_wait_ms=max_wait_ms,
            size=lambda request: max(1, len(request.wanted)))

    async def privatize(self, texts: Sequence[str], *, principal: str, epsilon: float | None = None,
                        caller: str | None = None) -> PrivateTexts:
        """:meth:`PromptPrivacy.privatize` in a shared batch; ``caller`` takes turns with the others (default:
        ``principal``)."""
        request = PrivacyRequest(tuple(texts), principal, epsilon)
        if not request.wanted:  # nothing to perturb (blank, or every text remembered): no wait for a batch
            return await asyncio.to_thread(self.privacy.privatize, texts, principal=principal, epsilon=epsilon)
        try:
            outcome = await self.batcher.submit(request, caller=principal if caller is None else caller)
        except Exception as error:  # the batch failed as a whole: fail closed (a charge may have been made)
            raise PrivacyStepError(error, charged=self.privacy.ledger is not None) from None
        if isinstance(outcome, Exception):
            raise outcome
        return outcome


@dataclass(eq=False)
class _Release:
    """One request of :meth:`PromptPrivacy.privatize_many`: its perturber, its share of a preparation, its time."""

    privacy: PromptPrivacy
    request: PrivacyRequest
    perturber: TextPerturber | None = None
    prepared: Sequence[object] | None = None  # its texts' share of a preparation made with others
    failure: Exception | None = None
    seconds: float = 0.0  # its own time, and the preparation it shared
    epsilon: float = field(init=False)
    wanted: list[int] = field(init=False)

    def __post_init__(self) -> None:
        started = time.perf_counter()
        privacy = self.privacy
        self.epsilon = privacy.epsilon if self.request.epsilon is None else self.request.epsilon
        self.wanted = self.request.wanted
        if self.wanted:
            try:
                generator = make_generator(device=privacy.device)  # fresh, OS-seeded, per request
                self.perturber = privacy.factory(self.epsilon, generator, privacy.ledger, self.request.principal)
            except Exception as error:  # nothing was charged: there is no perturber
                self.failure = PrivacyStepError(error)
        self.seconds += time.perf_counter() - started

    @property
    def texts(self) -> list[str]:
        return [self.request.texts[i] for i in self.wanted]

    def preparation_key(self) -> Hashable | None:
        """Requests with one key share a preparation (module doc); None: this one is perturbed alone."""
        perturber = self.perturber
        if self.failure is not None or not isinstance(perturber, SharedPreparation):
            return None
        key = perturber.preparation_key((self.request.principal, self.epsilon))
        return None if key is None else (type(perturber), key)

    def finish(self) -> PrivateTexts | Exception:
        """Its charge, then its draws (its own perturber on its own texts), then the checks; or its error."""
        if self.failure is not None:
            return self.failure
        started = time.perf_counter()
        privacy, texts = self.privacy, list(self.request.texts)
        reports: list[PromptReport | None] = [None] * len(texts)
        if self.perturber is not None:
            try:
                results: Sequence[PerturbedPrompt] = (
                    self.perturber.perturb_batch(self.texts) if self.prepared is None
                    else _shared(self.perturber).release(self.prepared))
                _check_results(results, len(self.wanted), charged=privacy.ledger is not None)
            except (BudgetExhaustedError, DatabaseUnavailableError) as error:  # refused, or the ledger is down
                return error
            except Exception as error:  # fail closed: whatever went wrong, nothing leaves
                return PrivacyStepError(error, charged=privacy.ledger is not None)
            for i, result in zip(self.wanted, results, strict=True):
                texts[i], reports[i] = result.text, result.report
        try:
            remaining = privacy.remaining(self.request.principal)
        except DatabaseUnavailableError:  # charged and drawn already: the release stands, its report lacks this
            remaining = None
        return PrivateTexts(texts=texts, reports=reports, mechanism=privacy.mechanism, epsilon=self.epsilon,
                            unit=privacy.unit, budget_remaining=remaining,
                            seconds=self.seconds + time.perf_counter() - started)


def _shared(perturber: TextPerturber | None) -> SharedPreparation:
    if not isinstance(perturber, SharedPreparation):
        raise TypeError("only a perturber with a shared preparation releases one")
    return perturber


def _prepare_together(group: list[_Release]) -> None:
    """One preparation (Cape's: forward passes and distances) for every text of ``group``, each call's share kept;
    if it fails, every call fails closed, none of them charged (a preparation neither charges nor draws)."""
    texts = [text for call in group for text in call.texts]
    started = time.perf_counter()
    try:
        prepared = _shared(group[0].perturber).prepare(texts)
        if len(prepared) != len(texts):
            raise RuntimeError("the preparation returned a different number of texts")
    except Exception as error:
        for call in group:
            call.failure = PrivacyStepError(error)
        return
    seconds = time.perf_counter() - started
    at = 0
    for call in group:
        call.prepared, at = prepared[at:at + len(call.wanted)], at + len(call.wanted)
        call.seconds += seconds


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
