"""The upstream's answer comes back unchanged, with the privacy report: Cape on SmolLM2 in front of the stub.

Non-streaming answers come back byte for byte (without the body report); streams come back event for event.
The ``x-privlm-*`` headers agree with the opt-in body report: the epsilon spent is the sum of the per-text
``epsilon_spent``, and so are the tokens perturbed.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.support.chat import (
    CANNED,
    CANNED_CONTENT,
    CHUNKS,
    EPS,
    STREAM_PIECES,
    TIMEOUT,
    StubUpstream,
    chat_body,
    chat_gateway,
    sse_events,
)

pytestmark = pytest.mark.slow

UPSTREAM_KEY = "sk-upstream-key-0123456789"
PROMPT = "My friend Alice lives in Paris near the river with her cat Tom."
SECOND = "Her doctor in Lyon said the cough is asthma."


@pytest.fixture(scope="module")
def gateway(cape_privacy, stub) -> Iterator[str]:
    with chat_gateway(cape_privacy, stub.url, upstream_key=UPSTREAM_KEY, models=["stub-model"]) as url:
        yield url


def post(url: str, body: dict[str, Any], **headers: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=TIMEOUT)


def stream(url: str, body: dict[str, Any]) -> tuple[httpx.Response, bytes]:
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True}, timeout=TIMEOUT) as answer:
        return answer, answer.read()


def spent(response: httpx.Response) -> float:
    return float(response.headers["x-privlm-epsilon-spent"])


def assert_privacy_headers(response: httpx.Response, *, epsilon: float = EPS) -> None:
    headers = response.headers
    assert headers["x-privlm-mechanism"] == "cape"
    assert float(headers["x-privlm-epsilon"]) == epsilon
    assert headers["x-privlm-request-id"].startswith("privlm-")
    assert 0 < int(headers["x-privlm-tokens-perturbed"]) <= int(headers["x-privlm-tokens"])
    assert spent(response) > epsilon * int(headers["x-privlm-tokens-perturbed"])  # eps + ln N_b + ln |C| per token
    assert "x-privlm-budget-remaining" not in headers  # no ledger on this gateway


def assert_report_matches_headers(report: dict[str, Any], response: httpx.Response) -> None:
    per_text = [text["epsilon_spent"] for text in report["texts"]]
    assert len(per_text) >= 1 and all(value > 0 for value in per_text)
    assert report["epsilon_spent"] == pytest.approx(sum(per_text))
    assert spent(response) == pytest.approx(sum(per_text), rel=1e-5)  # the header has 6 significant digits
    assert report["tokens_perturbed"] == int(response.headers["x-privlm-tokens-perturbed"])
    assert report["tokens_perturbed"] == sum(text["tokens_perturbed"] for text in report["texts"])
    assert report["request_id"] == response.headers["x-privlm-request-id"]
    assert report["mechanism"] == "cape" and report["epsilon"] == EPS and report["guarantee"]


def test_a_completion_comes_back_byte_for_byte_with_the_report_in_headers(gateway, stub: StubUpstream):
    stub.clear()
    response = post(gateway, chat_body(PROMPT))
    assert response.status_code == 200, response.text
    assert response.content == CANNED  # not re-serialised
    assert response.headers["content-type"].startswith("application/json")
    assert response.headers["x-stub-header"] == "kept"
    assert_privacy_headers(response)
    [sent] = stub.received()
    assert sent["messages"][0]["role"] == "user" and sent["messages"][0]["content"] != PROMPT
    assert "privlm" not in sent
    assert stub.headers[-1]["authorization"] == f"Bearer {UPSTREAM_KEY}"  # the upstream's key, from the gateway


def test_the_opt_in_body_report_agrees_with_the_headers(gateway, stub: StubUpstream):
    stub.clear()
    response = post(gateway, chat_body(PROMPT, SECOND, privlm={"report": True}))
    assert response.status_code == 200, response.text
    body = response.json()
    report = body.pop("privlm")
    assert body == json.loads(CANNED)  # the upstream's answer, plus the report field only
    assert_report_matches_headers(report, response)
    [sent] = stub.received()
    assert "privlm" not in sent  # privlm's own field is never forwarded
    assert [t["sent"] for t in report["texts"]] == [m["content"] for m in sent["messages"]]
    assert [(t["message"], t["part"], t["role"]) for t in report["texts"]] == [(0, None, "user"), (1, None, "user")]


def test_a_stream_passes_through_event_by_event(gateway, stub: StubUpstream):
    stub.clear()
    response, raw = stream(gateway, chat_body(PROMPT))
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.headers["x-stub-header"] == "kept"
    assert_privacy_headers(response)
    assert sse_events(raw) == list(CHUNKS)
    [sent] = stub.received()
    assert sent["stream"] is True and sent["messages"][0]["content"] != PROMPT


def test_a_stream_with_the_report_starts_with_a_chunk_without_choices(gateway, stub: StubUpstream):
    response, raw = stream(gateway, chat_body(PROMPT, SECOND, privlm={"report": True}))
    assert response.status_code == 200
    first, *rest = sse_events(raw)
    assert rest == list(CHUNKS)
    event = json.loads(first.removeprefix(b"data: "))
    assert event["object"] == "chat.completion.chunk" and event["choices"] == []
    assert_report_matches_headers(event["privlm"], response)


def test_a_request_may_lower_epsilon_by_body_or_header(gateway):
    at_limit = post(gateway, chat_body(PROMPT))
    by_body = post(gateway, chat_body(PROMPT, privlm={"epsilon": 2}))
    by_header = post(gateway, chat_body(PROMPT), **{"x-privlm-epsilon": "3"})
    assert [r.status_code for r in (at_limit, by_body, by_header)] == [200, 200, 200]
    assert_privacy_headers(by_body, epsilon=2.0)
    assert_privacy_headers(by_header, epsilon=3.0)
    # The same prompt, the same perturbed tokens: the sound total grows with epsilon.
    assert spent(by_body) < spent(by_header) < spent(at_limit)


def test_models_lists_the_chat_models(gateway):
    models = httpx.get(f"{gateway}/v1/models", timeout=TIMEOUT).json()
    assert [m["id"] for m in models["data"]] == ["stub-model"]


def test_the_openai_client_reads_the_answer_and_the_headers(gateway):
    client = openai.OpenAI(base_url=f"{gateway}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)
    raw = client.chat.completions.with_raw_response.create(model="stub-model",
                                                           messages=[{"role": "user", "content": PROMPT}])
    assert raw.headers["x-privlm-mechanism"] == "cape" and float(raw.headers["x-privlm-epsilon-spent"]) > 0
    assert raw.parse().choices[0].message.content == CANNED_CONTENT

    chunks = list(client.chat.completions.create(model="stub-model", stream=True,
                                                 messages=[{"role": "user", "content": PROMPT}],
                                                 extra_body={"privlm": {"report": True}}))
    assert chunks[0].choices == [] and (chunks[0].model_extra or {})["privlm"]["epsilon_spent"] > 0
    assert "".join(c.choices[0].delta.content or "" for c in chunks[1:]) == "".join(STREAM_PIECES)
    assert chunks[-1].choices[0].finish_reason == "stop"
