"""The privacy step as a LiteLLM guardrail: LiteLLM's Generic Guardrail API,
``POST /beta/litellm_basic_guardrail_api``.

LiteLLM (its ``generic_guardrail_api`` hook, with ``mode: pre_call``) sends each request's texts here before it
calls the model; this service perturbs them with the gateway's mechanism (Cape by default; any of the registry) and
answers with the perturbed texts, which LiteLLM puts back in place of the originals, one for one, in order. LiteLLM
is not imported: the models below follow its contract
(``litellm/types/proxy/guardrails/guardrail_hooks/generic_guardrail_api.py`` and the page
https://docs.litellm.ai/docs/adding_provider/generic_guardrail_api).

What LiteLLM sends, and what this endpoint does with it:
  - ``texts``: every text of the request, in order. For a chat request, that is the text of every message
    (system, user, assistant, tool), one string per string ``content`` and one per text part of a list
    ``content``. All of them are perturbed in one call of :meth:`PromptPrivacy.privatize`: one charge to one
    principal's budget, one fresh generator. The answer holds exactly as many texts, in the same order
    (LiteLLM maps them back by index; blank texts stay blank).
  - ``input_type``: ``"request"`` is perturbed; ``"response"`` (the model's answer, in ``post_call`` mode) is
    not the user's prompt, and perturbing it would protect nothing of theirs: it is answered ``NONE``, free.
  - ``request_data``: the caller's ids. The budget is charged to ``"litellm-key:" + user_api_key_hash`` *and*
    ``"litellm-end-user:" + user_api_key_end_user_id`` together (``guardrail_charge="key-and-end-user"``, the default: a
    joint principal, both charged in one transaction, only if both have budget left), to the key alone
    (``"key"``) or to the end user alone (``"end-user"``: any key holder can name a new end user and so mint a
    fresh budget). A request without an id it needs is BLOCKED when there is a ledger (it is never charged to a
    shared principal); without a ledger nothing is charged, so it goes through, under the ids it has (or
    :data:`UNIDENTIFIED`).
  - ``additional_provider_specific_params.epsilon`` (LiteLLM's config) and the client's ``x-privlm-epsilon``
    header, which LiteLLM 1.108.7 forwards in ``request_headers`` only when the guardrail's ``extra_headers``
    names it (otherwise as ``"[present]"``, which is BLOCKED: the client asked for an epsilon it would not get):
    each may lower the epsilon per token, never raise it; the smallest applies (a header's values joined as
    ``"6, 1"`` count one by one). The client's dynamic guardrail
    params (``extra_body``) never reach a pre-call guardrail in 1.108.7 (docs/litellm.md).
  - ``images``: the mechanisms perturb text only. ``guardrail_images="block"`` (default) blocks a request with images;
    ``guardrail_images="pass"`` lets them through unchanged (they reach the model as they are).

Fail closed. LiteLLM blocks the request when a guardrail answers an HTTP error, unless its config says
``unreachable_fallback: fail_open`` (network errors, timeouts and HTTP 503 then let the ORIGINAL request through) or
``fail_on_error: false`` (any error does). So every failure that concerns a valid request is answered ``200`` with
``action: BLOCKED`` and a ``blocked_reason`` naming the cause (and, for a budget, what is left), never the text:
budget exhausted, privacy step failed, images, over-long texts, an epsilon above the limit, a missing id, an audit
log that cannot be written, or any unexpected error. So is every JSON object that does not hold a valid request (no
``request_data`` or ``request_data: null``, no or another ``input_type``, ``texts`` that are not strings, a field of
the wrong type): the reason names the fields, never their values; and every body that is not a JSON object at all
(invalid JSON, nested too deep to parse, an array, ``null``): the route reads its body itself, so that FastAPI's 400
never answers it. So are the scaffolding's refusals of a request it cannot take now or at all: the route full, too
many open connections, a body too large or too slow (:data:`REFUSAL_ANSWERS`). The route has in-flight places of its
own (:func:`guardrail_lanes`, ``guardrail_max_in_flight``), apart from the service's ``max_in_flight`` and its
per-caller quarter: a burst from LiteLLM, one caller, queues for the device model up to that bound, and only beyond
it is BLOCKED. And so is a request whose answer is not ready ``guardrail_deadline`` seconds (300 by default: below
LiteLLM 1.108.7's default guardrail timeout, 600 s) after its body arrived, queue wait included: by then LiteLLM may
have given up on it (its own timeout; with ``fail_open`` it then forwards the original). No charge of it stands: the
deadline is checked before the request is handed to the device model (nothing charged), and a release it overtakes
(waiting for a batch, or in one) is seen through and its charge given back, as is one charged in time but done, or
audited, after the deadline; the audit log says which (a refund the ledger cannot record leaves the charge standing:
``refunded`` is then null). Nothing but the answer follows the last check: the memory write runs in the background,
and a later request of the same principal waits for it. Only a missing or wrong key (401) and a wrong ``Host`` get
an error status (OpenAI's shape): with ``fail_on_error: false`` LiteLLM lets the original through on those, so keep
LiteLLM's default.

The route has no auth of its own: the app it is mounted in guards it (``Authorization: Bearer`` or
``x-api-key``, where LiteLLM sends its ``api_key`` setting; docs/litellm.md).
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import Coroutine, Mapping, Sequence
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from privlm.accounting import BudgetExhaustedError, joint_principal
from privlm.chat.service.audit import AuditLog
from privlm.chat.service.completions import privacy_headers
from privlm.chat.service.memory import ConversationMemory, EarlierRelease, release_texts
from privlm.chat.service.privacy import PrivacyBatcher, PrivateTexts, PromptPrivacy
from privlm.service import ServiceError
from privlm.service.app import field_path
from privlm.service.limits import MAX_IN_FLIGHT, Lane
from privlm.settings.chat import ChargeTo, ChatOptions, ImagePolicy

logger = logging.getLogger(__name__)
GUARDRAIL_PATH = "/beta/litellm_basic_guardrail_api"
KEY_PREFIX = "litellm-key:"
END_USER_PREFIX = "litellm-end-user:"
UNIDENTIFIED = "litellm-unidentified"  # only without a ledger: nothing is charged to it
EPSILON_PARAM = "additional_provider_specific_params.epsilon"
EPSILON_HEADER = "x-privlm-epsilon"  # the chat gateway's header; LiteLLM forwards it if extra_headers names it
LITELLM_HIDDEN_VALUE = "[present]"  # what LiteLLM sends in request_headers for a header it does not forward
_KEY_ID = ("user_api_key_hash", KEY_PREFIX, "virtual key")
_END_USER_ID = ("user_api_key_end_user_id", END_USER_PREFIX, "end user (the request's `user` field)")
_CHARGED_IDS = {"key-and-end-user": (_KEY_ID, _END_USER_ID), "key": (_KEY_ID,), "end-user": (_END_USER_ID,)}
Action = Literal["NONE", "GUARDRAIL_INTERVENED", "BLOCKED"]


class LiteLLMRequestData(BaseModel):
    """``request_data``: who is calling, as LiteLLM's ``GenericGuardrailAPIMetadata`` (every key optional)."""

    model_config = ConfigDict(extra="allow")
    user_api_key_hash: str | None = Field(None, description="LiteLLM's hash of the virtual key used.")
    user_api_key_alias: str | None = None
    user_api_key_user_id: str | None = None
    user_api_key_user_email: str | None = None
    user_api_key_team_id: str | None = None
    user_api_key_team_alias: str | None = None
    user_api_key_end_user_id: str | None = Field(None, description="The end user (the request's `user`).")
    user_api_key_org_id: str | None = None


class GuardrailRequest(BaseModel):
    """What LiteLLM posts (``GenericGuardrailAPIRequest.model_dump(mode="json")``); fields it adds later pass."""

    model_config = ConfigDict(extra="allow")
    input_type: Literal["request", "response"]
    texts: list[str] | None = Field(None, description="Every text of the request, in order.")
    images: list[str] | None = Field(None, description="Image URLs or base64 data.")
    tools: list[dict[str, Any]] | None = Field(None, description="Tool definitions (OpenAI's format).")
    tool_calls: list[dict[str, Any]] | None = None
    structured_messages: list[dict[str, Any]] | None = None
    request_data: LiteLLMRequestData
    request_headers: dict[str, str] | None = None
    litellm_call_id: str | None = None
    litellm_trace_id: str | None = None
    litellm_version: str | None = None
    model: str | None = None
    additional_provider_specific_params: dict[str, Any] | None = None


class GuardrailResponse(BaseModel):
    """What LiteLLM reads (``GenericGuardrailAPIResponse.from_dict``). ``texts`` replace the request's, by index."""

    action: Action
    blocked_reason: str | None = None
    texts: list[str] | None = None
    images: list[str] | None = None
    tools: list[dict[str, Any]] | None = None


class _BlockedError(Exception):
    """A request that must not reach the model; the message names why, never the text. ``audited``: more for its
    audit record (numbers, never text)."""

    def __init__(self, reason: str, headers: Mapping[str, str] | None = None,
                 audited: Mapping[str, Any] | None = None) -> None:
        super().__init__(reason)
        self.reason, self.headers, self.audited = reason, dict(headers or {}), dict(audited or {})


MAX_NAMED_ERRORS = 5


def _json_object(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object, read here rather than by FastAPI, so that a body that is not one (invalid JSON,
    nested too deep to parse, not UTF-8, an array, a string...) is BLOCKED like any other bad request, not a 400."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as error:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise _BlockedError(f"privlm: the body is not JSON that can be read ({type(error).__name__}); nothing may "
                            "be sent") from None
    if not isinstance(body, dict):
        raise _BlockedError(f"privlm: the body is a JSON {_JSON_KINDS.get(type(body), 'value')}, not LiteLLM's "
                            "guardrail request (an object); nothing may be sent")
    return body


_JSON_KINDS = {list: "array", str: "string", int: "number", float: "number", bool: "boolean", type(None): "null"}


def _parsed(body: dict[str, Any]) -> GuardrailRequest:
    """LiteLLM's request, or BLOCKED naming what is wrong where (never a value: it could be the user's text)."""
    try:
        return GuardrailRequest.model_validate(body)
    except ValidationError as error:
        problems = error.errors(include_url=False, include_input=False, include_context=False)
        named = "; ".join(f"{field_path(problem['loc']) or 'body'}: {problem['msg'][:100]}"
                          for problem in problems[:MAX_NAMED_ERRORS])
        more = f" (and {len(problems) - MAX_NAMED_ERRORS} more)" if len(problems) > MAX_NAMED_ERRORS else ""
        raise _BlockedError(f"privlm: the body is not LiteLLM's guardrail request ({named}{more}); nothing may be "
                            "sent") from None


def _answer(response: GuardrailResponse, headers: Mapping[str, str] | None = None) -> JSONResponse:
    return JSONResponse(response.model_dump(exclude_none=True), headers=dict(headers or {}))


def blocked_refusal(refusal: JSONResponse) -> Response:
    """The scaffolding's refusal of a guardrail request (busy, too many in flight for the caller, too large, too
    slow) as a ``200 BLOCKED`` naming it: with ``fail_open`` LiteLLM would forward the original on the error status
    (:data:`REFUSAL_ANSWERS`, which every app serving the guardrail passes to the scaffolding)."""
    error = json.loads(bytes(refusal.body))["error"]
    return _answer(GuardrailResponse(action="BLOCKED", blocked_reason=f"privlm: {error['message']}; nothing may be "
                                                                      "sent"))


REFUSAL_ANSWERS = {GUARDRAIL_PATH: blocked_refusal}


MAX_ID_CHARS = 256  # a key hash or an end-user id; the ledger keeps it


def _memory_principal(data: LiteLLMRequestData, charged: str) -> str:
    """Whose conversation memory a request reads: the key *and* the end user whenever LiteLLM names both, whatever
    is charged, so that one end user never learns (from a free, faster answer) that another sent a text."""
    ids = [prefix + value for field, prefix, _ in _CHARGED_IDS["key-and-end-user"]
           if (value := (getattr(data, field) or "").strip())]
    return joint_principal(*ids) if len(ids) == 2 else charged


def _principal(data: LiteLLMRequestData, charge_to: ChargeTo, privacy: PromptPrivacy) -> str:
    """The principal charged: LiteLLM's key hash, its end-user id, or both (a joint principal: the ledger charges
    each, and only if each has budget left). An id missing with a ledger: blocked."""
    found: list[str] = []
    missing: list[str] = []
    for field, prefix, _ in _CHARGED_IDS[charge_to]:
        value = (getattr(data, field) or "").strip()
        if len(value) > MAX_ID_CHARS:
            raise _BlockedError(f"privlm: request_data.{field} is longer than {MAX_ID_CHARS} characters")
        (found if value else missing).append(prefix + value if value else f"request_data.{field}")
    if privacy.ledger is None:  # nothing is charged: the ids only name the caller (audit log, turns)
        return joint_principal(*found) if found else UNIDENTIFIED
    if missing:
        who = " and per ".join(who for _, _, who in _CHARGED_IDS[charge_to])
        raise _BlockedError(f"privlm: {' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} missing; "
                            f"budgets are charged per {who}, and a request without one is not charged to a shared "
                            "budget")
    return joint_principal(*found)


def _epsilon(request: GuardrailRequest, privacy: PromptPrivacy) -> float:
    """The smallest of the config's ``additional_provider_specific_params.epsilon`` and every value of the client's
    ``x-privlm-epsilon`` header as LiteLLM forwards it (each checked; an absent one counts as the guardrail's own),
    so that none can raise another: a header repeated and joined into one value (``"6, 1"``, as HTTP allows: a proxy
    appending its cap) gives its smallest, as on the chat route. A header LiteLLM forwarded as ``[present]`` only is
    blocked: the client asked for an epsilon it would not get."""
    headers: list[tuple[str, str]] = []
    for name, value in (request.request_headers or {}).items():
        if name.lower() != EPSILON_HEADER:
            continue
        if value == LITELLM_HIDDEN_VALUE:
            raise _BlockedError(f"privlm: the client sent {EPSILON_HEADER}, but LiteLLM forwarded only that it was "
                                f"there; add {EPSILON_HEADER} to the guardrail's extra_headers")
        headers.append((value, f"request_headers.{EPSILON_HEADER}"))
    configured = (request.additional_provider_specific_params or {}).get("epsilon")
    return privacy.lowest_epsilon([(configured, EPSILON_PARAM)], headers)


def _texts(request: GuardrailRequest, images: ImagePolicy) -> list[str]:
    if request.texts is None:
        raise _BlockedError("privlm: the request holds no `texts`, so nothing could be perturbed (is `texts` in "
                       "LiteLLM's exclude_payload_fields?)")
    if request.images and images == "block":
        raise _BlockedError(f"privlm: the request holds {len(request.images)} image(s); Cape perturbs text only, and "
                       "this guardrail blocks images")
    return request.texts


def _budget_reason(error: BudgetExhaustedError) -> _BlockedError:
    return _BlockedError(f"privlm: {error}", {"x-privlm-budget-remaining": f"{error.remaining:.6g}",
                                          "x-privlm-budget": f"{error.budget:.6g}"})


def _released_record(result: PrivateTexts, request: GuardrailRequest, request_id: str, principal: str,
                     action: Action) -> dict[str, Any]:
    """What the audit log keeps of a release: the perturbed texts and the report numbers, never an original."""
    return {**_ids(request, request_id), "principal": principal, "action": action, "mechanism": result.mechanism,
            "epsilon": result.epsilon, "epsilon_spent": result.spent, "epsilon_paper": result.paper_total,
            "unit": str(result.unit), "tokens": result.tokens, "tokens_perturbed": result.tokens_perturbed,
            "tokens_changed": result.tokens_changed, "budget_remaining": result.budget_remaining,
            "texts": list(result.texts),
            "guarantee": next((r.guarantee for r in result.reports if r is not None), None)}


def _ids(request: GuardrailRequest, request_id: str) -> dict[str, Any]:
    return {"request_id": request_id, "endpoint": "litellm.guardrail", "input_type": request.input_type,
            "litellm_call_id": request.litellm_call_id, "litellm_trace_id": request.litellm_trace_id,
            "model": request.model}


_BODY_DESCRIPTION = ("LiteLLM's GenericGuardrailAPIRequest, a JSON object (`input_type`, `texts`, `request_data`, "
                     "...: the `GuardrailRequest` model of privlm.chat.service.guardrail). Every body is answered "
                     "200: one that is not a valid request (none, not JSON, not an object, a field at fault) is "
                     "BLOCKED, naming why.")
# The body is read by the route itself (:func:`_json_object`), so FastAPI would not document it: declared here, as
# what the route takes, every body (none, or any JSON value) answered 200; the fields of one that holds a request
# are those of `GuardrailRequest`.
_BODY_DOCUMENT = {"requestBody": {"required": False, "description": _BODY_DESCRIPTION,
                                  "content": {"application/json": {"schema": {}}}}}


def guardrail_lanes(max_in_flight: int = MAX_IN_FLIGHT) -> dict[str, Lane]:
    """The route's own in-flight places (:class:`~privlm.service.limits.Lane`), for the app that serves it: LiteLLM
    is one caller, so the service's per-caller quarter would refuse most of a burst that could have queued."""
    return {GUARDRAIL_PATH: Lane(max_in_flight, param="guardrail_max_in_flight")}


class GuardrailRoutes:
    """``POST /beta/litellm_basic_guardrail_api`` (see the module doc): its steps and the state its requests share.
    Mount :meth:`router` behind the app's keys, with :data:`REFUSAL_ANSWERS` and :func:`guardrail_lanes`.
    ``memory``: conversation memory (a text released before for the same principal is sent as it was, free: LiteLLM
    sends the whole history every turn). ``batcher``: the device model's batches, shared with the app's chat route
    (default: this route's own). ``options``: whom it charges, what it does with images, and its deadline (seconds
    from the body's arrival by which the privacy step must be done, queue wait included, else BLOCKED and
    uncharged; keep it below LiteLLM's guardrail timeout)."""

    def __init__(self, privacy: PromptPrivacy, *, options: ChatOptions | None = None, audit: AuditLog | None = None,
                 memory: ConversationMemory | None = None, batcher: PrivacyBatcher | None = None) -> None:
        options = options or ChatOptions(guardrail=True)  # its values checked when made
        self.charge_to, self.images, self.deadline = (options.guardrail_charge, options.guardrail_images,
                                                      options.guardrail_deadline)
        self.privacy, self.audit, self.memory = privacy, audit, memory
        self.perturbing = batcher or privacy.batched()  # shared with the app's chat route, if any: one device model
        # Work that outlives its request (an overtaken release given back, a memory write after the answer): held
        # here until it finishes, since the loop keeps only weak references to tasks.
        self.background: set[asyncio.Task[None]] = set()
        self.writing: dict[str, set[asyncio.Task[None]]] = {}  # memory writes still running, by memory principal

    def router(self) -> APIRouter:
        router = APIRouter(tags=["litellm"])
        router.add_api_route(GUARDRAIL_PATH, self.guardrail, methods=["POST"], response_model=GuardrailResponse,
                             response_model_exclude_none=True,
                             summary="LiteLLM's Generic Guardrail API: perturb a request's texts with Cape",
                             openapi_extra=_BODY_DOCUMENT,
                             responses={200: {"description": "NONE, GUARDRAIL_INTERVENED with the perturbed texts, "
                                                             "or BLOCKED with the reason (every failure: fail "
                                                             "closed)"}})
        return router

    def in_background(self, work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.ensure_future(work)
        self.background.add(task)
        task.add_done_callback(self.background.discard)
        return task

    async def record(self, event: str, entry: Mapping[str, Any]) -> bool:
        """Write to the audit log, if any; False if it could not be written."""
        if self.audit is None:
            return True
        try:
            await asyncio.to_thread(self.audit.write, event, entry)
        except Exception:  # the caller decides: a release that cannot be recorded is blocked
            return False
        return True

    async def refund(self, result: PrivateTexts, principal: str) -> float | None:
        """Give back what a release that never left cost; None if the ledger could not (the charge stands)."""
        try:
            await asyncio.to_thread(self.privacy.refund, result, principal=principal)
        except Exception as error:
            logger.warning("a refund could not be recorded; the charge stands (%s)", type(error).__name__)
            return None
        return result.spent

    def overtaken(self, audited: Mapping[str, Any], given_back: bool = True) -> _BlockedError:
        """BLOCKED for the deadline; ``given_back``: False when the ledger could not record the refund."""
        charge = "no charge stands" if given_back else "its charge stands (the ledger could not record the refund)"
        return _BlockedError(f"privlm: the guardrail's deadline ({self.deadline:g} s) passed before the answer was "
                             f"ready (queue wait included); nothing may be sent, and {charge}",
                             audited={"guardrail_deadline_s": self.deadline, **audited})

    async def too_late(self, result: PrivateTexts, principal: str) -> _BlockedError:
        """A release charged in time but not answered by the deadline: it never leaves, so it is given back."""
        refunded = await self.refund(result, principal)
        return self.overtaken({"refunded": refunded}, given_back=refunded is not None)

    def give_back_when_done(self, release: asyncio.Future[PrivateTexts], principal: str,
                            ids: Mapping[str, Any]) -> None:
        """A release the deadline overtook, never to be answered: a batch may have taken it (and charged it, or be
        about to), and cancelling it then would lose what it charged. So it is seen through, and given back."""
        async def give_back() -> None:
            try:
                result = await release
            except Exception:  # refused, or failed (whose charge stands, as on every path): nothing to give back
                return
            refunded = await self.refund(result, principal)
            await self.record("refunded", {**ids, "principal": principal, "refunded": refunded,
                                      "why": "the guardrail's deadline passed before this release was done; it "
                                             "was never answered"})

        self.in_background(give_back())

    async def remember(self, kept: ConversationMemory, principal: str,
                       new: Sequence[tuple[str, EarlierRelease]]) -> None:
        try:
            await asyncio.to_thread(kept.remember_releases, principal, new)
        except Exception as error:  # a later repeat is then released afresh, and charged
            logger.warning("conversation memory could not keep a release (%s)", type(error).__name__)

    def remember_after_answer(self, kept: ConversationMemory, principal: str,
                              new: Sequence[tuple[str, EarlierRelease]]) -> None:
        """Keep releases in the background, so that a slow write cannot hold the answer past the deadline; a later
        request of the same principal waits for the write (:meth:`written`), so that it still finds them."""
        writes = self.writing.setdefault(principal, set())
        task = self.in_background(self.remember(kept, principal, new))
        writes.add(task)

        def done(finished: asyncio.Task[None]) -> None:
            writes.discard(finished)
            if not writes and self.writing.get(principal) is writes:
                del self.writing[principal]

        task.add_done_callback(done)

    async def written(self, principal: str, deadline_at: float) -> None:
        """The principal's memory writes still running, waited for until the deadline at most (a repeat sent before
        its release was kept would otherwise be released afresh, and charged)."""
        if writes := self.writing.get(principal):
            await asyncio.wait(set(writes), timeout=max(0.0, deadline_at - asyncio.get_running_loop().time()))

    async def perturb(self, request: GuardrailRequest, request_id: str, deadline_at: float) -> JSONResponse:
        loop = asyncio.get_running_loop()
        ids = _ids(request, request_id)
        texts = _texts(request, self.images)
        principal = _principal(request.request_data, self.charge_to, self.privacy)
        try:
            epsilon = _epsilon(request, self.privacy)
        except ServiceError as error:
            raise _BlockedError(f"privlm: {error.detail.message}") from None

        async def perturb_texts(fresh: list[str]) -> PrivateTexts:
            left = deadline_at - loop.time()
            if left <= 0:  # checked before the charge: nothing was charged
                raise self.overtaken({"charged": 0})
            release = asyncio.ensure_future(self.perturbing.privatize(fresh, principal=principal, epsilon=epsilon,
                                                                 caller=principal))
            try:
                await asyncio.wait({release}, timeout=left)
            finally:
                if not release.done():  # overtaken (or this request cancelled): never answered
                    self.give_back_when_done(release, principal, ids)
            if not release.done():
                raise self.overtaken({"refund": "once its release is done: a `refunded` record follows"})
            return release.result()

        remembering = _memory_principal(request.request_data, principal)
        await self.written(remembering, deadline_at)
        try:
            recalled = await release_texts(self.memory, remembering, texts, perturb_texts,
                                           check=lambda fresh: self.privacy.check_lengths(fresh, param="texts"))
        except BudgetExhaustedError as error:
            raise _budget_reason(error) from None
        except ServiceError as error:  # too long, memory unreadable, PrivacyStepError: the messages name no text
            raise _BlockedError(f"privlm: {error.detail.message}") from None
        result = recalled.result
        if loop.time() > deadline_at:  # charged, and too late to answer
            raise await self.too_late(result, principal)
        changed = any(sent != text for sent, text in zip(result.texts, texts, strict=True))
        action: Action = "GUARDRAIL_INTERVENED" if changed else "NONE"
        if not await self.record("released", _released_record(result, request, request_id, principal, action)):
            # Blocked, so nothing of it leaves: the charge is given back, as the chat gateway does.
            kept = "" if await self.refund(result, principal) is not None else \
                "; its charge stands (the ledger could not record the refund)"
            raise _BlockedError(f"privlm: the audit log could not be written; nothing may be sent unrecorded{kept}")
        if loop.time() > deadline_at:  # the audit write took the rest of the time: the answer would come too late
            raise await self.too_late(result, principal)
        headers = privacy_headers(result, request_id)
        if self.memory is not None:
            if recalled.new:  # after the deadline's last check: a release given back is never kept
                self.remember_after_answer(self.memory, remembering, recalled.new)
            headers["x-privlm-texts-remembered"] = str(sum(recalled.remembered))
        return _answer(GuardrailResponse(action=action, texts=list(result.texts)), headers)

    async def guardrail(self, http: Request) -> JSONResponse:
        # The body is in: LiteLLM's own timeout has been running since it sent it.
        deadline_at = asyncio.get_running_loop().time() + self.deadline
        request_id = f"privlm-{uuid.uuid4().hex[:16]}"
        ids: dict[str, Any] = {"request_id": request_id, "endpoint": "litellm.guardrail"}
        try:
            request = _parsed(_json_object(await http.body()))
            ids = _ids(request, request_id)
            if request.input_type == "response":
                await self.record("not_perturbed", {**_ids(request, request_id), "action": "NONE",
                                               "why": "a model's answer is not the user's prompt"})
                return _answer(GuardrailResponse(action="NONE"), {"x-privlm-request-id": request_id})
            return await self.perturb(request, request_id, deadline_at)
        except _BlockedError as blocked:
            reason, headers, audited = blocked.reason, blocked.headers, blocked.audited
        except Exception as error:  # fail closed: whatever went wrong, the original stays here
            reason = f"privlm: the privacy step failed ({type(error).__name__}); nothing may be sent"
            headers, audited = {}, {}
        await self.record("blocked", {**ids, "action": "BLOCKED", "blocked_reason": reason, **audited})
        return _answer(GuardrailResponse(action="BLOCKED", blocked_reason=reason),
                       {**headers, "x-privlm-request-id": request_id})
