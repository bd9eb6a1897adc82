"""cape-public behind the private chat gateway (the real ``openai`` client, the stub upstream, a SQLite ledger): the
spend of every request is exactly (perturbed tokens) x epsilon, in the headers, the report and the ledger, and the
upstream receives the released prompt only."""

from __future__ import annotations

import openai
import pytest

from privlm.accounting import Ledger
from privlm.chat.service.privacy import PromptPrivacy
from privlm.mechanisms import PrivacyUnit
from tests.support.chat import EPS, TIMEOUT, chat_gateway

pytestmark = pytest.mark.slow

KEY = "public-context-key"
PROMPTS = ["I am Maria Gonzalez, 34, from Seattle. My doctor says my asthma is getting worse.",
           "What should I ask her at my next appointment?"]


def test_the_spend_is_exactly_perturbed_tokens_times_epsilon(smollm2_lm, stub, tmp_path):
    ledger = Ledger(tmp_path / "ledger.sqlite", budgets={PrivacyUnit.EPSILON: 10_000.0})
    privacy = PromptPrivacy.of("cape-public", smollm2_lm, epsilon=EPS, logit_bound=None, ledger=ledger)
    stub.clear()
    with chat_gateway(privacy, stub.url, api_keys=[KEY]) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=TIMEOUT)
        total = 0.0
        for prompt in PROMPTS:
            raw = client.chat.completions.with_raw_response.create(
                model="stub-model", messages=[{"role": "user", "content": prompt}],
                extra_body={"privlm": {"report": True}})
            report = raw.parse().model_extra["privlm"]
            perturbed = int(raw.headers["x-privlm-tokens-perturbed"])
            assert raw.headers["x-privlm-mechanism"] == "cape-public" and perturbed > 0
            assert float(raw.headers["x-privlm-epsilon-spent"]) == perturbed * EPS  # exactly, no log terms
            sent = report["texts"][0]["sent"]
            assert sent != prompt and stub.received()[-1]["messages"][0]["content"] == sent
            total += perturbed * EPS
    principal = ledger.principal_of_key(KEY)
    assert ledger.spent(principal, PrivacyUnit.EPSILON) == pytest.approx(total)
    assert not any(prompt in str(body) for body in stub.received() for prompt in PROMPTS)
