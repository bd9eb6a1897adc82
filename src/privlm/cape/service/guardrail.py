"""Cape as a LiteLLM guardrail: LiteLLM's Generic Guardrail API, ``POST /beta/litellm_basic_guardrail_api``.

LiteLLM (its ``generic_guardrail_api`` hook, with ``mode: pre_call``) sends each request's texts here before it
calls the model; this service perturbs them with Cape and answers with the perturbed texts, which LiteLLM puts
back in place of the originals, one for one, in order. LiteLLM is not imported: the models below follow its
contract (``litellm/types/proxy/guardrails/guardrail_hooks/generic_guardrail_api.py`` and the page
https://docs.litellm.ai/docs/adding_provider/generic_guardrail_api).

What LiteLLM sends, and what this endpoint does with it:
  - ``texts``: every text of the request, in order. For a chat request, that is the text of every message
    (system, user, assistant, tool), one string per string ``content`` and one per text part of a list
    ``content``. All of them are perturbed in one call of :meth:`PromptPrivacy.privatize`: one charge to one
    principal's budget, one fresh generator. The answer holds exactly as many texts, in the same order
    (LiteLLM maps them back by index; blank texts stay blank).
  - ``input_type``: ``"request"`` is perturbed; ``"response"`` (the model's answer, in ``post_call`` mode) is
    not the user's prompt, and perturbing it would protect nothing of theirs: it is answered ``NONE``, free.
  - ``request_data``: the caller's ids. The budget is charged to ``"litellm-key:" + user_api_key_hash``
    (``charge_to="key"``) or to ``"litellm-end-user:" + user_api_key_end_user_id`` (``charge_to="end-user"``).
    A request without that id is BLOCKED when there is a ledger (it is never charged to a shared principal);
    without a ledger nothing is charged, so it goes through, under the principal :data:`UNIDENTIFIED`.
  - ``additional_provider_specific_params.epsilon``: a lower epsilon per token (from LiteLLM's config, or
    from the client's dynamic guardrail params); never a higher one.
  - ``images``: Cape perturbs text only. ``images="block"`` (default) blocks a request with images;
    ``images="pass"`` lets them through unchanged (they reach the model as they are).

Fail closed. LiteLLM blocks the request when a guardrail answers an HTTP error, unless its config says
``unreachable_fallback: fail_open`` (network errors, timeouts and HTTP 503 then let the ORIGINAL request
through) or ``fail_on_error: false`` (any error does). So every failure that concerns a valid request is
answered ``200`` with ``action: BLOCKED`` and a ``blocked_reason`` naming the cause (and, for a budget, what
is left), never the text: budget exhausted, privacy step failed, images, over-long texts, an epsilon above
the limit, a missing id, an audit log that cannot be written, or any unexpected error. So is every JSON object
that does not hold a valid request (no ``request_data`` or ``request_data: null``, no or another ``input_type``,
``texts`` that are not strings, a field of the wrong type): the reason names the fields, never their values.
So are the scaffolding's refusals of a request it cannot take now or at all: busy (``max_in_flight``), too many
in flight for the caller, a body too large or too slow (:data:`REFUSAL_ANSWERS`). Only a body that is not a JSON
object at all gets a 4xx (OpenAI's error shape), as do a missing or wrong key (401) and a wrong ``Host``: with
``fail_on_error: false`` LiteLLM lets the original through on those, so keep LiteLLM's default.

The route has no auth of its own: the app it is mounted in guards it (``Authorization: Bearer`` or
``x-api-key``, where LiteLLM sends its ``api_key`` setting; docs/litellm.md).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal, Unpack

from fastapi import APIRouter, Body, FastAPI
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from privlm.accounting import BudgetExhaustedError
from privlm.cape.service.chat import privacy_headers
from privlm.cape.service.privacy import PrivateTexts, PromptPrivacy
from privlm.service import BearerKeys, FairScheduler, ServiceError, ServiceOptions, create_service_app
from privlm.service.app import field_path
from privlm.service.audit import AuditLog

GUARDRAIL_PATH = "/beta/litellm_basic_guardrail_api"
MAX_REQUEST_BYTES = 16 * 2**20  # base64 images count too (they are then blocked or passed, never read)
KEY_PREFIX = "litellm-key:"
END_USER_PREFIX = "litellm-end-user:"
UNIDENTIFIED = "litellm-unidentified"  # only without a ledger: nothing is charged to it
EPSILON_PARAM = "additional_provider_specific_params.epsilon"

ChargeTo = Literal["key", "end-user"]
ImagePolicy = Literal["block", "pass"]
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
    """A request that must not reach the model; the message names why, never the text."""

    def __init__(self, reason: str, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(reason)
        self.reason, self.headers = reason, dict(headers or {})


MAX_NAMED_ERRORS = 5


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


def _principal(data: LiteLLMRequestData, charge_to: ChargeTo, privacy: PromptPrivacy) -> str:
    """The principal charged: LiteLLM's key hash or end-user id. Missing with a ledger: blocked."""
    field, prefix = (("user_api_key_hash", KEY_PREFIX) if charge_to == "key"
                     else ("user_api_key_end_user_id", END_USER_PREFIX))
    value = (getattr(data, field) or "").strip()
    if len(value) > MAX_ID_CHARS:
        raise _BlockedError(f"privlm: request_data.{field} is longer than {MAX_ID_CHARS} characters")
    if value:
        return prefix + value
    if privacy.ledger is None:
        return UNIDENTIFIED
    who = "virtual key" if charge_to == "key" else "end user (the request's `user` field)"
    raise _BlockedError(f"privlm: request_data.{field} is missing; budgets are charged per {who}, and a request "
                   "without one is not charged to a shared budget")


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


_BODY_DESCRIPTION = ("LiteLLM's GenericGuardrailAPIRequest (`input_type`, `texts`, `request_data`, ...: the "
                     "`GuardrailRequest` model of privlm.cape.service.guardrail). Any JSON object is answered 200: "
                     "one that is not a valid request is BLOCKED, with the fields at fault named.")


def guardrail_router(privacy: PromptPrivacy, *, charge_to: ChargeTo = "key", audit: AuditLog | None = None,
                     images: ImagePolicy = "block") -> APIRouter:
    """``POST /beta/litellm_basic_guardrail_api`` (see the module doc); mount it behind the app's keys."""
    if charge_to not in ("key", "end-user"):
        raise ValueError(f"charge_to must be 'key' or 'end-user', got {charge_to!r}")
    if images not in ("block", "pass"):
        raise ValueError(f"images must be 'block' or 'pass', got {images!r}")
    router = APIRouter(tags=["litellm"])
    perturbing = FairScheduler(1)  # one forward pass at a time on the device model, callers taking turns

    async def record(event: str, entry: Mapping[str, Any]) -> bool:
        """Write to the audit log, if any; False if it could not be written."""
        if audit is None:
            return True
        try:
            await asyncio.to_thread(audit.write, event, entry)
        except Exception:  # the caller decides: a release that cannot be recorded is blocked
            return False
        return True

    async def perturb(request: GuardrailRequest, request_id: str) -> JSONResponse:
        texts = _texts(request, images)
        principal = _principal(request.request_data, charge_to, privacy)
        params = request.additional_provider_specific_params or {}
        try:
            epsilon = privacy.resolve_epsilon(params.get("epsilon"), param=EPSILON_PARAM)
            privacy.check_lengths(texts, param="texts")
        except ServiceError as error:
            raise _BlockedError(f"privlm: {error.detail.message}") from None
        try:
            async with perturbing.turn(principal):
                result = await asyncio.to_thread(privacy.privatize, texts, principal=principal, epsilon=epsilon)
        except BudgetExhaustedError as error:
            raise _budget_reason(error) from None
        except ServiceError as error:  # PrivacyStepError: its message names the failure's type only
            raise _BlockedError(f"privlm: {error.detail.message}") from None
        changed = any(sent != text for sent, text in zip(result.texts, texts, strict=True))
        action: Action = "GUARDRAIL_INTERVENED" if changed else "NONE"
        if not await record("released", _released_record(result, request, request_id, principal, action)):
            raise _BlockedError("privlm: the audit log could not be written; nothing may be sent unrecorded")
        return _answer(GuardrailResponse(action=action, texts=list(result.texts)),
                       privacy_headers(result, request_id))

    async def guardrail(body: Annotated[dict[str, Any], Body(description=_BODY_DESCRIPTION)]) -> JSONResponse:
        request_id = f"privlm-{uuid.uuid4().hex[:16]}"
        ids: dict[str, Any] = {"request_id": request_id, "endpoint": "litellm.guardrail"}
        try:
            request = _parsed(body)
            ids = _ids(request, request_id)
            if request.input_type == "response":
                await record("not_perturbed", {**_ids(request, request_id), "action": "NONE",
                                               "why": "a model's answer is not the user's prompt"})
                return _answer(GuardrailResponse(action="NONE"), {"x-privlm-request-id": request_id})
            return await perturb(request, request_id)
        except _BlockedError as blocked:
            reason, headers = blocked.reason, blocked.headers
        except Exception as error:  # fail closed: whatever went wrong, the original stays here
            reason, headers = f"privlm: the privacy step failed ({type(error).__name__}); nothing may be sent", {}
        await record("blocked", {**ids, "action": "BLOCKED", "blocked_reason": reason})
        return _answer(GuardrailResponse(action="BLOCKED", blocked_reason=reason),
                       {**headers, "x-privlm-request-id": request_id})

    router.post(GUARDRAIL_PATH, response_model=GuardrailResponse, response_model_exclude_none=True,
                summary="LiteLLM's Generic Guardrail API: perturb a request's texts with Cape",
                responses={200: {"description": "NONE, GUARDRAIL_INTERVENED with the perturbed texts, or BLOCKED "
                                                "with the reason (every failure: fail closed)"}})(guardrail)
    return router


def create_guardrail_app(privacy: PromptPrivacy, *, api_keys: Sequence[str] = (), charge_to: ChargeTo = "key",
                         audit: AuditLog | None = None, images: ImagePolicy = "block",
                         max_request_bytes: int = MAX_REQUEST_BYTES, **service: Unpack[ServiceOptions]) -> FastAPI:
    """A service with only the guardrail endpoint (and ``/health``, ``/metrics``), behind ``api_keys``."""
    auth = BearerKeys(api_keys)
    router = guardrail_router(privacy, charge_to=charge_to, audit=audit, images=images)
    return create_service_app(title="privlm LiteLLM guardrail (Cape)", routers=[router], auth=auth,
                              max_request_bytes=max_request_bytes, refusal_answers=REFUSAL_ANSWERS,
                              health=lambda: {"mechanism": privacy.mechanism, "epsilon": privacy.epsilon,
                                              "charge_to": charge_to, "images": images},
                              **service)
