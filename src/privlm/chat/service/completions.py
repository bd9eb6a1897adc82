"""``POST /v1/chat/completions`` behind a token-level mechanism (Cape by default, any of the registry): an
OpenAI-compatible chat endpoint that perturbs prompts before they leave, for any OpenAI-compatible upstream (OpenAI,
vLLM, Ollama, llama.cpp, ``privlm serve-llm``).

One request:
  1. validate it (:class:`~privlm.chat.wire.ChatCompletionRequest`); the epsilon it may lower; its texts to
     perturb (:mod:`privlm.chat.service.messages`) and their length;
  2. perturb them all in one call (:class:`~privlm.chat.service.privacy.PromptPrivacy`): a fresh perturber and
     generator for this request, the caller's budget charged before any draw (429 when exhausted), and any
     failure fails closed (nothing is forwarded);
  3. forward the request with the perturbed texts, and nothing else changed but privlm's own ``privlm`` field
     removed; the upstream's answer comes back as it is, streamed event by event when asked for (perturbation
     happens before the call: nothing is held back), with the privacy report in ``x-privlm-*`` headers.

Optional: the report in the body as well (a ``privlm`` field; in a stream, one event before the upstream's,
with empty ``choices``), and a response-side extraction by a local model (:mod:`privlm.chat.extraction`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, Header
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictInt

from privlm.accounting import DatabaseUnavailableError
from privlm.chat.extraction import AnswerExtractor, collect_stream
from privlm.chat.restore import Restorer, StreamRestorer
from privlm.chat.service.audit import AuditLog
from privlm.chat.service.memory import ConversationMemory, EarlierRelease, Recalled, release_texts
from privlm.chat.service.messages import TextSlot, perturbed_fields, with_texts
from privlm.chat.service.privacy import PrivacyBatcher, PrivateTexts, PromptPrivacy
from privlm.chat.service.upstream import (
    ChatUpstream,
    NothingSentError,
    UpstreamAnswer,
    UpstreamStream,
    UpstreamStreamError,
    upstream_error,
)
from privlm.chat.wire import (
    SSE_DONE,
    SSE_EVENT_SCHEMA,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    completion_id,
    message_text,
    now,
    sse_event,
)
from privlm.models.perturbation import Accounting
from privlm.service import BearerKeys, ServiceError
from privlm.service.errors import ledger_unavailable
from privlm.settings.chat import ChatOptions

MAX_CHOICES = 128  # OpenAI's own limit on n
MAX_REMEMBERED_CHOICES = 16  # per answer: the first choices (by index, below n) are kept by conversation memory
UPSTREAM_PATH = "chat/completions"
logger = logging.getLogger(__name__)


class PrivlmOptions(BaseModel):
    """privlm's own request field (removed before forwarding)."""

    model_config = ConfigDict(extra="forbid", strict=True)  # strict: `true` is not epsilon 1, `0` not False
    epsilon: float | None = Field(None, gt=0, description="A lower epsilon per token for this request (never higher; "
                                                          "with the x-privlm-epsilon header too, the smaller one).")
    report: bool = Field(False, description="Also put the privacy report in the body (a `privlm` field).")
    restore: bool | None = Field(None, description="Restore the answer: write the user's own words back where it "
                                                   "quotes a replacement (default: the gateway's --restore; true "
                                                   "only on a gateway started with --restore).")


class PrivateChatRequest(ChatCompletionRequest):
    n: StrictInt | None = Field(None, ge=1, le=MAX_CHOICES, description=f"Choices to generate (at most {MAX_CHOICES}).")
    privlm: PrivlmOptions | None = None


def _header(description: str) -> dict[str, object]:
    return {"description": description, "schema": {"type": "string"}}


PRIVACY_HEADERS = {
    "x-privlm-request-id": _header("This request's id (as in the audit log)."),
    "x-privlm-mechanism": _header("The mechanism that perturbed the prompt (cape by default)."),
    "x-privlm-epsilon": _header("Epsilon per perturbed token, on the mechanism's own scale."),
    "x-privlm-epsilon-spent": _header("The request's sound privacy loss (privlm's accounting): what the ledger was "
                                      "charged."),
    "x-privlm-tokens": _header("Tokens in the perturbed texts."),
    "x-privlm-tokens-perturbed": _header("Tokens that went through the mechanism (the others are stopwords and "
                                         "punctuation, sent unchanged)."),
    "x-privlm-tokens-unchanged": _header("Of the perturbed tokens, those the mechanism released as themselves: "
                                         "sensitive tokens that crossed unchanged."),
    "x-privlm-fields-dropped": _header("When fields were removed before forwarding (a perturbed message's name): "
                                       "their paths, comma-separated."),
    "x-privlm-budget-remaining": _header("With a ledger: the caller's budget left."),
    "x-privlm-texts-remembered": _header("With conversation memory: texts sent as they were released before "
                                         "(charged nothing)."),
    "x-privlm-restored": _header("With restore, a whole answer: the replacements written back."),
    "x-privlm-restore-hold-chars": _header("With restore: the most characters a stream holds back (the longest "
                                           "replacement)."),
}


@dataclass(frozen=True)
class Release:
    """What a request sends in place of its perturbed texts: ``recalled``
    (:func:`privlm.chat.service.memory.release_texts`) at the ``slots`` of ``originals``; the fields ``dropped``."""

    recalled: Recalled
    slots: list[TextSlot]
    originals: list[str]
    dropped: list[str]

    @property
    def result(self) -> PrivateTexts:
        return self.recalled.result

    @property
    def remembered(self) -> list[bool]:
        return self.recalled.remembered

    @property
    def new(self) -> list[tuple[str, EarlierRelease]]:
        return self.recalled.new

    def restorer(self, unperturbed: Sequence[str] = ()) -> Restorer:
        """The restorer of this release's replacements; ``unperturbed``: the request's other texts, which the
        upstream also saw (a replacement that occurs there too is not restored)."""
        replacements = [span.replacement_in(original)  # with the original's spaces, so no sub-word is split
                        for original, spans in zip(self.originals, self.recalled.spans, strict=True)
                        for span in spans]
        return Restorer.of(replacements, [*self.result.texts, *unperturbed])


def privacy_headers(result: PrivateTexts, request_id: str, dropped: Sequence[str] = ()) -> dict[str, str]:
    headers = {"x-privlm-request-id": request_id, "x-privlm-mechanism": result.mechanism,
               "x-privlm-epsilon": f"{result.epsilon:g}", "x-privlm-epsilon-spent": f"{result.spent:.6g}",
               "x-privlm-tokens": str(result.tokens), "x-privlm-tokens-perturbed": str(result.tokens_perturbed),
               "x-privlm-tokens-unchanged": str(result.tokens_unchanged),
               "x-privlm-duration-ms": f"{1e3 * result.seconds:.1f}"}
    if result.budget_remaining is not None:
        headers["x-privlm-budget-remaining"] = f"{result.budget_remaining:.6g}"
    if dropped:
        headers["x-privlm-fields-dropped"] = ",".join(dropped)
    return headers


def privacy_report(result: PrivateTexts, slots: Sequence[TextSlot], request_id: str,
                   dropped: Sequence[str] = (), remembered: Sequence[bool] = ()) -> dict[str, Any]:
    """The body's ``privlm`` field: the numbers of the headers, each text as it was sent (and whether it was
    released before: ``remembered``), the fields dropped."""
    texts = []
    again = list(remembered) or [False] * len(slots)
    for slot, sent, report, before in zip(slots, result.texts, result.reports, again, strict=True):
        texts.append({"message": slot.message, "part": slot.part, "role": slot.role, "field": slot.field,
                      "path": slot.path, "remembered": before,
                      "sent": slot.placed(sent), "tokens": 0 if report is None else report.n_tokens,
                      "tokens_perturbed": 0 if report is None else report.n_perturbed,
                      "tokens_changed": 0 if report is None else report.n_changed,
                      "tokens_unchanged": 0 if report is None else report.n_unchanged,
                      "epsilon_spent": 0.0 if report is None else report.accounting.get(Accounting.PRIVLM, 0.0)})
    return {"request_id": request_id, "mechanism": result.mechanism, "epsilon": result.epsilon,
            "epsilon_spent": result.spent, "epsilon_paper": result.paper_total, "unit": str(result.unit),
            "tokens": result.tokens, "tokens_perturbed": result.tokens_perturbed,
            "tokens_unchanged": result.tokens_unchanged, "budget_remaining": result.budget_remaining,
            "duration_ms": round(1e3 * result.seconds, 1), "texts_remembered": sum(again),
            "texts": texts, "dropped": list(dropped),
            "guarantee": next((r.guarantee for r in result.reports if r is not None), None)}


def audit_record(result: PrivateTexts, slots: Sequence[TextSlot], request_id: str, principal: str,
                 model: str, stream: bool, dropped: Sequence[str] = (), remembered: Sequence[bool] = ()
                 ) -> dict[str, Any]:
    """What the audit log keeps of a release: the perturbed texts and the report, never an original."""
    report = privacy_report(result, slots, request_id, dropped, remembered)
    return {**report, "principal": principal, "model": model, "stream": stream, "endpoint": "chat.completions"}


class _Call:
    """One request's private state: its id, principal, release and options. Nothing outlives it but what
    conversation memory keeps (never an original)."""

    def __init__(self, request: PrivateChatRequest, principal: str, release: Release, *, report_in_body: bool,
                 restore: bool, keep_answers: bool = False, memory: ConversationMemory | None = None) -> None:
        self.request, self.principal, self.release, self.memory = request, principal, release, memory
        self.result, self.slots, self.dropped = release.result, release.slots, release.dropped
        self.id = f"privlm-{uuid.uuid4().hex[:16]}"
        options = request.privlm
        self.report = report_in_body or bool(options and options.report)
        self.restoring = restore
        # Answers are kept (restored or not) by a gateway that restores: the restorer of a request that asked for
        # none restores nothing, and only passes the answer on to be kept.
        self.keep_answers = keep_answers and memory is not None
        self.restorer = (release.restorer(_unperturbed_texts(request, release.slots)) if restore
                         else Restorer({}) if self.keep_answers else None)
        self.headers = privacy_headers(self.result, self.id, self.dropped)
        if memory is not None:
            self.headers["x-privlm-texts-remembered"] = str(sum(release.remembered))
        if self.restoring and self.restorer is not None:
            self.headers["x-privlm-restore-hold-chars"] = str(self.restorer.longest)
        self.refund: float | None = None  # what was given back, when the upstream received nothing

    def refunded(self, remaining: float | None, *, charged: bool) -> None:
        """The release never left this machine, so it costs nothing; a ``charged`` one was given back to the ledger
        (``x-privlm-refunded``). The report says so."""
        self.refund = self.result.spent
        self.headers["x-privlm-epsilon-spent"] = "0"
        if charged:
            self.headers["x-privlm-refunded"] = f"{self.refund:.6g}"
        if remaining is not None:
            self.headers["x-privlm-budget-remaining"] = f"{remaining:.6g}"

    def failure_headers(self) -> dict[str, str]:
        """The report for an answer that is not a success, and, unless the charge was refunded, no retry by
        OpenAI's SDKs: a retry would release the prompt again and pay again."""
        return self.headers if self.refund is not None else {**self.headers, "x-should-retry": "false"}

    def body(self) -> dict[str, Any]:
        """The request to forward: the perturbed texts (and earlier answers as the upstream wrote them) in place,
        the dropped fields and privlm's field removed, nothing else changed."""
        sent = self.request.model_dump(mode="json", exclude_unset=True, exclude={"privlm"})
        return with_texts(sent, self.slots, self.result.texts, self.dropped)

    async def remember_release(self) -> None:
        """Keep what this request perturbed, now that the upstream has received it (kept before, a concurrent
        repeat could go up free while this request, never sent, is refunded). A failure only means that a later
        repeat is released afresh, and charged: it is logged, not raised."""
        if self.memory is not None and self.release.new:
            await self._remember(self.memory.remember_releases, self.release.new)

    async def remember_answers(self, answers: dict[int, tuple[str, str]]) -> None:
        """Keep each choice's ``(as returned, as the upstream wrote it)`` answer, restored or not, so that it goes
        back upstream as the upstream wrote it, free, when the client sends it back as the same whole assistant
        message. Only the first choices the request asked for are kept (:data:`MAX_REMEMBERED_CHOICES`): an
        upstream's extra choices are not, so a client that sends one back has it perturbed and charged."""
        wanted = min(self.request.n or 1, MAX_REMEMBERED_CHOICES)
        kept = [answers[index] for index in sorted(answers) if 0 <= index < wanted]
        if self.memory is not None and self.keep_answers and kept:
            await self._remember(self.memory.remember_answers, kept)

    async def _remember(self, keep: Callable[[str, Any], None], items: Sequence[Any]) -> None:
        try:
            await asyncio.to_thread(keep, self.principal, items)
        except Exception as error:
            logger.warning("request %s: conversation memory could not keep a text (%s)", self.id,
                           type(error).__name__)

    def report_field(self) -> dict[str, Any]:
        report = privacy_report(self.result, self.slots, self.id, self.dropped, self.release.remembered)
        if self.restoring and self.restorer is not None:
            report["restore"] = {"replacements": len(self.restorer.forward), "hold_chars": self.restorer.longest}
        return report

    def answer_limit(self) -> int | None:
        """The most tokens the request asked for (the smaller of ``max_completion_tokens`` and ``max_tokens``),
        which a local rewrite of the answer keeps to too; None when it set neither."""
        limits = [n for n in (self.request.max_completion_tokens, self.request.max_tokens) if n is not None]
        return min(limits, default=None)

    def user_prompt(self) -> str:
        """The user's own words, for the local extraction (stays on this machine)."""
        return "\n\n".join(m.content if isinstance(m.content, str) else
                           "\n".join(getattr(p, "text", "") for p in m.content)
                           for m in self.request.messages if m.role == "user" and m.content)


def _unperturbed_texts(request: ChatCompletionRequest, slots: Sequence[TextSlot]) -> list[str]:
    """The text of every message none of whose texts was perturbed (sent as it is)."""
    perturbed = {slot.message for slot in slots}
    return [message_text(m.content) for i, m in enumerate(request.messages) if i not in perturbed]


def _whole_answer(request: ChatCompletionRequest, slot: TextSlot) -> bool:
    """Whether a slot holds a whole assistant message's text (a string content, or its one part): the only place
    where an answer the gateway returned may go back up as the upstream wrote it (memory's module doc)."""
    if slot.role != "assistant" or slot.field != "content" or slot.json_path is not None:
        return False
    content = request.messages[slot.message].content
    return slot.part is None or (isinstance(content, list) and len(content) == 1)


class ChatCompletionsRoutes:
    """The private ``POST /v1/chat/completions`` (see the module doc); ``memory``: conversation memory
    (:mod:`privlm.chat.service.memory`), None for none; ``batcher``: the device model's batches, shared with the
    app's other routes that perturb (default: this route's own). :meth:`router` mounts it."""

    def __init__(self, privacy: PromptPrivacy, upstream: ChatUpstream, *, auth: BearerKeys,
                 options: ChatOptions | None = None, audit: AuditLog | None = None,
                 extractor: AnswerExtractor | None = None, memory: ConversationMemory | None = None,
                 batcher: PrivacyBatcher | None = None) -> None:
        options = options or ChatOptions()
        self.privacy, self.upstream, self.options = privacy, upstream, options
        self.audit, self.extractor, self.memory = audit, extractor, memory
        self.auth = auth.charging(privacy.ledger)  # callers named as the ledger names them, in the audit log too
        self.perturbing = batcher or privacy.batched()  # concurrent requests share forward passes, callers take turns
        # With extraction, or on a gateway that restores (whatever one request asks), an assistant text of the
        # history may hold the user's words: it is perturbed, unless memory knows it as an answer the gateway
        # returned (then it goes up as the upstream wrote it). Without either, every answer returned was the
        # upstream's own words.
        self.perturb_assistant = extractor is not None or options.restore
        self.keep_answers = options.restore and extractor is None

    def router(self) -> APIRouter:
        """The route; its principal is this app's (``auth``), a dependency no method signature could name."""
        async def chat_completions(request: PrivateChatRequest, principal: str = Depends(self.auth.dependency),
                                   x_privlm_epsilon: Annotated[list[str] | None, Header()] = None) -> Response:
            return await self.create(request, principal, x_privlm_epsilon or [])

        router = APIRouter(tags=["chat"])
        router.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"], response_class=JSONResponse,
                             responses={200: {"model": ChatCompletion, "headers": PRIVACY_HEADERS,
                                              "description": "The upstream's answer (JSON, or with stream: SSE "
                                                             "chunks)",
                                              "content": {"text/event-stream": {"schema": SSE_EVENT_SCHEMA}}}})
        return router

    async def privatize(self, request: PrivateChatRequest, principal: str, header_epsilon: Sequence[str]
                        ) -> Release:
        epsilon = _request_epsilon(self.privacy, request, header_epsilon)
        options = self.options
        fields = perturbed_fields(request, perturb_system=options.perturb_system,
                                  perturb_assistant=self.perturb_assistant, non_text_parts=options.non_text_parts,
                                  message_names=options.message_names,
                                  perturb_tool_results=options.perturb_tool_results)
        caller = self.auth.fair_caller(principal)

        async def perturb(texts: list[str]) -> PrivateTexts:
            return await self.perturbing.privatize(texts, principal=principal, epsilon=epsilon, caller=caller)

        recalled = await release_texts(self.memory, principal, fields.texts, perturb, check=self.privacy.check_lengths,
                                       whole_answers=[_whole_answer(request, slot) for slot in fields.slots])
        return Release(recalled, fields.slots, list(fields.texts), list(fields.dropped))

    async def create(self, request: PrivateChatRequest, principal: str, header_epsilon: Sequence[str]) -> Response:
        """One request: perturbed, audited, forwarded; the upstream's answer with the privacy report."""
        restoring = _restoring(request, self.options) and self.extractor is None
        release = await self.privatize(request, principal, header_epsilon)
        call = _Call(request, principal, release, report_in_body=self.options.report_in_body, restore=restoring,
                     keep_answers=self.keep_answers, memory=self.memory)
        audit = self.audit
        try:
            if audit is not None:
                await asyncio.to_thread(audit.write, "released", audit_record(
                    call.result, call.slots, call.id, principal, request.model, bool(request.stream), call.dropped,
                    release.remembered))
        except Exception as error:  # an unrecorded release is not sent: nothing crossed
            raise await self.failed_after_release(call, error, nothing_sent=True) from None
        try:
            if request.stream:
                return await _stream(self.upstream, call, self.extractor, audit)
            answer = await self.upstream.post(UPSTREAM_PATH, call.body())
            await call.remember_release()
            await asyncio.to_thread(_audit_upstream, audit, call, answer.status)
            return await _complete(answer, call, self.extractor)
        except Exception as error:  # charged already, whatever failed: see failed_after_release
            raise await self.failed_after_release(call, error, nothing_sent=isinstance(error, NothingSentError)
                                                  ) from None

    async def failed_after_release(self, call: _Call, error: Exception, *, nothing_sent: bool) -> ServiceError:
        """The answer to any failure once the caller was charged: the release refunded when it provably never
        left this machine; the report in the headers; no retry by OpenAI's SDKs unless refunded (a retry is a
        new release and a new charge); audited when the log can be written. Never the text."""
        if nothing_sent:
            try:
                call.refunded(await asyncio.to_thread(self.privacy.refund, call.result, principal=call.principal),
                              charged=self.privacy.ledger is not None)
            except Exception as refund_error:  # the charge stands: the safe side; the answer then says not to retry
                logger.warning("request %s: the refund could not be recorded (%s)", call.id,
                               type(refund_error).__name__)
        if isinstance(error, ServiceError):
            failure = error
        elif isinstance(error, DatabaseUnavailableError):
            failure = ledger_unavailable()
        else:
            failure = ServiceError(500, f"the gateway failed after the release ({type(error).__name__})",
                                   type="server_error", code="failed_after_release")
        try:
            await asyncio.to_thread(_audit_upstream, self.audit, call, failure.status, failure.detail.code)
        except Exception as audit_error:  # logged by type only: an exception's message may quote the text
            logger.warning("request %s: the audit log could not record its failure (%s)", call.id,
                           type(audit_error).__name__)
        failure.headers = {**(failure.headers or {}), **call.failure_headers()}
        return failure


def _restoring(request: PrivateChatRequest, options: ChatOptions) -> bool:
    """Whether this request's answer is restored: the gateway's ``--restore`` unless the request turns it off. A
    request may not turn it on where the gateway has it off: that gateway sends the history's answers as they are
    (the upstream's own words), so a restored one would cross."""
    asked = request.privlm.restore if request.privlm else None
    if asked and not options.restore:
        raise ServiceError(400, "privlm.restore: this gateway does not restore answers (start it with --restore); "
                                "a restored answer sent back as history would cross as it is",
                           param="privlm.restore", code="restore_not_enabled")
    return options.restore if asked is None else asked


def _request_epsilon(privacy: PromptPrivacy, request: PrivateChatRequest, headers: Sequence[str]) -> float:
    """The request's epsilon: the smallest of the body's ``privlm.epsilon`` and every ``x-privlm-epsilon`` value
    (each checked; an absent one counts as the gateway's own), so that none can raise another: a header repeated,
    or a list in one header (a proxy appending its cap), gives its smallest value."""
    body = request.privlm.epsilon if request.privlm else None
    return privacy.lowest_epsilon([(body, "privlm.epsilon")], [(header, "x-privlm-epsilon") for header in headers])


def _audit_upstream(audit: AuditLog | None, call: _Call, status: int, code: str | None = None) -> None:
    """The upstream's status (or the gateway's own error for it) after a release (blocking)."""
    if audit is not None:
        refund = {} if call.refund is None else {"refunded": call.refund}
        audit.write("upstream", {"request_id": call.id, "status": status} | ({"code": code} if code else {}) | refund)


async def _complete(answer: UpstreamAnswer, call: _Call, extractor: AnswerExtractor | None) -> Response:
    """A whole answer: the upstream's body as it is (5xx: our 502), plus the report; extracted if asked."""
    if answer.status >= 500:
        raise upstream_error(answer.status)
    headers = {**answer.headers, **(call.headers if answer.ok else call.failure_headers())}
    if not answer.ok or not (call.report or extractor is not None or call.restorer is not None):
        return Response(answer.body, status_code=answer.status, headers=headers)
    try:  # parsed, restored and written off the event loop: an answer may be 32 MiB
        body = await asyncio.to_thread(json.loads, answer.body)
    except ValueError:
        raise ServiceError(502, "the upstream answered with invalid JSON", type="upstream_error",
                           code="upstream_invalid") from None
    if extractor is not None:
        body = await asyncio.to_thread(extractor.rewrite_completion, call.user_prompt(), body,
                                       limit=call.answer_limit())
    restored = None
    if call.restorer is not None:
        count = await asyncio.to_thread(_restore_completion, body, call.restorer)
        await call.remember_answers(_returned_pairs(body))
        if call.restoring:
            restored = count
            headers["x-privlm-restored"] = str(restored)
    if call.report:
        body["privlm"] = call.report_field()
        if restored is not None:  # the upstream's own words too: it wrote them, so they are no secret here
            body["privlm"]["restore"] |= {"restored": restored, "upstream_content": _upstream_contents(body)}
    _upstream_contents(body)  # the private key never goes out
    headers.pop("content-type", None)
    content = await asyncio.to_thread(_json_bytes, body)
    return Response(content, status_code=answer.status, headers=headers, media_type="application/json")


def _json_bytes(body: Any) -> bytes:
    """``body`` as JSONResponse writes it (UTF-8, compact)."""
    return json.dumps(body, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


_UPSTREAM_CONTENT = "_privlm_upstream_content"  # a choice's content as the upstream wrote it; never sent out


def _restore_completion(body: dict[str, Any], restorer: Restorer) -> int:
    """Restore the text content of every choice of a completion in place (keeping the upstream's in a private key,
    removed before the answer goes out); how many replacements were restored. Tool calls are left as they are:
    a restored argument would go back upstream as history."""
    total = 0
    for message in _messages(body):
        if isinstance(message.get("content"), str):
            restored, count = restorer.restore(message["content"])
            message[_UPSTREAM_CONTENT], message["content"] = message["content"], restored
            total += count
    return total


def _returned_pairs(body: dict[str, Any]) -> dict[int, tuple[str, str]]:
    """By choice index, each choice's ``(content as returned, as the upstream wrote it)`` (the first of an index
    the upstream sent twice)."""
    choices = body.get("choices")
    pairs: dict[int, tuple[str, str]] = {}
    for choice in choices if isinstance(choices, list) else []:
        message = choice.get("message") if isinstance(choice, dict) else None
        index = choice.get("index", 0) if isinstance(choice, dict) else None
        if (isinstance(message, dict) and isinstance(message.get("content"), str) and isinstance(index, int)
                and not isinstance(index, bool)):
            pairs.setdefault(index, (message["content"], str(message.get(_UPSTREAM_CONTENT, message["content"]))))
    return pairs


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The message of each choice of a completion (those that are JSON objects)."""
    choices = body.get("choices")
    messages = [c.get("message") for c in choices if isinstance(c, dict)] if isinstance(choices, list) else []
    return [m for m in messages if isinstance(m, dict)]


def _upstream_contents(body: dict[str, Any]) -> list[str | None]:
    """Per choice, the content as the upstream wrote it (None where it was not text), the private key dropped."""
    out: list[str | None] = []
    for message in _messages(body):
        content = message.pop(_UPSTREAM_CONTENT, message.get("content"))
        out.append(content if isinstance(content, str) else None)
    return out


async def _stream(upstream: ChatUpstream, call: _Call, extractor: AnswerExtractor | None,
                  audit: AuditLog | None) -> Response:
    """Open the upstream's stream; an error answer comes back whole (within the cap), a stream event by event."""
    stack = AsyncExitStack()
    answer = await stack.enter_async_context(upstream.stream(UPSTREAM_PATH, call.body()))
    await call.remember_release()
    if answer.status != 200:
        try:
            body = await answer.read()
        finally:
            await stack.aclose()
        await asyncio.to_thread(_audit_upstream, audit, call, answer.status)
        return await _complete(UpstreamAnswer(answer.status, answer.headers, body), call, None)
    await asyncio.to_thread(_audit_upstream, audit, call, 200)
    headers = {**answer.headers, **call.headers}
    headers.pop("content-type", None)
    chunks = (_extracted_events(answer, call, extractor) if extractor is not None
              else _restored_events(answer, call, call.restorer) if call.restorer is not None
              else _passed_events(answer, call))
    return StreamingResponse(_closing(chunks, stack), media_type="text/event-stream", headers=headers)


async def _closing(chunks: AsyncIterator[bytes], stack: AsyncExitStack) -> AsyncIterator[bytes]:
    """``chunks``, then the upstream connection closed, however the stream ends (a caller that leaves, too).
    Only whole events are passed on, so the error event of a failed stream starts on a fresh event, and OpenAI's
    SDKs raise it rather than parse it into a cut one."""
    try:
        async for chunk in chunks:
            yield chunk
    except UpstreamStreamError as error:  # the upstream failed mid-stream: say so in OpenAI's error event
        yield sse_event({"error": {"message": str(error), "type": "upstream_error", "code": "upstream_stream_failed",
                                   "param": None}})
    except Exception as error:  # the gateway's own failure (the extraction, say): an error event, not a cut stream
        logger.warning("a stream failed in the gateway (%s)", type(error).__name__)
        yield sse_event({"error": {"message": f"the gateway failed mid-stream ({type(error).__name__})",
                                   "type": "server_error", "code": "failed_after_release", "param": None}})
    finally:
        await stack.aclose()


def _report_event(call: _Call) -> bytes:
    """The report as one chunk with no choices (OpenAI's clients accept it, as they accept usage chunks)."""
    return sse_event({"id": call.id, "object": "chat.completion.chunk", "created": now(), "model": call.request.model,
                      "choices": [], "privlm": call.report_field()})


async def _passed_events(answer: UpstreamStream, call: _Call) -> AsyncIterator[bytes]:
    if call.report:
        yield _report_event(call)
    async for event in answer.events():
        yield event


async def _restored_events(answer: UpstreamStream, call: _Call, restorer: Restorer) -> AsyncIterator[bytes]:
    """The upstream's events with each choice's content restored as it comes: a chunk passes at once but for a
    tail that could still grow into a replacement, which follows with the next chunk, or with the choice's
    finish. Events that are not JSON chunks pass as they are. With the report, a last event before ``[DONE]``
    (no choices) says how many replacements were restored and the most characters held back at once."""
    if call.report:
        yield _report_event(call)
    choices: dict[int, StreamRestorer] = {}
    sent: dict[int, list[tuple[str, str]]] = {}  # per choice: (as the upstream wrote it, as passed on)
    last: dict[str, Any] = {}
    async for event in answer.events():
        payload = _chunk_payload(event)
        if payload is None:
            if event.strip() == SSE_DONE.strip():
                for chunk in _held_tails(choices, sent, last):
                    yield chunk
                await call.remember_answers({index: ("".join(p for _, p in pieces), "".join(u for u, _ in pieces))
                                             for index, pieces in sent.items()})
                if call.report and call.restoring:
                    yield _restore_event(call, choices.values())
            yield event
            continue
        last = payload
        if len(event) > _RESTORE_INLINE_BYTES:  # off the event loop: a long chunk may hold many replacements
            await asyncio.to_thread(_restore_chunk, payload, restorer, choices, sent)
        else:
            _restore_chunk(payload, restorer, choices, sent)
        yield sse_event(payload)
    for chunk in _held_tails(choices, sent, last):  # a stream that ended without [DONE]
        yield chunk


_RESTORE_INLINE_BYTES = 2**16  # a stream's chunk above this is restored in a worker thread


def _restore_chunk(payload: dict[str, Any], restorer: Restorer, choices: dict[int, StreamRestorer],
                   sent: dict[int, list[tuple[str, str]]]) -> None:
    """Restore one chunk's choices in place, each through its choice's stream restorer (``choices``), and note
    per choice what the upstream wrote and what was passed on (``sent``)."""
    for choice in payload.get("choices") or []:
        index = choice.get("index", 0) if isinstance(choice, dict) else None
        delta = choice.get("delta") if isinstance(choice, dict) else None
        if not isinstance(index, int) or not isinstance(delta, dict):
            continue
        stream = choices.setdefault(index, restorer.stream())
        content = delta.get("content")
        passed = stream.feed(content) if isinstance(content, str) else ""
        if choice.get("finish_reason") is not None:
            passed += stream.flush()
        if isinstance(content, str) or passed:
            delta["content"] = passed
            sent.setdefault(index, []).append((content if isinstance(content, str) else "", passed))


def _chunk_payload(event: bytes) -> dict[str, Any] | None:
    """An event's JSON chunk (one ``data:`` line holding a JSON object), else None."""
    lines = [line for line in event.replace(b"\r\n", b"\n").split(b"\n") if line.strip()]
    if len(lines) != 1 or not lines[0].startswith(b"data:"):
        return None
    try:
        payload = json.loads(lines[0][5:])
    except ValueError:
        return None
    return payload if isinstance(payload, dict) else None


def _held_tails(choices: dict[int, StreamRestorer], sent: dict[int, list[tuple[str, str]]],
                last: dict[str, Any]) -> list[bytes]:
    """A chunk with what each choice still holds back (a choice that did not finish)."""
    out = []
    for index, stream in choices.items():
        tail = stream.flush()
        if tail:
            sent.setdefault(index, []).append(("", tail))
            out.append(sse_event({**{k: last[k] for k in ("id", "object", "created", "model") if k in last},
                                  "choices": [{"index": index, "delta": {"content": tail}, "finish_reason": None}]}))
    return out


def _restore_event(call: _Call, choices: Iterable[StreamRestorer]) -> bytes:
    streams = list(choices)
    restore = {"restored": sum(s.restored for s in streams), "held_chars_most": max((s.most_held for s in streams),
                                                                                     default=0)}
    return sse_event({"id": call.id, "object": "chat.completion.chunk", "created": now(), "model": call.request.model,
                      "choices": [], "privlm": {"request_id": call.id, "restore": restore}})


async def _extracted_events(answer: UpstreamStream, call: _Call, extractor: AnswerExtractor) -> AsyncIterator[bytes]:
    """With extraction the whole upstream answer is needed first: collect it (within the cap), rewrite locally,
    stream the rewrite."""
    if call.report:
        yield _report_event(call)
    texts = await collect_stream(answer.events(max_total_bytes=answer.max_bytes))
    model = call.request.model
    chunk_id, created = completion_id(), now()
    for index in sorted(texts) or [0]:
        extracted = await asyncio.to_thread(extractor.extract, call.user_prompt(), texts.get(index, ""),
                                            limit=call.answer_limit())
        for delta in ({"role": "assistant", "content": ""}, {"content": extracted}):
            yield sse_event(ChatCompletionChunk.model_validate(
                {"id": chunk_id, "created": created, "model": model,
                 "choices": [{"index": index, "delta": delta}]}))
        yield sse_event(ChatCompletionChunk.model_validate(
            {"id": chunk_id, "created": created, "model": model,
             "choices": [{"index": index, "delta": {}, "finish_reason": "stop"}]}))
    yield SSE_DONE


def closing_upstream(upstream: ChatUpstream) -> Any:
    """A lifespan that closes the upstream client when the app stops."""
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await upstream.aclose()
    return lifespan
