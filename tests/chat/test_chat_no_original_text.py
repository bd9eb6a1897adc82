"""No original text anywhere: after successes, 400s, a 401, a 429, upstream 4xx and 5xx, an unreachable upstream
and a failing mechanism, every one carrying a prompt with personal details, the original words are in none of the
audit log (JSON lines, then SQLite), the ledger database, the error bodies and the log output at DEBUG; nor are
the callers' keys and the upstream's key.

Cape runs at epsilon 1, where a sensitive word of this prompt survives with probability under 1e-4
(tests/chat/test_chat_capture.py computes such bounds); a word that the upstream did receive, by chance, is a
perturbed word and allowed, so it is left out of the search (the test asserts that almost none is).
"""

from __future__ import annotations

import logging
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest

from privlm.accounting import Ledger
from privlm.chat.service.audit import AuditLog
from privlm.chat.service.privacy import PromptPrivacy
from privlm.chat.service.upstream import ChatUpstream
from privlm.mechanisms import PrivacyUnit
from tests.chat.test_chat_fail_closed import broken
from tests.service.localhost import dead_url, serving
from tests.support.chat import FAILING, MISSING, TIMEOUT, B, chat_body, fake_privacy
from tests.support.gateway import chat_app

pytestmark = pytest.mark.slow

SECRET = "Patient Krzysztof Wojciechowski (passport XK4471903) from Scheveningen has pneumonia."
SENSITIVE = ("Krzysztof", "Wojciechowski", "XK4471903", "Scheveningen")
KEY_A, KEY_B, KEY_C = "key-audited-a1", "key-audited-b2", "key-audited-c3"  # each can afford two
UPSTREAM_KEY = "sk-upstream-never-logged-0042"
LOGGERS = ("privlm", "httpx", "httpcore", "uvicorn", "uvicorn.error", "uvicorn.access", "fastapi")


def start(stack: ExitStack, privacy: PromptPrivacy, upstream_url: str, audit_path: Path) -> str:
    """A gateway with keys A, B and C, auditing to ``audit_path``, served until ``stack`` closes; its URL."""
    upstream = ChatUpstream(upstream_url, read_timeout=30, api_key=UPSTREAM_KEY)
    app = chat_app(privacy, upstream, api_keys=[KEY_A, KEY_B, KEY_C], audit=AuditLog(audit_path))
    return stack.enter_context(serving(app))


def requests_with_the_secret(good: str, dead: str, failing: str) -> list[tuple[str, dict[str, Any]]]:
    """(url, httpx.request kwargs) of every kind of answer, each carrying SECRET somewhere."""
    def call(url: str, body: Any = None, key: str = KEY_A, headers: dict[str, str] | None = None,
             content: bytes | None = None) -> tuple[str, dict[str, Any]]:
        sent: dict[str, Any] = {"content": content} if content is not None else {"json": body}
        return url, {**sent, "headers": {"authorization": f"Bearer {key}", **(headers or {})}}

    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    return [
        call(good, chat_body(SECRET, privlm={"report": True})),  # 200
        call(good, chat_body(SECRET, stream=True)),  # 200, streamed
        call(good, chat_body(SECRET)),  # 429: the budget holds two
        call(good, chat_body(SECRET, privlm={"epsilon": 5}), key=KEY_B),  # 400 above the limit
        call(good, {"model": "m", "messages": [{"role": "patient", "content": SECRET}]}, key=KEY_B),  # 400 role
        call(good, {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": SECRET}, image]}]},
             key=KEY_B),  # 400 non-text part
        call(good, chat_body(SECRET * 60), key=KEY_B),  # 400 over-long
        call(good, chat_body(SECRET), key=KEY_B, headers={"x-privlm-epsilon": SECRET}),  # 400 header epsilon
        call(good, key=KEY_B, content=b'{"model": "m", "messages": [{"content": "' + SECRET.encode()),  # 400 JSON
        call(good, chat_body(SECRET), key="wrong-key"),  # 401
        call(good, chat_body(SECRET, model=FAILING), key=KEY_B),  # 502 upstream 5xx
        call(good, chat_body(SECRET, model=MISSING, stream=True), key=KEY_B),  # 404 passed through
        call(dead, chat_body(SECRET), key=KEY_C),  # 502 unreachable
        call(failing, chat_body(SECRET), key=KEY_C),  # 500 fail closed
    ]


EXPECTED = [200, 200, 429, 400, 400, 400, 400, 400, 400, 401, 502, 404, 502, 500]


def files_bytes(*paths: Path) -> bytes:
    """Every file that starts with one of ``paths`` (SQLite's -wal and -shm included)."""
    return b"".join(f.read_bytes() for path in paths for f in sorted(path.parent.glob(path.name + "*")) if f.is_file())


@pytest.fixture(params=[".jsonl", ".sqlite"])
def audit_path(request, tmp_path) -> Path:
    return tmp_path / f"audit{request.param}"


def test_no_original_text_in_audit_ledger_errors_or_logs(smollm2_lm, stub, audit_path, tmp_path, caplog):
    ledger_path = tmp_path / "ledger.sqlite"
    cost = PromptPrivacy.cape(smollm2_lm, epsilon=1.0, logit_bound=B).privatize([SECRET], principal="probe").spent
    ledger = Ledger(ledger_path, budgets={PrivacyUnit.EPSILON: 2.5 * cost})
    privacy = PromptPrivacy.cape(smollm2_lm, epsilon=1.0, logit_bound=B, ledger=ledger, max_prompt_tokens=256)
    stub.clear()
    with ExitStack() as stack:
        good = start(stack, privacy, stub.url, audit_path)
        dead = start(stack, privacy, stack.enter_context(dead_url()), audit_path)
        failing = start(stack, fake_privacy(broken("raises"), ledger=ledger), stub.url, audit_path)
        saved = {name: logging.getLogger(name).propagate for name in LOGGERS}  # uvicorn's do not propagate
        try:
            caplog.set_level(logging.DEBUG)
            for name in LOGGERS:
                caplog.set_level(logging.DEBUG, logger=name)
                logging.getLogger(name).propagate = True
            answers = []
            for url, kwargs in requests_with_the_secret(good, dead, failing):
                with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=TIMEOUT, **kwargs) as response:
                    answers.append((response, response.read()))
        finally:
            for name, propagate in saved.items():
                logging.getLogger(name).propagate = propagate
    assert [r.status_code for r, _ in answers] == EXPECTED, [(r.status_code, b[:200]) for r, b in answers]

    records = AuditLog(audit_path).records()
    sent = [text["sent"] for r in records if r["event"] == "released" for text in r["texts"]]
    released = " ".join(sent)
    searched = [word for word in SENSITIVE if word not in released]  # a perturbed word equal by chance is allowed
    assert len(searched) >= len(SENSITIVE) - 1, released
    places = {
        "audit file": files_bytes(audit_path).decode("utf-8", "replace"),
        "audit records": repr(AuditLog(audit_path).records()),
        "ledger": files_bytes(ledger_path).decode("utf-8", "replace"),
        "error bodies": " ".join(body.decode("utf-8", "replace") for r, body in answers if r.status_code != 200),
        "logs": "\n".join(f"{r.name} {r.getMessage()} {r.exc_text or ''}" for r in caplog.records),
    }
    found = {place: [w for w in searched if w.lower() in text.lower()] for place, text in places.items()}
    assert found == {place: [] for place in places}, found
    assert SECRET not in " ".join(places.values())
    keys = {place: [k for k in (KEY_A, KEY_B, KEY_C, UPSTREAM_KEY) if k in text] for place, text in places.items()}
    assert keys == {place: [] for place in places}, keys  # nor any key: principals are hashes
    assert stub.headers[0]["authorization"] == f"Bearer {UPSTREAM_KEY}"  # the upstream key was in use

    # The places searched are real. The audit holds every release and its report (what the upstream got): two
    # successes, the upstream's 5xx and 4xx, and the one whose upstream was unreachable; the logs hold the traffic.
    assert len(sent) == 5 and set(sent) >= {m["content"] for body in stub.received() for m in body["messages"]}
    assert sorted(r["status"] for r in records if r["event"] == "upstream") == [200, 200, 404, 500, 502, 502]
    assert all(r["epsilon_spent"] > 0 and r["principal"].startswith("hmac-key:")
               for r in records if r["event"] == "released")
    assert "POST /v1/chat/completions" in places["logs"] and "HTTP Request" in places["logs"]
    assert places["error bodies"].count('"error"') == len([c for c in EXPECTED if c != 200])
