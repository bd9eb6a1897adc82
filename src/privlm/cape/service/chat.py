"""``POST /v1/chat/completions`` behind Cape: an OpenAI-compatible chat endpoint that perturbs prompts before
they leave, for any OpenAI-compatible upstream (OpenAI, vLLM, Ollama, llama.cpp, ``privlm serve-llm``).

One request:
  1. validate it (:class:`~privlm.service.chat.ChatCompletionRequest`); the epsilon it may lower; its texts to
     perturb (:mod:`privlm.cape.service.messages`) and their length;
  2. perturb them all in one call (:class:`~privlm.cape.service.privacy.PromptPrivacy`): a fresh perturber and
     generator for this request, the caller's budget charged before any draw (429 when exhausted), and any
     failure fails closed (nothing is forwarded);
  3. forward the request with the perturbed texts, and nothing else changed but privlm's own ``privlm`` field
     removed; the upstream's answer comes back as it is, streamed event by event when asked for (perturbation
     happens before the call: nothing is held back), with the privacy report in ``x-privlm-*`` headers.

Optional: the report in the body as well (a ``privlm`` field; in a stream, one event before the upstream's,
with empty ``choices``), and a response-side extraction by a local model (:mod:`privlm.cape.service.extraction`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any, Unpack

from fastapi import APIRouter, Depends, FastAPI, Header
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from privlm.cape.service.extraction import AnswerExtractor, collect_stream
from privlm.cape.service.messages import (
    MessageNames,
    NonTextParts,
    TextSlot,
    perturbed_fields,
    with_texts,
)
from privlm.cape.service.privacy import PrivateTexts, PromptPrivacy
from privlm.service import BearerKeys, FairScheduler, ModelEntry, ServiceError, ServiceOptions, catalog_router
from privlm.service import create_service_app as _create_service_app
from privlm.service.audit import AuditLog
from privlm.service.chat import (
    SSE_DONE,
    SSE_EVENT_SCHEMA,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    completion_id,
    now,
    sse_event,
)
from privlm.service.upstream import (
    ChatUpstream,
    NothingSentError,
    UpstreamAnswer,
    UpstreamStream,
    UpstreamStreamError,
    upstream_error,
)

MAX_REQUEST_BYTES = 4 * 2**20
UPSTREAM_PATH = "chat/completions"
logger = logging.getLogger(__name__)


class PrivlmOptions(BaseModel):
    """privlm's own request field (removed before forwarding)."""

    model_config = ConfigDict(extra="forbid", strict=True)  # strict: `true` is not epsilon 1, `0` not False
    epsilon: float | None = Field(None, gt=0, description="A lower epsilon per token for this request (never higher; "
                                                          "with the x-privlm-epsilon header too, the smaller one).")
    report: bool = Field(False, description="Also put the privacy report in the body (a `privlm` field).")


class PrivateChatRequest(ChatCompletionRequest):
    privlm: PrivlmOptions | None = None


@dataclass(frozen=True)
class ChatOptions:
    """``perturb_system``: also perturb system and developer messages. ``non_text_parts``: refuse (400) or pass
    through unchanged the non-text parts of perturbed messages. ``report_in_body``: the ``privlm`` body field
    on every answer (else only when a request asks for it). ``message_names``: the ``name`` of a perturbed
    message is dropped (and reported), perturbed like its text, or refused (400). ``perturb_tool_results``: also
    tool results and tool-call arguments, JSON-aware (:mod:`privlm.cape.service.messages`)."""

    perturb_system: bool = False
    non_text_parts: NonTextParts = "refuse"
    report_in_body: bool = False
    message_names: MessageNames = "drop"
    perturb_tool_results: bool = False


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
}


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
                   dropped: Sequence[str] = ()) -> dict[str, Any]:
    """The body's ``privlm`` field: the numbers of the headers, each text as it was sent, the fields dropped."""
    texts = []
    for slot, sent, report in zip(slots, result.texts, result.reports, strict=True):
        texts.append({"message": slot.message, "part": slot.part, "role": slot.role, "field": slot.field,
                      "path": slot.path,
                      "sent": slot.placed(sent), "tokens": 0 if report is None else report.n_tokens,
                      "tokens_perturbed": 0 if report is None else report.n_perturbed,
                      "tokens_changed": 0 if report is None else report.n_changed,
                      "tokens_unchanged": 0 if report is None else report.n_unchanged,
                      "epsilon_spent": 0.0 if report is None else report.accounting.get("privlm", 0.0)})
    return {"request_id": request_id, "mechanism": result.mechanism, "epsilon": result.epsilon,
            "epsilon_spent": result.spent, "epsilon_paper": result.paper_total, "unit": str(result.unit),
            "tokens": result.tokens, "tokens_perturbed": result.tokens_perturbed,
            "tokens_unchanged": result.tokens_unchanged, "budget_remaining": result.budget_remaining,
            "duration_ms": round(1e3 * result.seconds, 1),
            "texts": texts, "dropped": list(dropped),
            "guarantee": next((r.guarantee for r in result.reports if r is not None), None)}


def audit_record(result: PrivateTexts, slots: Sequence[TextSlot], request_id: str, principal: str,
                 model: str, stream: bool, dropped: Sequence[str] = ()) -> dict[str, Any]:
    """What the audit log keeps of a release: the perturbed texts and the report, never an original."""
    report = privacy_report(result, slots, request_id, dropped)
    return {**report, "principal": principal, "model": model, "stream": stream, "endpoint": "chat.completions"}


class _Call:
    """One request's private state: its id, principal, perturbed texts and options. Nothing outlives it."""

    def __init__(self, request: PrivateChatRequest, principal: str, result: PrivateTexts, slots: list[TextSlot],
                 report_in_body: bool, dropped: Sequence[str] = ()) -> None:
        self.request, self.principal, self.result, self.slots = request, principal, result, slots
        self.dropped = list(dropped)
        self.id = f"privlm-{uuid.uuid4().hex[:16]}"
        options = request.privlm
        self.report = report_in_body or bool(options and options.report)
        self.headers = privacy_headers(result, self.id, self.dropped)
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
        """The request to forward: the perturbed texts in place, the dropped fields and privlm's field removed,
        nothing else changed."""
        sent = self.request.model_dump(mode="json", exclude_unset=True, exclude={"privlm"})
        return with_texts(sent, self.slots, self.result.texts, self.dropped)

    def report_field(self) -> dict[str, Any]:
        return privacy_report(self.result, self.slots, self.id, self.dropped)

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


def chat_router(privacy: PromptPrivacy, upstream: ChatUpstream, *, auth: BearerKeys,
                options: ChatOptions = ChatOptions(), audit: AuditLog | None = None,
                extractor: AnswerExtractor | None = None) -> APIRouter:
    """The private ``POST /v1/chat/completions`` (see the module doc)."""
    auth = auth.charging(privacy.ledger)  # callers named as the ledger names them, in the audit log too
    router = APIRouter(tags=["chat"])
    perturbing = FairScheduler(1)  # one forward pass at a time on the device model, callers taking turns

    async def privatize(request: PrivateChatRequest, principal: str, header_epsilon: str | None
                        ) -> tuple[PrivateTexts, list[TextSlot], list[str]]:
        epsilon = _request_epsilon(privacy, request, header_epsilon)
        assistant = extractor is not None
        fields = perturbed_fields(request, perturb_system=options.perturb_system, perturb_assistant=assistant,
                                  non_text_parts=options.non_text_parts, message_names=options.message_names,
                                  perturb_tool_results=options.perturb_tool_results)
        slots, texts = fields.slots, fields.texts
        privacy.check_lengths(texts)
        caller = principal if not auth.open else f"request-{uuid.uuid4()}"
        async with perturbing.turn(caller):
            result = await asyncio.to_thread(privacy.privatize, texts, principal=principal, epsilon=epsilon)
        return result, slots, fields.dropped

    async def chat_completions(request: PrivateChatRequest, principal: str = Depends(auth.dependency),
                               x_privlm_epsilon: str | None = Header(None)) -> Response:
        result, slots, dropped = await privatize(request, principal, x_privlm_epsilon)
        call = _Call(request, principal, result, slots, options.report_in_body, dropped)
        try:
            if audit is not None:
                await asyncio.to_thread(audit.write, "released", audit_record(
                    result, slots, call.id, principal, request.model, bool(request.stream), dropped))
        except Exception as error:  # an unrecorded release is not sent: nothing crossed
            raise await failed_after_release(call, error, nothing_sent=True) from None
        try:
            if request.stream:
                return await _stream(upstream, call, extractor, audit)
            answer = await upstream.post(UPSTREAM_PATH, call.body())
            await asyncio.to_thread(_audit_upstream, audit, call, answer.status)
            return await _complete(answer, call, extractor)
        except Exception as error:  # charged already, whatever failed: see failed_after_release
            raise await failed_after_release(call, error, nothing_sent=isinstance(error, NothingSentError)
                                             ) from None

    async def failed_after_release(call: _Call, error: Exception, *, nothing_sent: bool) -> ServiceError:
        """The answer to any failure once the caller was charged: the release refunded when it provably never
        left this machine; the report in the headers; no retry by OpenAI's SDKs unless refunded (a retry is a
        new release and a new charge); audited when the log can be written. Never the text."""
        if nothing_sent:
            try:
                call.refunded(await asyncio.to_thread(privacy.refund, call.result, principal=call.principal),
                              charged=privacy.ledger is not None)
            except Exception as refund_error:  # the charge stands: the safe side; the answer then says not to retry
                logger.warning("request %s: the refund could not be recorded (%s)", call.id,
                               type(refund_error).__name__)
        failure = error if isinstance(error, ServiceError) else ServiceError(
            500, f"the gateway failed after the release ({type(error).__name__})", type="server_error",
            code="failed_after_release")
        try:
            await asyncio.to_thread(_audit_upstream, audit, call, failure.status, failure.detail.code)
        except Exception as audit_error:  # logged by type only: an exception's message may quote the text
            logger.warning("request %s: the audit log could not record its failure (%s)", call.id,
                           type(audit_error).__name__)
        failure.headers = {**(failure.headers or {}), **call.failure_headers()}
        return failure

    router.post("/v1/chat/completions", response_class=JSONResponse,
                responses={200: {"model": ChatCompletion, "headers": PRIVACY_HEADERS,
                                 "description": "The upstream's answer (JSON, or with stream: SSE chunks)",
                                 "content": {"text/event-stream": {"schema": SSE_EVENT_SCHEMA}}}}
                )(chat_completions)
    return router


def _request_epsilon(privacy: PromptPrivacy, request: PrivateChatRequest, header: str | None) -> float:
    """The request's epsilon: the smaller of the body's ``privlm.epsilon`` and the ``x-privlm-epsilon`` header
    (each checked; an absent one counts as the gateway's own), so that neither can raise the other."""
    body = request.privlm.epsilon if request.privlm else None
    from_body = privacy.resolve_epsilon(body, param="privlm.epsilon")
    if header is None:
        return from_body
    try:
        value = float(header)
    except ValueError:
        raise ServiceError(400, "the x-privlm-epsilon header must be a number", param="x-privlm-epsilon",
                           code="invalid_epsilon") from None
    return min(from_body, privacy.resolve_epsilon(value, param="x-privlm-epsilon"))


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
    if not answer.ok or not (call.report or extractor is not None):
        return Response(answer.body, status_code=answer.status, headers=headers)
    try:
        body = json.loads(answer.body)
    except ValueError:
        raise ServiceError(502, "the upstream answered with invalid JSON", type="upstream_error",
                           code="upstream_invalid") from None
    if extractor is not None:
        body = await asyncio.to_thread(extractor.rewrite_completion, call.user_prompt(), body,
                                       limit=call.answer_limit())
    if call.report:
        body["privlm"] = call.report_field()
    headers.pop("content-type", None)
    return JSONResponse(body, status_code=answer.status, headers=headers)


async def _stream(upstream: ChatUpstream, call: _Call, extractor: AnswerExtractor | None,
                  audit: AuditLog | None) -> Response:
    """Open the upstream's stream; an error answer comes back whole (within the cap), a stream event by event."""
    stack = AsyncExitStack()
    answer = await stack.enter_async_context(upstream.stream(UPSTREAM_PATH, call.body()))
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


def create_chat_gateway(privacy: PromptPrivacy, upstream: ChatUpstream, *, chat_models: Sequence[str] = (),
                        api_keys: Sequence[str] = (), options: ChatOptions = ChatOptions(),
                        audit: AuditLog | None = None, extractor: AnswerExtractor | None = None,
                        max_request_bytes: int = MAX_REQUEST_BYTES, **service: Unpack[ServiceOptions]) -> FastAPI:
    """A gateway with only the private chat endpoint (``privlm gateway`` composes it with the others)."""
    auth = BearerKeys(api_keys)
    offered = [ModelEntry(id=name, owned_by="upstream") for name in chat_models]
    routers = [chat_router(privacy, upstream, auth=auth, options=options, audit=audit, extractor=extractor),
               catalog_router(offered)]
    return _create_service_app(title="privlm gateway (OpenAI-compatible private chat)", routers=routers, auth=auth,
                               max_request_bytes=max_request_bytes, lifespan=closing_upstream(upstream),
                               health=lambda: {"mechanism": privacy.mechanism, "epsilon": privacy.epsilon},
                               **service)


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
