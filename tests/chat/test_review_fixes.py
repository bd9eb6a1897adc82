"""What an independent review found, pinned: a lone surrogate is a 400 (not a 500), an upstream failure after a
charge still carries the report and is audited, a gateway that extracts answers perturbs the assistant history it
returned, and the guardrail is off unless asked for and refuses over-long ids."""

from __future__ import annotations

import httpx
import pytest

from privlm.accounting import Ledger
from privlm.chat.service.audit import AuditLog
from privlm.chat.service.messages import perturbed_fields
from privlm.chat.service.upstream import ChatUpstream
from privlm.chat.wire import ChatCompletionRequest
from privlm.gateway import ChatSetup, create_privacy_gateway
from privlm.mechanisms import PrivacyUnit
from privlm.settings.chat import ChatOptions
from tests.service.localhost import serving
from tests.support.chat import FAILING, TIMEOUT, assert_openai_error, chat_body, chat_gateway, fake_privacy

GUARDRAIL = "/beta/litellm_basic_guardrail_api"


def test_a_lone_surrogate_is_a_400_and_nothing_is_forwarded(stub):
    stub.clear()
    with chat_gateway(fake_privacy(), stub.url) as url:
        for content in ('"a\\ud800b"', '[{"type": "text", "text": "a\\udc00"}]'):
            raw = '{"model": "stub-model", "messages": [{"role": "user", "content": ' + content + '}]}'
            response = httpx.post(f"{url}/v1/chat/completions", content=raw,
                                  headers={"content-type": "application/json"}, timeout=TIMEOUT)
            assert_openai_error(response, 400)
    assert stub.received() == []


@pytest.mark.parametrize("stream", [False, True])
def test_an_upstream_failure_after_the_charge_carries_the_report_and_is_audited(tmp_path, stub, stream):
    # An upstream that received the release and failed: the charge stands (the text was published), the error
    # carries the report, and no SDK retry may pay again (an unreachable upstream is refunded instead: see
    # test_hostile_upstream.py).
    ledger = Ledger(tmp_path / "ledger.sqlite", budgets={PrivacyUnit.EPSILON: 1000.0})
    audit = AuditLog(tmp_path / "audit.jsonl")
    with chat_gateway(fake_privacy(ledger=ledger), stub.url, audit=audit) as url:
        response = httpx.post(f"{url}/v1/chat/completions",
                              json=chat_body("Alice lives here", model=FAILING, stream=stream), timeout=TIMEOUT)
    assert_openai_error(response, 502, code="upstream_failed")
    spent = float(response.headers["x-privlm-epsilon-spent"])
    assert spent > 0 and ledger.spent("anonymous", PrivacyUnit.EPSILON) == pytest.approx(spent)
    assert float(response.headers["x-privlm-budget-remaining"]) == pytest.approx(1000.0 - spent)
    assert response.headers["x-should-retry"] == "false"
    events = [(r["event"], r.get("status"), r.get("code")) for r in audit.records()]
    assert events == [("released", None, None), ("upstream", 500, None), ("upstream", 502, "upstream_failed")]


def test_assistant_text_is_perturbed_only_when_asked():
    request = ChatCompletionRequest.model_validate({"model": "m", "messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "Alice, you live in Boston"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function",
                                                                 "function": {"name": "f", "arguments": "{}"}}]}]})
    assert [slot.role for slot in perturbed_fields(request).slots] == ["user"]
    fields = perturbed_fields(request, perturb_assistant=True)
    assert [(slot.role, text) for slot, text in zip(fields.slots, fields.texts, strict=True)] == [
        ("user", "hi"), ("assistant", "Alice, you live in Boston")]


def test_the_guardrail_is_off_by_default_and_refuses_over_long_ids(stub):
    privacy = fake_privacy(ledger=None)
    assert ChatSetup(privacy=privacy, upstream=ChatUpstream(stub.url)).options.guardrail is False
    setup = ChatSetup(privacy=privacy, upstream=ChatUpstream(stub.url), options=ChatOptions(guardrail=True))
    with serving(create_privacy_gateway(chat=setup)) as url:
        body = {"texts": ["Alice lives in Boston"], "input_type": "request",
                "request_data": {"user_api_key_hash": "x" * 257}}
        answer = httpx.post(url + GUARDRAIL, json=body, timeout=TIMEOUT).json()
    assert answer["action"] == "BLOCKED" and "256" in answer["blocked_reason"]
    assert "Alice" not in answer["blocked_reason"]
