"""A traffic capture between the gateway and the upstream: the user's sensitive words never cross.

A TCP proxy (:class:`RecordingProxy`) sits between the gateway and the stub upstream and records every byte the
gateway sends. A prompt with personal details goes through Cape at epsilon 1, streaming and not: none of its
sensitive words is in the capture. The negative control sends the same words in an assistant message (which the
gateway forwards unchanged, by design) through the same gateway and proxy, and the same search finds them all.

Why epsilon 1, and why a surviving word is not a flaky failure: a word crosses only if every one of its
perturbed tokens is released as itself. At epsilon 1 on SmolLM2 (B = 30) Cape keeps a token with probability of
about 0.03 to 0.04, so a one-token word would survive in 3% of runs; the sensitive words here are 3 to 6 tokens
long, so each survives with probability under 1e-4. The test computes these probabilities exactly from Cape's
own law (``log_probabilities`` of the very rows the gateway draws from) and asserts the bound, so the reasoning
is checked, not assumed. (Other ways to spell the word, other tokens drawn that happen to concatenate to it, are
rarer still: each needs specific draws whose probability is at most that of the kept tokens' bucket.)
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import NamedTuple

import httpx
import pytest

from privlm.cape import Cape
from privlm.chat.service.privacy import PromptPrivacy
from tests.service.localhost import RecordingProxy
from tests.support.chat import TIMEOUT, B, chat_body, chat_gateway

pytestmark = pytest.mark.slow

EPSILON = 1.0
PROMPT = "Patient Krzysztof Wojciechowski from Rotterdam, account 88412, has pneumonia."
SENSITIVE = ("Krzysztof", "Wojciechowski", "Rotterdam", "88412")
MAX_SURVIVAL = 1e-4


class Capture(NamedTuple):
    url: str  # the gateway
    proxy: RecordingProxy  # between the gateway and the stub


@pytest.fixture(scope="module")
def capture(smollm2_lm, stub) -> Iterator[Capture]:
    proxy = RecordingProxy(stub.port)
    privacy = PromptPrivacy.cape(smollm2_lm, epsilon=EPSILON, logit_bound=B)
    with chat_gateway(privacy, f"http://127.0.0.1:{proxy.port}") as url:
        yield Capture(url, proxy)
    proxy.close()


def leaked(traffic: bytes) -> list[str]:
    return [word for word in SENSITIVE if word.lower().encode() in traffic.lower()]


def survival_probabilities(smollm2_lm, text: str, words: tuple[str, ...]) -> dict[str, float]:
    """For each word of ``text``: the probability that Cape at ``EPSILON`` releases every token of it unchanged."""
    cape = Cape(smollm2_lm, epsilon=EPSILON, logit_bound=B)
    [prepared] = cape.prepare([text])
    log_p = cape.mechanism(EPSILON).log_probabilities(prepared.utilities)
    column = {int(token): j for j, token in enumerate(cape.vocabulary.candidate_ids.tolist())}
    kept = {i: float(log_p[row, column[prepared.tokens.ids[i]]].exp()) for row, i in enumerate(prepared.positions)}
    out = {}
    for word in words:
        start = text.index(word)
        inside = [i for i, (a, b) in enumerate(prepared.tokens.spans) if a < start + len(word) and b > start]
        assert all(i in kept for i in inside), word  # every token of a sensitive word goes through the mechanism
        out[word] = math.prod(kept[i] for i in inside)
    return out


def test_cape_makes_a_sensitive_word_surviving_by_chance_negligible(smollm2_lm):
    survival = survival_probabilities(smollm2_lm, PROMPT, SENSITIVE)
    assert all(p < MAX_SURVIVAL for p in survival.values()), survival


def test_the_negative_control_sees_words_sent_unperturbed(capture):
    """The detector works on this very capture: the same words in an assistant message (never perturbed) cross."""
    capture.proxy.clear()
    body = {"model": "stub-model", "messages": [{"role": "user", "content": "Who is the patient?"},
                                                {"role": "assistant", "content": PROMPT}]}
    response = httpx.post(f"{capture.url}/v1/chat/completions", json=body, timeout=TIMEOUT)
    assert response.status_code == 200, response.text
    assert leaked(bytes(capture.proxy.upstream)) == list(SENSITIVE)


def test_no_sensitive_word_of_the_prompt_crosses(capture):
    capture.proxy.clear()
    responses = [httpx.post(f"{capture.url}/v1/chat/completions", json=chat_body(PROMPT), timeout=TIMEOUT)]
    with httpx.stream("POST", f"{capture.url}/v1/chat/completions", json=chat_body(PROMPT, stream=True),
                      timeout=TIMEOUT) as streamed:
        streamed.read()
        responses.append(streamed)
    assert [r.status_code for r in responses] == [200, 200]
    sent = bytes(capture.proxy.upstream)
    assert sent.count(b"POST /v1/chat/completions") == 2 and b'"role":"user"' in sent  # the capture is real
    assert leaked(sent) == []
