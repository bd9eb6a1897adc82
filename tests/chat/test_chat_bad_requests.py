"""Malformed chat requests get a 400 in OpenAI's error shape naming the field, and nothing reaches the upstream."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from privlm.chat.service.privacy import PromptPrivacy
from tests.support.chat import EPS, TIMEOUT, B, StubUpstream, assert_openai_error, chat_body, chat_gateway

pytestmark = pytest.mark.slow

MAX_PROMPT_TOKENS = 16
TEXT = "Alice Smith from Boston has asthma."
LONG = "Alice Smith from Boston has asthma and her brother Robert has diabetes and lives in Lisbon."  # > 16 tokens


def user(content: Any, role: str = "user") -> dict[str, Any]:
    return {"model": "stub-model", "messages": [{"role": role, "content": content}]}


# (what, body, headers, param, code)
CASES: list[tuple[str, Any, dict[str, str], str | None, str]] = [
    ("missing messages", {"model": "stub-model"}, {}, "messages", "invalid_request"),
    ("empty messages", {"model": "stub-model", "messages": []}, {}, "messages", "invalid_request"),
    ("missing model", {"messages": [{"role": "user", "content": TEXT}]}, {}, "model", "invalid_request"),
    ("unknown role", user(TEXT, role="wizard"), {}, "messages.0.role", "invalid_request"),
    ("number content", user(42), {}, "messages.0.content", "invalid_request"),
    ("object content", user({"text": TEXT}), {}, "messages.0.content", "invalid_request"),
    ("part without text", user([{"type": "text"}]), {}, "messages.0.content", "invalid_request"),
    ("messages not a list", {"model": "stub-model", "messages": TEXT}, {}, "messages", "invalid_request"),
    ("stream not a boolean", {**user(TEXT), "stream": "maybe"}, {}, "stream", "invalid_request"),
    ("over-long prompt", user(LONG), {}, "messages", "context_length_exceeded"),
    ("over-long in all", chat_body(TEXT, TEXT, TEXT), {}, "messages", "context_length_exceeded"),
    ("epsilon above the limit", {**user(TEXT), "privlm": {"epsilon": EPS + 1}}, {}, "privlm.epsilon",
     "epsilon_above_limit"),
    ("negative epsilon", {**user(TEXT), "privlm": {"epsilon": -1}}, {}, "privlm.epsilon", "invalid_request"),
    ("zero epsilon", {**user(TEXT), "privlm": {"epsilon": 0}}, {}, "privlm.epsilon", "invalid_request"),
    ("text epsilon", {**user(TEXT), "privlm": {"epsilon": "high"}}, {}, "privlm.epsilon", "invalid_request"),
    ("unknown privlm option", {**user(TEXT), "privlm": {"report": True, "verbose": 1}}, {}, "privlm.verbose",
     "invalid_request"),
    ("privlm not an object", {**user(TEXT), "privlm": "report"}, {}, "privlm", "invalid_request"),
    ("header epsilon above the limit", user(TEXT), {"x-privlm-epsilon": str(EPS + 1)}, "x-privlm-epsilon",
     "epsilon_above_limit"),
    ("header epsilon not a number", user(TEXT), {"x-privlm-epsilon": "lots"}, "x-privlm-epsilon", "invalid_epsilon"),
    ("header epsilon negative", user(TEXT), {"x-privlm-epsilon": "-1"}, "x-privlm-epsilon", "invalid_epsilon"),
    ("header epsilon zero", user(TEXT), {"x-privlm-epsilon": "0"}, "x-privlm-epsilon", "invalid_epsilon"),
    ("header epsilon nan", user(TEXT), {"x-privlm-epsilon": "nan"}, "x-privlm-epsilon", "invalid_epsilon"),
    ("header epsilon infinite", user(TEXT), {"x-privlm-epsilon": "inf"}, "x-privlm-epsilon", "invalid_epsilon"),
]


@pytest.fixture(scope="module")
def gateway(smollm2_lm, stub) -> Iterator[str]:
    privacy = PromptPrivacy.cape(smollm2_lm, epsilon=EPS, logit_bound=B, max_prompt_tokens=MAX_PROMPT_TOKENS)
    with chat_gateway(privacy, stub.url) as url:
        yield url


@pytest.mark.parametrize(("what", "body", "headers", "param", "code"), CASES, ids=[c[0] for c in CASES])
def test_a_malformed_request_is_a_400_naming_the_field(gateway, stub: StubUpstream, what, body, headers, param, code):
    stub.clear()
    response = httpx.post(f"{gateway}/v1/chat/completions", json=body, headers=headers, timeout=TIMEOUT)
    assert_openai_error(response, 400, code=code, param=param)
    assert stub.received() == []


@pytest.mark.parametrize("raw", [b'{"model": "stub-model", "messages": [', b"not json", b"[1, 2]", b""])
def test_a_body_that_is_not_a_json_request_is_a_400(gateway, stub: StubUpstream, raw):
    stub.clear()
    response = httpx.post(f"{gateway}/v1/chat/completions", content=raw, timeout=TIMEOUT,
                          headers={"content-type": "application/json"})
    assert_openai_error(response, 400)
    assert stub.received() == []


def test_a_boolean_epsilon_is_refused(gateway, stub: StubUpstream):
    """``privlm.epsilon: true`` is not a number: PromptPrivacy.resolve_epsilon refuses booleans, but the request
    model (a lax pydantic float) turns ``true`` into 1.0 before it gets there, and the request goes through."""
    stub.clear()
    response = httpx.post(f"{gateway}/v1/chat/completions", json={**user(TEXT), "privlm": {"epsilon": True}},
                          timeout=TIMEOUT)
    assert_openai_error(response, 400, param="privlm.epsilon")
    assert stub.received() == []


def test_a_request_within_the_limits_goes_through(gateway, stub: StubUpstream):
    """The control: the same gateway forwards a good request (so the 400s above are about what they change)."""
    stub.clear()
    response = httpx.post(f"{gateway}/v1/chat/completions", json={**user(TEXT), "privlm": {"epsilon": EPS}},
                          headers={"x-privlm-epsilon": "1"}, timeout=TIMEOUT)
    assert response.status_code == 200, response.text
    assert float(response.headers["x-privlm-epsilon"]) == 1.0  # the smaller of the body's and the header's
    assert len(stub.received()) == 1
