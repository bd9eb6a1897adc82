"""What LiteLLM 1.108.7's proxy sends to a Generic Guardrail API, and what it does with the answer: copied from its
source (the wheel ``litellm==1.108.7``), not imported (it pins ``huggingface-hub<2``, which privlm's venv is past).

Sending (``GenericGuardrailAPI.apply_guardrail``, litellm/proxy/guardrails/guardrail_hooks/generic_guardrail_api/
generic_guardrail_api.py):
  - the body is ``GenericGuardrailAPIRequest(...).model_dump(mode="json")``
    (litellm/types/proxy/guardrails/guardrail_hooks/generic_guardrail_api.py): every field present, ``None`` where
    unset, in :data:`REQUEST_FIELDS`' order;
  - ``request_data`` holds only the ``user_api_key_*`` keys that are set in the request's metadata
    (``_extract_user_api_key_metadata``: a TypedDict with ``total=False``); the end user is the request's ``user``;
  - ``request_headers``: the client's headers to LiteLLM, values of an allowlist (``content-type``, ``user-agent``,
    ``x-litellm-*``, ... and the guardrail's ``extra_headers``) and ``"[present]"`` for every other one;
  - ``additional_provider_specific_params``: the config's. The client's dynamic params (``extra_body``) are read
    from ``request_data.get("body")``, which a chat request's data never holds, and are dropped without a
    LiteLLM Enterprise licence anyway (``get_guardrail_dynamic_request_body_params``);
  - ``texts``/``images``: ``OpenAIChatCompletionsHandler._extract_inputs`` (litellm/llms/openai/chat/
    guardrail_translation/handler.py), the text of every message in order;
  - the headers: its HTTP client's (:data:`HEADERS`), ``Content-Type: application/json``, the ``headers``
    setting, and ``x-api-key`` for the ``api_key`` setting.

Reading the answer (the same function): :func:`outcome`.

Captured from LiteLLM itself (``/tmp``: a venv with the wheel, a capture server, ``process_input_messages``) to
check this copy; docs/litellm.md gives the command.
"""

from __future__ import annotations

import uuid
from typing import Any, Literal

import httpx

VERSION = "1.108.7"
REQUEST_FIELDS = ("input_type", "litellm_call_id", "litellm_trace_id", "structured_messages", "images", "tools",
                  "texts", "request_data", "request_headers", "litellm_version", "additional_provider_specific_params",
                  "tool_calls", "model")
# Its HTTP client's own headers, then Content-Type (httpx adds host and content-length).
HEADERS = {"accept": "*/*", "accept-encoding": "gzip, deflate", "connection": "keep-alive",
           "user-agent": f"litellm/{VERSION}", "content-type": "application/json"}
PRESENT = "[present]"  # a client header LiteLLM does not forward the value of
KEY_HASH = "a1b2c3d4e5f6789012345678901234567890abcdef1234567890abcdef123456"  # LiteLLM's own test fixture
END_USER = "customer-42"


def headers(api_key: str | None = None) -> dict[str, str]:
    """The headers LiteLLM posts with: ``x-api-key`` when its ``api_key`` is set (no ``headers`` setting)."""
    return HEADERS | ({"x-api-key": api_key} if api_key is not None else {})


def inputs(messages: list[dict[str, Any]]) -> tuple[list[str], list[str]]:
    """``texts`` and ``images`` as LiteLLM extracts them from chat messages (``_extract_inputs``)."""
    texts: list[str] = []
    images: list[str] = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, str):
            texts.append(content)
        elif isinstance(content, list):
            for part in content:
                if part.get("text") is not None:
                    texts.append(part["text"])
                if part.get("type") == "image_url":
                    url = part["image_url"]["url"] if isinstance(part["image_url"], dict) else part["image_url"]
                    images.append(url)
    return texts, images


def body(texts: list[str] | None = None, *, messages: list[dict[str, Any]] | None = None,
         input_type: str = "request", request_data: dict[str, Any] | None = None, images: list[str] | None = None,
         params: dict[str, Any] | None = None, client_headers: dict[str, str] | None = None) -> dict[str, Any]:
    """One request as LiteLLM posts it. By default from a client that sent ``user`` (so ``request_data`` names the
    end user) and no header of privlm's; ``client_headers`` are the client's, as LiteLLM forwards them."""
    if messages is not None:
        texts, found = inputs(messages)
        images = images if images is not None else found or None
    sent = {"user_api_key_hash": KEY_HASH, "user_api_key_user_id": "default_user_id",
            "user_api_key_team_id": "test-team", "user_api_key_end_user_id": END_USER}
    request_headers = {"content-type": "application/json", "user-agent": "OpenAI/Python 2.20.0",
                       "authorization": PRESENT} | (client_headers or {})
    fields = {"input_type": input_type, "litellm_call_id": str(uuid.uuid4()), "litellm_trace_id": str(uuid.uuid4()),
              "structured_messages": messages, "images": images, "tools": None, "texts": texts,
              "request_data": sent if request_data is None else request_data, "request_headers": request_headers,
              "litellm_version": VERSION, "additional_provider_specific_params": {} if params is None else params,
              "tool_calls": None, "model": "gpt-4o"}
    assert tuple(fields) == REQUEST_FIELDS
    return fields


Outcome = Literal["blocked", "original", "rewritten", "unchanged"]


def outcome(answer: httpx.Response | None, *, unreachable_fallback: Literal["fail_closed", "fail_open"] = "fail_closed",
            fail_on_error: bool = True) -> Outcome:
    """What LiteLLM 1.108.7 does with the guardrail's answer (``None``: a network error or a timeout): block the
    request, forward the ``original`` texts (a fail-open path), forward the guardrail's texts (``rewritten``), or
    forward the request ``unchanged`` because the guardrail let it pass (NONE without texts).

    ``raise_for_status()``: an error status is unreachable if it is 502, 503 or 504; unreachable with
    ``fail_open``, or any error with ``fail_on_error: false``, forwards the original; any other error blocks
    (the client gets a 500). A 2xx is read with ``GenericGuardrailAPIResponse.from_dict``: BLOCKED blocks, and
    non-empty ``texts`` replace the originals; a body that is not a JSON object is an error that is not
    unreachable."""
    if answer is None:
        unreachable = True
    elif not answer.is_success:  # httpx's raise_for_status: anything but a 2xx
        unreachable = answer.status_code in (502, 503, 504)
    else:
        try:
            data = answer.json()
        except ValueError:
            data = None
        if isinstance(data, dict):
            if data.get("action", "NONE") == "BLOCKED":
                return "blocked"
            return "rewritten" if data.get("texts") else "unchanged"
        unreachable = False
    if (unreachable and unreachable_fallback == "fail_open") or not fail_on_error:
        return "original"
    return "blocked"
