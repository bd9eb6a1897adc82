"""What the caller gets when the upstream fails, streaming and not: always OpenAI's JSON error shape.

Down: 502 ``upstream_unreachable``. Slower than ``read_timeout``: 504 ``upstream_timeout``. An upstream 5xx: 502
``upstream_failed``. An upstream 4xx comes back as it is (status, body, headers), with the privacy report. A
stream that stalls midway ends with OpenAI's error event. (A mechanism without a model: these are about the
forwarding, not Cape.)
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from tests.service.localhost import dead_url
from tests.support.chat import (
    CHUNKS,
    FAILING,
    MISSING,
    NOT_FOUND,
    SLOW,
    STALL,
    TIMEOUT,
    StubUpstream,
    assert_openai_error,
    chat_body,
    chat_gateway,
    fake_privacy,
    sse_events,
)

PROMPT = "Alice Smith from Boston has asthma."


@pytest.fixture(scope="module")
def gateways(stub) -> Iterator[dict[str, str]]:
    privacy = fake_privacy()
    with (dead_url() as nowhere, chat_gateway(privacy, nowhere) as down,
          chat_gateway(privacy, stub.url, read_timeout=0.5) as impatient):
        yield {"down": down, "impatient": impatient}


def call(url: str, model: str, stream: bool) -> tuple[httpx.Response, bytes]:
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=chat_body(PROMPT, model=model, stream=stream),
                      timeout=TIMEOUT) as response:
        return response, response.read()


@pytest.mark.parametrize("stream", [False, True])
def test_an_upstream_that_is_down_is_a_502(gateways, stream):
    response, _ = call(gateways["down"], "stub-model", stream)
    error = assert_openai_error(response, 502, code="upstream_unreachable")
    assert error["type"] == "upstream_error" and PROMPT not in response.text


@pytest.mark.parametrize("stream", [False, True])
def test_an_upstream_slower_than_the_read_timeout_is_a_504(gateways, stub: StubUpstream, stream):
    stub.clear()
    response, _ = call(gateways["impatient"], SLOW, stream)
    assert_openai_error(response, 504, code="upstream_timeout")
    assert len(stub.received()) == 1  # it was asked, and did not answer in time


@pytest.mark.parametrize("stream", [False, True])
def test_an_upstream_5xx_is_a_502(gateways, stream):
    response, _ = call(gateways["impatient"], FAILING, stream)
    assert_openai_error(response, 502, code="upstream_failed")


@pytest.mark.parametrize("stream", [False, True])
def test_an_upstream_4xx_comes_back_as_it_is(gateways, stream):
    response, body = call(gateways["impatient"], MISSING, stream)
    assert response.status_code == 404 and body == NOT_FOUND
    assert response.headers["content-type"].startswith("application/json")
    assert response.headers["x-stub-header"] == "kept"
    assert response.headers["x-privlm-mechanism"] == "fake"  # the report: the prompt was released


def test_a_stream_that_stalls_midway_ends_with_an_error_event(gateways):
    response, body = call(gateways["impatient"], STALL, True)
    assert response.status_code == 200  # the stream had started
    events = sse_events(body)
    assert events[:2] == list(CHUNKS[:2])
    last = json.loads(events[-1].removeprefix(b"data: "))
    assert last["error"]["code"] == "upstream_stream_failed" and last["error"]["type"] == "upstream_error"
    assert b"[DONE]" not in body
