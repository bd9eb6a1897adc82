"""Round 3 of the red team (issue 37), conversation memory and the chat route: a hostile upstream cannot plant texts
that later cross verbatim and free (1), one answer cannot flush another key's memory (2), a repeated
``x-privlm-epsilon`` cannot raise the epsilon (3), a restored answer memory lost never crosses when a later request
turns restore off (5), and restoring a long answer does not stall other callers (10).

The upstream is scripted by model name (:func:`scripted_app`); the mechanisms are the model-free test ones.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

import privlm.chat.service.completions as chat_module
from privlm.accounting import Ledger
from privlm.chat.service.memory import ConversationMemory, EarlierRelease
from privlm.mechanisms import PrivacyUnit
from privlm.settings.chat import ChatOptions
from tests.service.localhost import serving
from tests.support.chat import (
    ECHO_PREFIX,
    EPS,
    TIMEOUT,
    FakePerturber,
    NamePerturber,
    StubUpstream,
    assert_openai_error,
    chat_gateway,
    echoed,
    fake_privacy,
)

ALICE, BOB = "round3-key-alice", "round3-key-bob"
PLANTED = ("I have HIV", "Seattle", "yes")  # what the hostile upstream writes: one choice each
MANY = 60  # choices in the flooding answer
FIRST = "My friend Maria Gonzalez moved from Rotterdam to the city."


def _completion(contents: list[str]) -> dict[str, Any]:
    return {"id": "chatcmpl-scripted", "object": "chat.completion", "created": 1700000000, "model": "scripted",
            "choices": [{"index": i, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
                        for i, text in enumerate(contents)]}


def _event(payload: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()


def scripted_app(record: StubUpstream) -> FastAPI:
    """``plant``: one choice per text of :data:`PLANTED`, whatever ``n``; ``many``: :data:`MANY` choices;
    ``cut``: the echo (tests/support/chat.py) streamed, and the stream closed before ``[DONE]``; any other model:
    the echo, whole."""
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body = await record.take(request)
        model = body.get("model")
        if model == "plant":
            return JSONResponse(_completion(list(PLANTED)))
        if model == "many":
            return JSONResponse(_completion([f"Answer number {i} of many" for i in range(MANY)]))
        if model == "long-stream":  # one chunk of over 100 kB, then [DONE]
            text = echoed(body) + " filler" * 20_000
            head = {"id": "chatcmpl-long", "object": "chat.completion.chunk", "created": 1700000000, "model": "long"}
            events = [_event({**head, "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": "stop"}]}),
                      b"data: [DONE]\n\n"]
            return StreamingResponse(iter(events), media_type="text/event-stream")
        if model == "cut":
            text = echoed(body)
            head = {"id": "chatcmpl-cut", "object": "chat.completion.chunk", "created": 1700000000, "model": "cut"}
            events = [_event({**head, "choices": [{"index": 0, "delta": {"content": text[i:i + 4]},
                                                   "finish_reason": None}]}) for i in range(0, len(text), 4)]
            return StreamingResponse(iter(events), media_type="text/event-stream")  # no finish, no [DONE]
        return JSONResponse(_completion([echoed(body)]))

    return app


@pytest.fixture
def scripted() -> Iterator[tuple[StubUpstream, str]]:
    record = StubUpstream()
    with serving(scripted_app(record)) as url:
        yield record, url


def ledger_at(tmp_path: Path) -> Ledger:
    return Ledger(tmp_path / "ledger.sqlite", budgets={PrivacyUnit.EPSILON: 10_000.0})


def spent(ledger: Ledger, key: str = ALICE) -> float:
    return ledger.spent(ledger.principal_of_key(key), PrivacyUnit.EPSILON)


def ask(url: str, messages: list[dict[str, Any]], *, key: str = ALICE, model: str = "echo",
        headers: list[tuple[str, str]] | None = None, **fields: Any) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", timeout=TIMEOUT,
                      headers=[("authorization", f"Bearer {key}"), *(headers or [])],
                      json={"model": model, "messages": messages, **fields})


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict[str, str]:
    return {"role": "assistant", "content": text}


@pytest.fixture(params=["sqlite", "postgresql"])
def memory_at(request: pytest.FixtureRequest, tmp_path: Path) -> ConversationMemory:
    if request.param == "sqlite":
        return ConversationMemory(tmp_path / "memory.sqlite")
    url = request.getfixturevalue("postgres_url")
    return ConversationMemory(url, secret=tmp_path / "memory.secret")


# -- 1: a text the upstream wrote is free only as the same whole assistant message --------------------------------
def test_round3_1_an_upstream_text_typed_as_a_user_message_is_perturbed_and_charged(scripted, memory_at, tmp_path):
    record, upstream = scripted
    ledger = ledger_at(tmp_path)
    with chat_gateway(fake_privacy(FakePerturber, ledger=ledger), upstream, api_keys=[ALICE, BOB], memory=memory_at,
                      options=ChatOptions(restore=True)) as url:
        planted = ask(url, [user("Tell me something")], model="plant")
        assert [c["message"]["content"] for c in planted.json()["choices"]] == list(PLANTED)
        for text in PLANTED:  # the upstream's words as the user's own: new texts, perturbed and charged
            before = spent(ledger)
            typed = ask(url, [user(text)])
            assert typed.status_code == 200, typed.text
            assert typed.headers["x-privlm-texts-remembered"] == "0"
            assert float(typed.headers["x-privlm-epsilon-spent"]) == EPS * len(text.split())
            assert spent(ledger) == before + EPS * len(text.split())
            assert record.last_messages()[0]["content"] != text
        # The other side (bob, whose memory holds only his own): the first choice sent back as the same whole
        # assistant message goes up as the upstream wrote it, free.
        ask(url, [user("Tell me something")], model="plant", key=BOB)
        before = spent(ledger, BOB)
        history = ask(url, [user("Tell me something"), assistant(PLANTED[0])], key=BOB, privlm={"report": True})
        assert history.status_code == 200, history.text
        assert [t["remembered"] for t in history.json()["privlm"]["texts"]] == [True, True]
        assert spent(ledger, BOB) == before and history.headers["x-privlm-epsilon-spent"] == "0"
        assert record.last_messages()[1] == assistant(PLANTED[0])
        # As part of a longer assistant message, or an extra choice the request did not ask for: perturbed.
        for text in (PLANTED[0] + " and more", PLANTED[1]):
            again = ask(url, [user("Tell me something"), assistant(text)], key=BOB, privlm={"report": True})
            assert [t["remembered"] for t in again.json()["privlm"]["texts"]] == [True, False]
            assert float(again.headers["x-privlm-epsilon-spent"]) == EPS * len(text.split())
            assert record.last_messages()[1]["content"] != text


def test_round3_1_memory_keeps_the_users_releases_and_the_upstreams_answers_apart(memory_at):
    memory = memory_at
    memory.remember_answers("alice", [("Seattle", "Seattle"), ("Hi Maria", "Hi Jake")])
    memory.remember_releases("alice", [("Maria lives here", EarlierRelease("Jake lives here"))])
    assert memory.releases("alice", ["Seattle", "Hi Maria"]) == [None, None]  # not the user's own
    assert memory.releases("alice", ["Seattle", "Hi Maria"], whole_answers=[True, True]) == [
        EarlierRelease("Seattle"), EarlierRelease("Hi Jake")]
    assert memory.releases("alice", ["Maria lives here"], whole_answers=[True]) == [
        EarlierRelease("Jake lives here")]  # its own release, in any role
    assert memory.releases("bob", ["Seattle"], whole_answers=[True]) == [None]


# -- 2: memory bounded per principal -------------------------------------------------------------------------------
def test_round3_2_one_answer_with_many_choices_does_not_flush_another_keys_memory(scripted, tmp_path):
    """The store's bound is 50 entries here; alice's answer has 60 choices. Only the choices asked for (n = 1) are
    kept, so bob's release stays, and his resend is free and identical."""
    record, upstream = scripted
    ledger = ledger_at(tmp_path)
    memory = ConversationMemory(tmp_path / "memory.sqlite", max_entries=50)
    with chat_gateway(fake_privacy(FakePerturber, ledger=ledger), upstream, api_keys=[ALICE, BOB], memory=memory,
                      options=ChatOptions(restore=True)) as url:
        ask(url, [user("Bob writes about his own plans")], key=BOB)
        first_sent = record.last_messages()[0]["content"]
        flood = ask(url, [user("Hello")], model="many")
        assert len(flood.json()["choices"]) == MANY
        bob_spent = spent(ledger, BOB)
        again = ask(url, [user("Bob writes about his own plans")], key=BOB)
    assert again.headers["x-privlm-texts-remembered"] == "1" and again.headers["x-privlm-epsilon-spent"] == "0"
    assert spent(ledger, BOB) == bob_spent
    assert record.last_messages()[0]["content"] == first_sent  # no second, differently noised copy
    assert len(memory) == 2 + 2  # each key's release and its one answer


def test_round3_2_memory_is_bounded_per_principal_in_entries_and_bytes_and_per_entry():
    memory = ConversationMemory(max_principal_entries=3, max_principal_bytes=400, max_entry_bytes=200)
    memory.remember_releases("bob", [("bob's", EarlierRelease("kept"))])
    memory.remember_releases("alice", [(f"text {i}", EarlierRelease(f"release {i}")) for i in range(10)])
    assert memory.releases("bob", ["bob's"]) == [EarlierRelease("kept")]  # another principal's flood
    assert sum(r is not None for r in memory.releases("alice", [f"text {i}" for i in range(10)])) == 3
    memory.remember_releases("carol", [("huge", EarlierRelease("x" * 300))])  # one entry over 200 bytes
    assert memory.releases("carol", ["huge"]) == [None]
    for i in range(3):  # three entries of ~150 bytes: over 400 bytes in all, so the oldest goes
        memory.remember_releases("dave", [(f"long {i}", EarlierRelease(f"{i}" * 120))])
    assert [r is not None for r in memory.releases("dave", [f"long {i}" for i in range(3)])] == [False, True, True]
    assert memory.releases("bob", ["bob's"]) == [EarlierRelease("kept")]


def test_round3_2_n_is_capped_and_only_the_choices_asked_for_are_remembered(scripted, tmp_path):
    from privlm.chat.service.completions import MAX_CHOICES, MAX_REMEMBERED_CHOICES  # new in round 3

    record, upstream = scripted
    memory = ConversationMemory()
    with chat_gateway(fake_privacy(FakePerturber), upstream, api_keys=[ALICE], memory=memory,
                      options=ChatOptions(restore=True)) as url:
        record.clear()
        refused = ask(url, [user("Hello")], n=MAX_CHOICES + 1)
        assert_openai_error(refused, 400)
        assert record.received() == []
        ask(url, [user("Hello")], model="many", n=MAX_CHOICES)
    assert len(memory) == 1 + MAX_REMEMBERED_CHOICES  # the release and the first 16 choices of 60


# -- 3: a repeated x-privlm-epsilon ------------------------------------------------------------------------------
@pytest.mark.parametrize("headers", [[("x-privlm-epsilon", "6"), ("x-privlm-epsilon", "1")],
                                     [("x-privlm-epsilon", "1"), ("x-privlm-epsilon", "6")],
                                     [("x-privlm-epsilon", "6, 1")]], ids=["6-then-1", "1-then-6", "one-list"])
def test_round3_3_a_repeated_epsilon_header_gives_its_smallest_value(scripted, headers):
    _, upstream = scripted
    with chat_gateway(fake_privacy(FakePerturber), upstream, api_keys=[ALICE]) as url:
        answer = ask(url, [user("Alice has asthma")], headers=headers)
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-privlm-epsilon"] == "1"
    assert float(answer.headers["x-privlm-epsilon-spent"]) == 1.0 * 3


# -- 5: a restored answer memory does not know, sent back with restore off -------------------------------------------
def test_round3_5_a_restored_answer_cut_before_done_is_perturbed_when_restore_is_turned_off(scripted, tmp_path):
    record, upstream = scripted
    ledger = ledger_at(tmp_path)
    memory = ConversationMemory(tmp_path / "memory.sqlite")
    with chat_gateway(fake_privacy(NamePerturber, ledger=ledger), upstream, api_keys=[ALICE], memory=memory,
                      options=ChatOptions(restore=True)) as url:
        with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=TIMEOUT,
                          headers={"authorization": f"Bearer {ALICE}"},
                          json={"model": "cut", "messages": [user(FIRST)], "stream": True}) as cut:
            raw = b"".join(cut.iter_bytes())
        restored = "".join(json.loads(line[5:])["choices"][0]["delta"].get("content") or ""
                           for line in raw.split(b"\n") if line.startswith(b"data:") and b'"choices": [{' in line)
        assert restored == ECHO_PREFIX + FIRST  # restored, and never remembered (no [DONE])
        before = spent(ledger)
        record.clear()
        follow = ask(url, [user(FIRST), assistant(restored), user("Thanks")], privlm={"restore": False,
                                                                                      "report": True})
    assert follow.status_code == 200, follow.text
    assert not record.received("Maria") and not record.received("Rotterdam")
    assert record.last_messages()[1] == assistant(ECHO_PREFIX + "My friend Jake Rodriguez moved from Denver to "
                                                                "the city.")
    texts = follow.json()["privlm"]["texts"]
    assert [(t["role"], t["remembered"]) for t in texts] == [("user", True), ("assistant", False), ("user", False)]
    assert spent(ledger) == before + 3 * EPS  # the assistant text's three replaced words, charged


# -- 10: restore runs off the event loop ----------------------------------------------------------------------------
RESTORE_SECONDS = 3.0  # how long the tests below make one restore take


def health_wait_behind_a_slow_restore(monkeypatch: pytest.MonkeyPatch, restore: str, upstream: str,
                                      send: Any) -> tuple[float, Any]:
    """Make ``restore`` (a function of the chat module) take :data:`RESTORE_SECONDS`, run ``send(url)`` in a thread
    against a restoring gateway, and time a health check sent while the restore runs; (seconds waited, what
    ``send`` returned)."""
    original = getattr(chat_module, restore)
    started = threading.Event()

    def slow(*args: Any) -> Any:
        started.set()
        time.sleep(RESTORE_SECONDS)
        return original(*args)

    monkeypatch.setattr(chat_module, restore, slow)
    result: dict[str, Any] = {}
    with chat_gateway(fake_privacy(NamePerturber), upstream, api_keys=[ALICE],
                      options=ChatOptions(restore=True)) as url:
        chat = threading.Thread(target=lambda: result.setdefault("sent", send(url)))
        chat.start()
        assert started.wait(TIMEOUT)
        began = time.monotonic()
        assert httpx.get(f"{url}/health", timeout=TIMEOUT).status_code == 200
        waited = time.monotonic() - began
        chat.join(TIMEOUT)
    return waited, result["sent"]


def test_round3_10_restoring_a_long_answer_does_not_stall_other_callers(scripted, monkeypatch):
    """Restoring a whole answer is made to take 3 s; a health check sent meanwhile must not wait for it."""
    waited, answer = health_wait_behind_a_slow_restore(monkeypatch, "_restore_completion", scripted[1],
                                                       lambda url: ask(url, [user(FIRST)]))
    assert answer.json()["choices"][0]["message"]["content"] == ECHO_PREFIX + FIRST
    assert waited < 1.0, f"a health check waited {waited:.2f} s behind a restore"


def test_round3_10_restoring_a_long_stream_chunk_does_not_stall_other_callers(scripted, monkeypatch):
    """The same for a stream whose one chunk is over 100 kB."""
    def stream(url: str) -> bytes:
        with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=TIMEOUT,
                          headers={"authorization": f"Bearer {ALICE}"},
                          json={"model": "long-stream", "messages": [user(FIRST)], "stream": True}) as answer:
            return b"".join(answer.iter_bytes())

    waited, raw = health_wait_behind_a_slow_restore(monkeypatch, "_restore_chunk", scripted[1], stream)
    assert "Maria Gonzalez" in raw.decode()
    assert waited < 1.0, f"a health check waited {waited:.2f} s behind a restore"
