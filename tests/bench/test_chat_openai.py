"""The real ``openai`` client through the gateway to ``serve-llm``: real SmolLM2 generation upstream, Cape in front.

Both sides share the one loaded SmolLM2 (the gateway's device model, and ``serve-llm``'s chat model). In the bench
kit's tests: ``serve-llm`` is the kit's.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

import httpx
import openai
import pytest

from privlm.chat.service.privacy import PromptPrivacy
from privlm.models.chat import ChatModel
from privlm.models.language import LanguageModel
from privlm_bench.chat.llm_server import create_llm_app
from tests.service.localhost import serving
from tests.support.chat import EPS, TIMEOUT, B, chat_gateway

pytestmark = pytest.mark.slow

PROMPT = "My neighbour Alice Smith from Boston asked me: what is the capital of France?"
LLM_KEY = "serve-llm-key"
GATEWAY_KEY = "app-key"


class Stack(NamedTuple):
    client: openai.OpenAI  # the real client on the gateway
    model: str  # serve-llm's model id


@pytest.fixture(scope="module")
def cape_privacy(smollm2_lm: LanguageModel) -> PromptPrivacy:
    """As tests/chat/conftest.py's: Cape on SmolLM2 at epsilon EPS with the fixed logit bound B."""
    return PromptPrivacy.cape(smollm2_lm, epsilon=EPS, logit_bound=B)


@pytest.fixture(scope="module")
def stack(smollm2_lm, cape_privacy) -> Iterator[Stack]:
    with serving(create_llm_app(ChatModel(smollm2_lm), api_keys=[LLM_KEY])) as llm_url:
        listed = httpx.get(f"{llm_url}/v1/models", headers={"authorization": f"Bearer {LLM_KEY}"}).json()
        model = listed["data"][0]["id"]
        with chat_gateway(cape_privacy, llm_url, upstream_key=LLM_KEY, api_keys=[GATEWAY_KEY],
                          models=[model]) as url:
            yield Stack(openai.OpenAI(base_url=f"{url}/v1", api_key=GATEWAY_KEY, max_retries=0, timeout=TIMEOUT),
                        model)


def test_a_completion_from_serve_llm_through_the_gateway(stack):
    raw = stack.client.chat.completions.with_raw_response.create(
        model=stack.model, messages=[{"role": "user", "content": PROMPT}], max_tokens=8, temperature=0)
    completion = raw.parse()
    assert completion.object == "chat.completion" and completion.model == stack.model
    choice = completion.choices[0]
    assert choice.message.role == "assistant" and choice.message.content  # real generated text
    assert choice.finish_reason in ("stop", "length")
    assert 0 < completion.usage.completion_tokens <= 8
    assert raw.headers["x-privlm-mechanism"] == "cape" and float(raw.headers["x-privlm-epsilon"]) == EPS
    assert float(raw.headers["x-privlm-epsilon-spent"]) > 0 and int(raw.headers["x-privlm-tokens-perturbed"]) > 0


def test_a_stream_from_serve_llm_through_the_gateway(stack):
    with stack.client.chat.completions.with_streaming_response.create(
            model=stack.model, messages=[{"role": "user", "content": PROMPT}], max_tokens=8, stream=True,
            extra_body={"privlm": {"report": True}}) as response:
        assert float(response.headers["x-privlm-epsilon-spent"]) > 0
        chunks = list(response.parse())
    report, *answer = chunks
    assert report.choices == [] and (report.model_extra or {})["privlm"]["texts"][0]["sent"] != PROMPT
    text = "".join(c.choices[0].delta.content or "" for c in answer if c.choices)
    assert text.strip()  # real generated text, streamed
    assert [c.choices[0].finish_reason for c in answer if c.choices][-1] in ("stop", "length")


def test_serve_llm_refusals_come_back_as_they_are(stack):
    """serve-llm's own 4xx (an unknown model: 404) passes through the gateway unchanged, to the client."""
    with pytest.raises(openai.NotFoundError) as refused:
        stack.client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": PROMPT}],
                                             max_tokens=8)
    assert isinstance(refused.value.body, dict) and refused.value.body["code"] == "model_not_found"
