"""Conversations through the gateway, with a deterministic mechanism (tests/support/chat.py's ``NamePerturber``)
and the stub's echo model, which answers the last user message as it arrived: restore (whole answers and
streams), conversation memory (a repeat sent identically and charged nothing; a restored answer sent back as the
upstream wrote it), and their failures (nothing sent, nothing kept)."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai

from privlm.accounting import Ledger
from privlm.chat.service.memory import ConversationMemory
from privlm.mechanisms import PrivacyUnit
from privlm.settings.chat import ChatOptions
from tests.support.chat import (
    ECHO,
    ECHO_PREFIX,
    EPS,
    SLOW,
    TIMEOUT,
    NamePerturber,
    assert_openai_error,
    chat_gateway,
    fake_privacy,
)

KEY = "conversation-key-1"
FIRST = "My friend Maria Gonzalez moved from Rotterdam to the city."
FIRST_SENT = "My friend Jake Rodriguez moved from Denver to the city."
SECOND = "Does Maria like Lisbon?"
SECOND_SENT = "Does Jake like Paris?"
AUTH = {"authorization": f"Bearer {KEY}"}


def ledger_at(tmp_path) -> Ledger:
    return Ledger(tmp_path / "ledger.sqlite", budgets={PrivacyUnit.EPSILON: 1000.0})


def gateway(stub_or_url: Any, *, ledger: Ledger | None = None, memory: ConversationMemory | None = None,
            restore: bool = True) -> Any:
    url = stub_or_url if isinstance(stub_or_url, str) else stub_or_url.url
    return chat_gateway(fake_privacy(NamePerturber, ledger=ledger), url, api_keys=[KEY], memory=memory,
                        options=ChatOptions(restore=restore))


def ask(url: str, messages: list[dict[str, Any]], **fields: Any) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", headers=AUTH, timeout=TIMEOUT,
                      json={"model": ECHO, "messages": messages, **fields})


def spent(ledger: Ledger) -> float:
    return ledger.spent(ledger.principal_of_key(KEY), PrivacyUnit.EPSILON)


def test_a_whole_answer_is_restored_and_the_report_counts_it(stub):
    with gateway(stub) as url:
        answer = ask(url, [{"role": "user", "content": FIRST}], privlm={"report": True})
    assert answer.status_code == 200, answer.text
    assert stub.received(FIRST_SENT) and not stub.received("Maria")  # the upstream saw the release only
    body = answer.json()
    assert body["choices"][0]["message"] == {"role": "assistant", "content": ECHO_PREFIX + FIRST}
    assert answer.headers["x-privlm-restored"] == "2"  # "Jake Rodriguez" and "Denver"
    assert answer.headers["x-privlm-restore-hold-chars"] == str(len("Jake Rodriguez"))
    assert body["privlm"]["restore"] == {"replacements": 4, "hold_chars": 14, "restored": 2,
                                         "upstream_content": [ECHO_PREFIX + FIRST_SENT]}


def test_a_request_may_turn_restore_off_but_not_on(stub):
    """A gateway without --restore sends the history's answers as they are (the upstream's own words), so it
    never restores one: a request asking for it is refused, before anything is charged or sent."""
    with gateway(stub, restore=True) as url:
        plain = ask(url, [{"role": "user", "content": FIRST}], privlm={"restore": False})
    assert plain.json()["choices"][0]["message"]["content"] == ECHO_PREFIX + FIRST_SENT
    assert "x-privlm-restored" not in plain.headers and "x-privlm-restore-hold-chars" not in plain.headers
    with gateway(stub, restore=False) as url:
        stub.clear()
        asked = ask(url, [{"role": "user", "content": FIRST}], privlm={"restore": True})
    assert_openai_error(asked, 400, code="restore_not_enabled", param="privlm.restore")
    assert stub.received() == []


def test_a_stream_is_restored_through_the_openai_client(stub):
    """The echo streams 3 characters a chunk, so replacements arrive cut in pieces; the last event before [DONE]
    says how many were restored and the most characters held back."""
    with gateway(stub) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=TIMEOUT)
        with client.chat.completions.with_streaming_response.create(
                model=ECHO, messages=[{"role": "user", "content": FIRST}], stream=True,
                extra_body={"privlm": {"report": True}}) as response:
            assert response.headers["x-privlm-restore-hold-chars"] == "14"
            chunks = list(response.parse())
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ECHO_PREFIX + FIRST
    last = (chunks[-1].model_extra or {})["privlm"]["restore"]
    assert last["restored"] == 2 and 0 < last["held_chars_most"] <= 14
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_memory_sends_a_repeat_identically_charges_it_nothing_and_never_sends_a_restored_span(stub, tmp_path):
    ledger, memory = ledger_at(tmp_path), ConversationMemory(tmp_path / "memory.sqlite")
    with gateway(stub, ledger=ledger, memory=memory) as url:
        stub.clear()
        first = ask(url, [{"role": "user", "content": FIRST}], privlm={"report": True})
        assert spent(ledger) == 3 * EPS and first.headers["x-privlm-texts-remembered"] == "0"
        restored = first.json()["choices"][0]["message"]["content"]
        assert restored == ECHO_PREFIX + FIRST
        history = [{"role": "user", "content": FIRST}, {"role": "assistant", "content": restored}]
        second = ask(url, [*history, {"role": "user", "content": SECOND}], privlm={"report": True})
    assert second.status_code == 200, second.text
    assert spent(ledger) == 3 * EPS + 2 * EPS  # the second message only
    report = second.json()["privlm"]
    assert [(t["role"], t["remembered"]) for t in report["texts"]] == [("user", True), ("assistant", True),
                                                                      ("user", False)]
    assert report["epsilon_spent"] == 2 * EPS
    assert second.headers["x-privlm-texts-remembered"] == "2"
    sent = stub.received()[-1]["messages"]
    assert sent == [{"role": "user", "content": FIRST_SENT},
                    {"role": "assistant", "content": ECHO_PREFIX + FIRST_SENT},  # as the upstream wrote it
                    {"role": "user", "content": SECOND_SENT}]
    assert not stub.received("Maria") and not stub.received("Rotterdam")


def test_one_text_twice_in_a_request_is_perturbed_and_charged_once(stub, tmp_path):
    ledger = ledger_at(tmp_path)
    with gateway(stub, ledger=ledger, memory=ConversationMemory()) as url:
        answer = ask(url, [{"role": "user", "content": SECOND}, {"role": "user", "content": SECOND}],
                     privlm={"report": True})
    assert spent(ledger) == 2 * EPS
    assert [t["remembered"] for t in answer.json()["privlm"]["texts"]] == [False, True]


def test_without_memory_a_restored_history_is_perturbed_and_charged_again(stub, tmp_path):
    """With restore, an assistant text the gateway cannot tell for the upstream's own words may hold the user's:
    without memory it is perturbed, and charged, like user text (and each user message pays again)."""
    ledger = ledger_at(tmp_path)
    with gateway(stub, ledger=ledger) as url:
        restored = ask(url, [{"role": "user", "content": FIRST}]).json()["choices"][0]["message"]["content"]
        assert restored == ECHO_PREFIX + FIRST
        stub.clear()
        answer = ask(url, [{"role": "user", "content": FIRST}, {"role": "assistant", "content": restored},
                           {"role": "user", "content": SECOND}])
    assert answer.status_code == 200 and "x-privlm-texts-remembered" not in answer.headers
    assert spent(ledger) == 3 * EPS + (3 * EPS + 3 * EPS + 2 * EPS)
    assert stub.received()[-1]["messages"][1] == {"role": "assistant", "content": ECHO_PREFIX + FIRST_SENT}
    assert not stub.received("Maria")


def test_an_answer_memory_knows_goes_up_as_the_upstream_wrote_it_even_with_restore_off(stub, tmp_path):
    """A client may turn restore off after a restored turn: the history's answer still goes up unrestored."""
    memory = ConversationMemory()
    with gateway(stub, memory=memory) as url:
        restored = ask(url, [{"role": "user", "content": FIRST}]).json()["choices"][0]["message"]["content"]
        stub.clear()
        answer = ask(url, [{"role": "user", "content": FIRST}, {"role": "assistant", "content": restored},
                           {"role": "user", "content": SECOND}], privlm={"restore": False, "report": True})
    texts = answer.json()["privlm"]["texts"]
    assert [(t["role"], t["remembered"]) for t in texts] == [("user", True), ("assistant", True), ("user", False)]
    assert stub.received()[-1]["messages"][1] == {"role": "assistant", "content": ECHO_PREFIX + FIRST_SENT}
    assert not stub.received("Maria")


def test_a_release_is_remembered_only_once_the_upstream_has_it(stub, tmp_path):
    """While the first request is with a slow upstream, a second with the same text does not find it: it is
    released and charged on its own (kept earlier, it could go up free while the first, never sent, is
    refunded)."""
    ledger, memory = ledger_at(tmp_path), ConversationMemory()
    with gateway(stub, ledger=ledger, memory=memory) as url, ThreadPoolExecutor(1) as pool:
        stub.clear()
        slow = pool.submit(httpx.post, f"{url}/v1/chat/completions", headers=AUTH, timeout=TIMEOUT,
                           json={"model": SLOW, "messages": [{"role": "user", "content": FIRST}]})
        deadline = time.monotonic() + 10
        while not stub.received(FIRST_SENT) and time.monotonic() < deadline:  # the upstream has the first
            time.sleep(0.05)
        second = ask(url, [{"role": "user", "content": FIRST}])
        assert slow.result().status_code == 200
    assert second.headers["x-privlm-texts-remembered"] == "0"
    assert spent(ledger) == 2 * 3 * EPS


def test_a_release_that_never_left_is_not_remembered(stub, tmp_path):
    """The upstream cannot be reached: the charge is refunded, and nothing is remembered, so the next request
    releases the text afresh and pays for it (a free repeat of an unpaid release would be free text)."""
    ledger, memory = ledger_at(tmp_path), ConversationMemory()
    with gateway("http://127.0.0.1:9", ledger=ledger, memory=memory) as url:  # port 9: discard, nothing listens
        failed = ask(url, [{"role": "user", "content": FIRST}])
    assert failed.status_code >= 500 and failed.headers["x-privlm-refunded"] == str(int(3 * EPS))
    assert spent(ledger) == 0 and len(memory) == 0
    with gateway(stub, ledger=ledger, memory=memory) as url:
        answer = ask(url, [{"role": "user", "content": FIRST}])
    assert answer.headers["x-privlm-texts-remembered"] == "0" and spent(ledger) == 3 * EPS


def test_a_memory_that_cannot_be_read_fails_closed_before_any_charge(stub, tmp_path):
    ledger, memory = ledger_at(tmp_path), ConversationMemory()
    memory.close()
    with gateway(stub, ledger=ledger, memory=memory) as url:
        stub.clear()
        answer = ask(url, [{"role": "user", "content": FIRST}])
    assert_openai_error(answer, 500, code="memory_failed")
    assert spent(ledger) == 0 and stub.received() == []
    assert "Maria" not in json.dumps(answer.json())


class ForgetfulMemory(ConversationMemory):
    def remember_releases(self, principal: str, released: Any) -> None:
        raise OSError("disk full")


def test_a_release_memory_cannot_keep_is_answered_and_its_repeat_paid_again(stub, tmp_path):
    """The upstream has the release when memory fails to keep it: the answer stands, and a later repeat is
    released afresh and charged (never free)."""
    ledger = ledger_at(tmp_path)
    with gateway(stub, ledger=ledger, memory=ForgetfulMemory()) as url:
        answers = [ask(url, [{"role": "user", "content": FIRST}]) for _ in range(2)]
    assert [a.status_code for a in answers] == [200, 200]
    assert [a.headers["x-privlm-texts-remembered"] for a in answers] == ["0", "0"]
    assert spent(ledger) == 2 * 3 * EPS
