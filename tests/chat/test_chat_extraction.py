"""Response-side extraction (opt-in): the local SmolLM2 rewrites the upstream's answer for the user's original prompt.

The extractor is greedy, so its answer is a function of (original prompt, upstream answer): the test computes it
directly and compares, which also proves the local model was given the original prompt, not the perturbed one.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import NamedTuple

import httpx
import pytest

from privlm.chat.extraction import AnswerExtractor
from privlm.models.chat import ChatModel, Generation
from privlm.models.language import LanguageModel
from tests.support.chat import (
    CANNED,
    CANNED_CONTENT,
    MISSING,
    NOT_FOUND,
    STREAM_PIECES,
    TIMEOUT,
    chat_body,
    chat_gateway,
    sse_events,
)

pytestmark = pytest.mark.slow

PROMPT = "My friend Alice from Boston asks: what is the capital of France?"


CAP = 8  # the extractor's own max_tokens


class RecordingChatModel(ChatModel):
    """SmolLM2, recording each generation's max_tokens and the tokens it sampled (its tokenizer's count)."""

    def __init__(self, language_model: LanguageModel) -> None:
        super().__init__(language_model)
        self.calls: list[tuple[int, int]] = []

    def generate(self, *args, **kwargs) -> Generation:  # type: ignore[no-untyped-def]
        generation = super().generate(*args, **kwargs)
        self.calls.append((kwargs["max_tokens"], generation.completion_tokens))
        return generation


class Extracting(NamedTuple):
    url: str
    extractor: AnswerExtractor
    model: RecordingChatModel


@pytest.fixture(scope="module")
def extracting(smollm2_lm, cape_privacy, stub) -> Iterator[Extracting]:
    model = RecordingChatModel(smollm2_lm)
    extractor = AnswerExtractor(model, max_tokens=CAP)
    with chat_gateway(cape_privacy, stub.url, extractor=extractor) as url:
        yield Extracting(url, extractor, model)


def test_the_answer_is_the_local_models_and_the_upstreams_is_kept(extracting, stub):
    stub.clear()
    response = httpx.post(f"{extracting.url}/v1/chat/completions", json=chat_body(PROMPT, privlm={"report": True}),
                          timeout=TIMEOUT)
    assert response.status_code == 200, response.text
    assert float(response.headers["x-privlm-epsilon-spent"]) > 0
    body = response.json()
    message = body["choices"][0]["message"]
    expected = extracting.extractor.extract(PROMPT, CANNED_CONTENT)
    assert expected and message["content"] == expected != CANNED_CONTENT
    assert message["privlm_upstream_content"] == CANNED_CONTENT
    upstream = json.loads(CANNED)
    assert body["usage"] == upstream["usage"] and body["x_stub_extra"] == upstream["x_stub_extra"]  # the rest kept
    assert body["privlm"]["epsilon_spent"] > 0
    [sent] = stub.received()
    assert sent["messages"][0]["content"] != PROMPT  # the upstream still got the perturbed prompt only


def test_a_stream_with_extraction_streams_the_rewrite(extracting):
    with httpx.stream("POST", f"{extracting.url}/v1/chat/completions", json=chat_body(PROMPT, stream=True),
                      timeout=TIMEOUT) as response:
        raw = response.read()
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(raw)
    assert events[-1] == b"data: [DONE]\n\n"
    chunks = [json.loads(e.removeprefix(b"data: ")) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert text == extracting.extractor.extract(PROMPT, "".join(STREAM_PIECES))
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_an_upstream_error_is_not_rewritten(extracting):
    response = httpx.post(f"{extracting.url}/v1/chat/completions", json=chat_body(PROMPT, model=MISSING),
                          timeout=TIMEOUT)
    assert response.status_code == 404 and response.content == NOT_FOUND


def test_the_extraction_keeps_to_the_requests_own_max_tokens(extracting):
    """A caller that asked for n tokens gets a rewrite of at most n (the smaller of max_tokens and
    max_completion_tokens), streamed or not; above the extractor's cap, the cap."""
    model = extracting.model
    model.calls.clear()
    for fields in ({"max_tokens": 3}, {"max_tokens": 50, "max_completion_tokens": 4, "stream": True},
                   {"max_tokens": 50}):
        with httpx.stream("POST", f"{extracting.url}/v1/chat/completions", json=chat_body(PROMPT, **fields),
                          timeout=TIMEOUT) as response:
            response.read()
        assert response.status_code == 200, response.text
    [(asked_3, sampled_3), (asked_4, sampled_4), (asked_cap, sampled_cap)] = model.calls
    assert (asked_3, asked_4, asked_cap) == (3, 4, CAP)
    assert sampled_3 <= 3 and sampled_4 <= 4
    assert sampled_cap > 4  # unbounded by the request, the rewrite is longer: the limits above did cut it
