"""schemathesis on the privacy gateway's OpenAPI (private chat and the guardrail, the stub upstream), bounded
examples, under the conformance checks of tests/service/fuzz.py: never a 5xx, every answer documented.

Cape-distance (Cape's utility without the language model's logits: no forward pass) and ``max_prompt_tokens`` 16
keep every generated request cheap; the path through the gateway is the same as Cape's.
"""

from __future__ import annotations

import pytest

from privlm.chat.service.upstream import ChatUpstream
from privlm.detect import Detector
from privlm.detect.patterns import PatternLayer
from privlm.gateway import ChatSetup, create_privacy_gateway, mechanism_privacy
from privlm.settings.chat import ChatOptions
from tests.service.fuzz import conforming, fuzz_openapi
from tests.service.localhost import serving
from tests.support.chat import EPS, fake_privacy

KEY = "fuzz-key-0001"


@pytest.mark.slow
def test_the_gateway_openapi_never_answers_5xx(smollm2_lm, stub):
    privacy = mechanism_privacy("cape-distance", smollm2_lm, epsilon=EPS, logit_bound=None, max_prompt_tokens=16)
    setup = ChatSetup(privacy=privacy, upstream=ChatUpstream(stub.url), models=["stub-model"],
                      options=ChatOptions(guardrail=True))
    detector = Detector([PatternLayer()])  # the detect route too, on the layer that needs no model
    with serving(create_privacy_gateway(chat=setup, api_keys=[KEY], detector=detector)) as url:
        seen = fuzz_openapi(url, headers={"authorization": f"Bearer {KEY}"}, max_examples=30)
    paths = {path for path, _ in seen}
    assert paths >= {"/v1/chat/completions", "/v1/models", "/health", "/metrics", "/beta/litellm_basic_guardrail_api",
                     "/v1/detect"}
    chat_codes = {code for path, code in seen if path == "/v1/chat/completions"}
    assert chat_codes and all(code < 500 for code in chat_codes), chat_codes


@pytest.mark.parametrize("stream", [False, True])
def test_a_good_answer_conforms_to_the_documented_schema(stub, stream):
    """The hand-made valid request fuzzing rarely finds, streaming and not: the answer is what the OpenAPI says
    (schemathesis reads a ``text/event-stream`` schema as the schema of each event: ``{data, event, id, retry}``)."""
    setup = ChatSetup(privacy=fake_privacy(), upstream=ChatUpstream(stub.url), models=["stub-model"],
                      options=ChatOptions(guardrail=True))
    body = {"model": "stub-model", "stream": stream, "messages": [{"role": "user", "content": "hello there"}]}
    with serving(create_privacy_gateway(chat=setup)) as url:
        response = conforming(url, "POST", "/v1/chat/completions", body=body, media_type="application/json")
    assert response.status_code == 200
