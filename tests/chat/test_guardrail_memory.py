"""Conversation memory behind the LiteLLM guardrail: LiteLLM sends every text of the conversation every turn, so
with memory a text the guardrail released before (for the same key and end user) is answered as it was released,
and charged nothing; without it, each turn releases and charges the whole history again."""

from __future__ import annotations

from typing import Any

import httpx

from privlm.accounting import Ledger, joint_principal
from privlm.chat.service.audit import AuditLog
from privlm.chat.service.guardrail import END_USER_PREFIX, GUARDRAIL_PATH, KEY_PREFIX
from privlm.chat.service.memory import ConversationMemory
from privlm.mechanisms import PrivacyUnit
from tests.service.localhost import serving
from tests.support import litellm
from tests.support.chat import EPS, NamePerturber, fake_privacy
from tests.support.gateway import guardrail_app

FIRST, FIRST_SENT = "Maria Gonzalez lives in Rotterdam.", "Jake Rodriguez lives in Denver."
SECOND, SECOND_SENT = "Does Maria like Lisbon?", "Does Jake like Paris?"
PRINCIPAL = joint_principal(KEY_PREFIX + litellm.KEY_HASH, END_USER_PREFIX + litellm.END_USER)


def turns(tmp_path: Any, memory: ConversationMemory | None) -> tuple[list[httpx.Response], Ledger]:
    """Two turns as LiteLLM posts them: the second carries the first message, the answer, and a new message."""
    ledger = Ledger(tmp_path / "ledger.sqlite", budgets={PrivacyUnit.EPSILON: 1000.0})
    app = guardrail_app(fake_privacy(NamePerturber, ledger=ledger), memory=memory)
    history = [{"role": "user", "content": FIRST}]
    answers = []
    with serving(app) as url, httpx.Client(base_url=url, timeout=60) as http:
        for message in (None, SECOND):
            if message is not None:
                history += [{"role": "assistant", "content": "Jake is fine."}, {"role": "user", "content": message}]
            answers.append(http.post(GUARDRAIL_PATH, json=litellm.body(messages=history), headers=litellm.headers()))
    return answers, ledger


def test_with_memory_a_repeated_text_is_answered_as_released_before_and_charged_nothing(tmp_path):
    (first, second), ledger = turns(tmp_path, ConversationMemory())
    assert first.json()["texts"] == [FIRST_SENT] and first.headers["x-privlm-texts-remembered"] == "0"
    assert second.json()["texts"] == [FIRST_SENT, "Jake is fine.", SECOND_SENT]
    assert second.headers["x-privlm-texts-remembered"] == "1"
    assert ledger.remaining(PRINCIPAL, PrivacyUnit.EPSILON) == 1000.0 - 3 * EPS - 2 * EPS  # each message once


def test_without_memory_every_turn_pays_for_the_whole_history(tmp_path):
    (_, second), ledger = turns(tmp_path, None)
    assert "x-privlm-texts-remembered" not in second.headers
    assert ledger.remaining(PRINCIPAL, PrivacyUnit.EPSILON) == 1000.0 - 3 * EPS - 3 * EPS - 2 * EPS


class BrokenMemory(ConversationMemory):
    def remember_releases(self, principal: str, released: Any) -> None:
        raise OSError("disk full")


def test_a_release_memory_cannot_keep_is_answered_and_its_repeat_paid_again(tmp_path):
    (first, second), ledger = turns(tmp_path, BrokenMemory())
    assert first.json()["texts"] == [FIRST_SENT] and second.headers["x-privlm-texts-remembered"] == "0"
    assert ledger.remaining(PRINCIPAL, PrivacyUnit.EPSILON) == 1000.0 - 3 * EPS - 3 * EPS - 2 * EPS


def test_end_users_of_one_key_never_share_memory_even_when_the_key_alone_is_charged(tmp_path):
    """Charged by key only, two end users still read memories of their own: a free, faster answer would tell one
    that the other sent the text."""
    app = guardrail_app(fake_privacy(NamePerturber), guardrail_charge="key", memory=ConversationMemory())
    with serving(app) as url, httpx.Client(base_url=url, timeout=60) as http:
        answers = [http.post(GUARDRAIL_PATH, headers=litellm.headers(), json=litellm.body(
            [FIRST], request_data={"user_api_key_hash": litellm.KEY_HASH, "user_api_key_end_user_id": user}))
            for user in ("customer-1", "customer-2", "customer-1")]
    assert [a.headers["x-privlm-texts-remembered"] for a in answers] == ["0", "0", "1"]


class FailingAudit(AuditLog):
    def write(self, event: str, record: Any) -> None:
        raise OSError("disk full")


def test_a_release_blocked_for_want_of_an_audit_record_is_refunded_and_not_remembered(tmp_path):
    ledger = Ledger(tmp_path / "ledger.sqlite", budgets={PrivacyUnit.EPSILON: 1000.0})
    memory = ConversationMemory()
    app = guardrail_app(fake_privacy(NamePerturber, ledger=ledger), memory=memory,
                               audit=FailingAudit(tmp_path / "audit.jsonl"))
    with serving(app) as url, httpx.Client(base_url=url, timeout=60) as http:
        answer = http.post(GUARDRAIL_PATH, json=litellm.body([FIRST]), headers=litellm.headers())
    assert answer.json()["action"] == "BLOCKED" and "audit log" in answer.json()["blocked_reason"]
    assert ledger.remaining(PRINCIPAL, PrivacyUnit.EPSILON) == 1000.0 and len(memory) == 0
