"""Issue 37 (harden round 3), items 3, 7, 8 and the last bullet of 10, on the LiteLLM guardrail, as LiteLLM 1.108.7
calls it (its body, its headers, and what it does with each answer: tests/support/litellm.py), on real uvicorn servers.

- 3: a repeated ``x-privlm-epsilon`` joined into one value (``"6, 1"``) gives its smallest, as on the chat route.
- 7: every body the guardrail route refuses is answered 200 ``BLOCKED``, whatever it is (nested 100,000 deep, not
  JSON, not an object): LiteLLM with ``fail_on_error: false`` forwards the original on an error status. The chat
  route of the same gateway keeps its 400.
- 8: a request whose answer is not ready by the guardrail's deadline (queue wait included, and its audit record) is
  answered ``BLOCKED`` then, before LiteLLM's own timeout would forward the original under ``fail_open``, and no
  charge of it stands; a slow memory write never holds the answer.
- 10: docs/litellm.md states what Cape costs per perturbed token, what a per-request epsilon saves, and what its
  example budget buys, as privlm's code computes them.
"""

from __future__ import annotations

import json
import math
import re
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from privlm.accounting import Ledger
from privlm.chat.service.audit import AuditLog
from privlm.chat.service.guardrail import END_USER_PREFIX, GUARDRAIL_PATH, KEY_PREFIX
from privlm.chat.service.memory import ConversationMemory, EarlierRelease
from privlm.chat.service.privacy import PromptPrivacy
from privlm.chat.service.upstream import ChatUpstream
from privlm.gateway import ChatSetup, create_privacy_gateway
from privlm.mechanisms import PrivacyUnit
from privlm.models.perturbation import PerturbedPrompt
from privlm.settings.chat import ChatOptions
from tests.service.localhost import serving
from tests.support import litellm
from tests.support.chat import EPS, TIMEOUT, FakePerturber, chat_body, fake_privacy
from tests.support.gateway import guardrail_app

ROOT = Path(__file__).parents[2]
SECRET = "Alice Smith from Boston has HIV"  # only ever in requests that must be blocked, or perturbed
COST = EPS * len(SECRET.split())  # FakePerturber charges EPS per word
MEMBERS = (KEY_PREFIX + litellm.KEY_HASH, END_USER_PREFIX + litellm.END_USER)  # the default joint principal's
DEEP = 100_000


def spent(ledger: Ledger) -> float:
    """What the request's principal (LiteLLM's key and end user, charged together) has spent: the same for each. The
    two are read one after the other, so a charge or refund may commit between them: read again, a few times."""
    for _ in range(5):
        key, end_user = (ledger.spent(member, PrivacyUnit.EPSILON) for member in MEMBERS)
        if key == end_user:
            return key
    raise AssertionError(f"the key spent {key} and the end user {end_user}: not charged together")


def post(client: httpx.Client, content: bytes, content_type: str = "application/json") -> httpx.Response:
    """Raw bytes, with LiteLLM's headers."""
    return client.post(GUARDRAIL_PATH, content=content, headers=litellm.headers() | {"content-type": content_type})


def blocked_reason(answer: httpx.Response) -> str:
    """A 200 BLOCKED, which LiteLLM never forwards past, however it is set; its reason."""
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["action"] == "BLOCKED" and "texts" not in body, body
    for fallback in ("fail_closed", "fail_open"):
        for fail_on_error in (True, False):
            assert litellm.outcome(answer, unreachable_fallback=fallback, fail_on_error=fail_on_error) == "blocked"
    assert SECRET not in body["blocked_reason"]
    return str(body["blocked_reason"])


def nested(depth: int) -> bytes:
    """LiteLLM's body with ``tools`` nested ``depth`` arrays deep."""
    head, tail = json.dumps(litellm.body([SECRET])).rsplit("}", 1)
    return f'{head}, "tools": {"[" * depth}{"]" * depth}}}{tail}'.encode()


@pytest.fixture
def guardrail() -> Iterator[httpx.Client]:
    """The guardrail without a model (nothing here gets as far as perturbing)."""
    with serving(guardrail_app(fake_privacy())) as url, httpx.Client(base_url=url, timeout=TIMEOUT) as http:
        yield http


# -- 3: a repeated epsilon header -----------------------------------------------------------------------------------

@pytest.mark.parametrize(("header", "applied"), [("6, 1", 1.0), ("1,6", 1.0), ("4, 2, 3", 2.0)])
def test_round3_3_the_guardrail_takes_the_smallest_of_a_joined_epsilon_header(tmp_path, header, applied):
    """A header sent twice reaches privlm joined (``"6, 1"``: a proxy appended its cap). BLOCKED on the guardrail
    before ("must be a number"), while the chat route took the smallest; now the guardrail releases at the smallest
    too, and charges for it."""
    ledger = Ledger(tmp_path / "l.sqlite", budgets={PrivacyUnit.EPSILON: 1000.0})
    with (serving(guardrail_app(fake_privacy(ledger=ledger))) as url,
          httpx.Client(base_url=url, timeout=TIMEOUT) as http):
        answer = http.post(GUARDRAIL_PATH, headers=litellm.headers(),
                           json=litellm.body([SECRET], client_headers={"x-privlm-epsilon": header}))
    assert answer.status_code == 200 and answer.json()["action"] == "GUARDRAIL_INTERVENED", answer.text
    assert float(answer.headers["x-privlm-epsilon"]) == applied
    assert spent(ledger) == applied * len(SECRET.split())


@pytest.mark.parametrize(("header", "named"), [("6, x", "must be a number"), ("6,", "must be a number"),
                                               ("1, 60", "never raise")])
def test_round3_3_every_value_of_a_joined_epsilon_header_is_checked(guardrail, header, named):
    """The other side: a value that is not a number, or one above the guardrail's epsilon, blocks the request even
    beside a valid one (none may raise the epsilon)."""
    answer = guardrail.post(GUARDRAIL_PATH, headers=litellm.headers(),
                            json=litellm.body([SECRET], client_headers={"x-privlm-epsilon": header}))
    reason = blocked_reason(answer)
    assert "x-privlm-epsilon" in reason and named in reason, reason


# -- 7: every refusal of the guardrail route is BLOCKED -----------------------------------------------------------

def test_round3_7_guardrail_blocks_an_over_deep_body(tmp_path):
    """The issue's body, nested 100,000 deep: a 400 on main (FastAPI cannot parse it), which a LiteLLM with
    ``fail_on_error: false`` answers by forwarding the original. Now BLOCKED, audited, nothing charged."""
    ledger = Ledger(tmp_path / "l.sqlite", budgets={PrivacyUnit.EPSILON: 100.0})
    audit = AuditLog(tmp_path / "audit.jsonl")
    app = guardrail_app(fake_privacy(ledger=ledger), audit=audit)
    with serving(app) as url, httpx.Client(base_url=url, timeout=TIMEOUT) as http:
        for body in (nested(DEEP), b"[" * DEEP + b"]" * DEEP):
            assert "RecursionError" in blocked_reason(post(http, body))
        assert blocked_reason(post(http, nested(50)))  # deep enough to parse, and still not a valid request
    assert spent(ledger) == 0.0
    records = audit.records()
    assert [r["event"] for r in records] == ["blocked"] * 3
    assert SECRET not in json.dumps(records)


@pytest.mark.parametrize(("content", "named"), [
    (b"{not json", "JSONDecodeError"),
    (json.dumps(litellm.body([SECRET]))[:-7].encode(), "JSONDecodeError"),  # cut short
    (b'{"input_type": "request", "texts": ["\xff"]}', "UnicodeDecodeError"),
    (b'{"input_type": "request", "texts": [], "n": ' + b"7" * 5000 + b"}", "ValueError"),  # over Python's digits
    (b"", "JSONDecodeError"),
    (b"[1, 2]", "a JSON array"),
    (json.dumps([litellm.body([SECRET])]).encode(), "a JSON array"),
    (b'"texts"', "a JSON string"),
    (b"null", "a JSON null"),
    (b"7", "a JSON number"),
    (b"true", "a JSON boolean"),
], ids=["invalid", "truncated", "not utf-8", "too many digits", "empty", "array", "a request in an array", "string",
        "null", "number", "boolean"])
def test_round3_7_guardrail_blocks_every_body_that_is_not_a_json_object(guardrail, content, named):
    reason = blocked_reason(post(guardrail, content))
    assert named in reason and "nothing may be sent" in reason


def test_round3_7_guardrail_reads_a_request_whatever_its_content_type(guardrail):
    """FastAPI refused a body without a JSON content type (400); the guardrail reads it as LiteLLM's request."""
    answer = post(guardrail, json.dumps(litellm.body([SECRET], input_type="response")).encode(),
                  content_type="text/plain")
    assert answer.status_code == 200 and answer.json() == {"action": "NONE"}, answer.text


def test_round3_7_the_gateway_blocks_on_its_guardrail_and_keeps_its_400_on_chat(stub):
    """One gateway (chat and guardrail): the over-deep body is BLOCKED on the guardrail route, and still a 400 in
    OpenAI's shape on /v1/chat/completions, where an error status forwards nothing."""
    setup = ChatSetup(privacy=fake_privacy(), upstream=ChatUpstream(stub.url), options=ChatOptions(guardrail=True))
    stub.clear()
    with serving(create_privacy_gateway(chat=setup)) as url, httpx.Client(base_url=url, timeout=TIMEOUT) as http:
        assert "RecursionError" in blocked_reason(post(http, nested(DEEP)))
        head, tail = json.dumps(chat_body(SECRET)).rsplit("}", 1)
        chat = http.post("/v1/chat/completions", content=f'{head}, "x": {"[" * DEEP}{"]" * DEEP}}}{tail}'.encode(),
                         headers={"content-type": "application/json"})
    assert chat.status_code == 400 and set(chat.json()["error"]) == {"message", "type", "param", "code"}
    assert stub.received() == []


# -- 8: the guardrail's deadline ------------------------------------------------------------------------------------

DEADLINE = 1.0  # seconds: LiteLLM's `timeout: 1` of the issue would be just above it


class Held:
    """A perturber gate: the first perturbation charges, draws, then holds the device model until ``release``."""

    def __init__(self) -> None:
        self.entered, self.release = threading.Event(), threading.Event()
        self.calls = 0


def held_privacy(held: Held, ledger: Ledger | None = None) -> PromptPrivacy:
    class Holding(FakePerturber):
        def perturb_batch(self, texts: Sequence[str]) -> list[PerturbedPrompt]:
            out = super().perturb_batch(texts)  # charged first, then drawn
            held.calls += 1
            held.entered.set()
            assert held.release.wait(60)
            return out

    return fake_privacy(Holding, ledger=ledger)


def wait_for(condition: Any, what: str, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_round3_8_a_burst_past_the_guardrail_deadline_is_blocked_and_charges_nothing(tmp_path):
    """The issue's burst: one request holds the device model (charged, still drawing) and one waits in the queue
    behind it. At the deadline both are answered BLOCKED (the device model still held): LiteLLM never forwards
    them, even set to fail open, and would not have timed out first. Neither charge stands once their releases are
    done (nothing of them left the machine), and the audit log says what happened, without the text. On main the
    route had no deadline: both waited for the device model, however long."""
    held = Held()
    ledger = Ledger(tmp_path / "l.sqlite", budgets={PrivacyUnit.EPSILON: 1000.0})
    audit = AuditLog(tmp_path / "audit.jsonl")
    app = guardrail_app(held_privacy(held, ledger), audit=audit, guardrail_deadline=DEADLINE)
    body = litellm.body([SECRET])
    with serving(app) as url, httpx.Client(base_url=url, timeout=TIMEOUT) as http, ThreadPoolExecutor(2) as pool:
        started = time.monotonic()
        first = pool.submit(http.post, GUARDRAIL_PATH, json=body, headers=litellm.headers())
        assert held.entered.wait(30)
        assert spent(ledger) == COST  # charged, and the device model held
        second = pool.submit(http.post, GUARDRAIL_PATH, json=body, headers=litellm.headers())
        answers = [first.result(timeout=20), second.result(timeout=20)]  # on main: held until release
        answered_in = time.monotonic() - started
        assert not held.release.is_set()
        for answer in answers:
            assert "deadline (1 s)" in blocked_reason(answer)
        held.release.set()  # the device model goes on: the first's release finishes, then the queued one's
        wait_for(lambda: held.calls == 2 and spent(ledger) == 0.0,
                 "both releases done, and both charges given back")
        wait_for(lambda: [r["event"] for r in audit.records()].count("refunded") == 2, "both refunds audited")
    assert answered_in < DEADLINE + 5
    records = audit.records()
    assert [r["event"] for r in records].count("blocked") == 2
    assert all(r["guardrail_deadline_s"] == DEADLINE for r in records if r["event"] == "blocked")
    assert sorted(r["refunded"] for r in records if r["event"] == "refunded") == [COST, COST]
    assert SECRET not in json.dumps(records)


class _SlowMemory(ConversationMemory):
    """A conversation memory that takes ``seconds`` to read (a database under load)."""

    def __init__(self, seconds: float) -> None:
        super().__init__(None)
        self.seconds = seconds

    def releases(self, principal: str, texts: Sequence[str], **kwargs: Any) -> list[EarlierRelease | None]:
        time.sleep(self.seconds)
        return super().releases(principal, texts, **kwargs)


def test_round3_8_the_deadline_is_checked_before_the_charge(tmp_path):
    """The deadline passed before the request reached the device model (here, a slow memory read): BLOCKED, and
    the mechanism never ran, so nothing was charged."""
    held = Held()
    held.release.set()
    ledger = Ledger(tmp_path / "l.sqlite", budgets={PrivacyUnit.EPSILON: 1000.0})
    app = guardrail_app(held_privacy(held, ledger), memory=_SlowMemory(DEADLINE + 0.2),
                               guardrail_deadline=DEADLINE)
    with serving(app) as url, httpx.Client(base_url=url, timeout=TIMEOUT) as http:
        answer = http.post(GUARDRAIL_PATH, json=litellm.body([SECRET]), headers=litellm.headers())
    assert "deadline" in blocked_reason(answer)
    assert held.calls == 0 and spent(ledger) == 0.0


def test_round3_8_a_bad_guardrail_deadline_is_refused():
    for bad in (0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="--guardrail-deadline"):
            guardrail_app(fake_privacy(), guardrail_deadline=bad)


AUDIT_DEADLINE = 2.0  # seconds: the fake mechanism is done within milliseconds, far inside it even on a loaded machine


class _SlowAuditLog(AuditLog):
    """An audit log whose first ``released`` record takes longer than :data:`AUDIT_DEADLINE` to write (a disk under
    load); every other record is written at once."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.slowed = False

    def write(self, event: str, record: Mapping[str, Any]) -> None:
        if event == "released" and not self.slowed:
            self.slowed = True
            time.sleep(AUDIT_DEADLINE + 0.5)
        super().write(event, record)


def test_round3_8_a_release_audited_past_the_deadline_is_blocked_given_back_and_not_remembered(tmp_path):
    """Review finding 3: after the deadline's last check, the route still wrote the audit record, and answered however
    long that took (LiteLLM, timed out, forwards the original under ``fail_open``, while privlm has charged). Now the
    deadline is checked again after the record: BLOCKED, the charge given back, and nothing remembered, so the next
    request with the same text is released afresh, and charged."""
    ledger = Ledger(tmp_path / "l.sqlite", budgets={PrivacyUnit.EPSILON: 1000.0})
    audit = _SlowAuditLog(tmp_path / "audit.jsonl")
    app = guardrail_app(fake_privacy(ledger=ledger), audit=audit, memory=ConversationMemory(None),
                               guardrail_deadline=AUDIT_DEADLINE)
    with serving(app) as url, httpx.Client(base_url=url, timeout=TIMEOUT) as http:
        late = http.post(GUARDRAIL_PATH, json=litellm.body([SECRET]), headers=litellm.headers())
        assert "deadline (2 s)" in (reason := blocked_reason(late)) and "no charge stands" in reason, reason
        assert spent(ledger) == 0.0
        again = http.post(GUARDRAIL_PATH, json=litellm.body([SECRET]), headers=litellm.headers())
    assert again.json()["action"] == "GUARDRAIL_INTERVENED", again.text
    assert again.headers["x-privlm-texts-remembered"] == "0"  # the blocked release was never remembered
    assert spent(ledger) == COST
    records = audit.records()
    assert [r["event"] for r in records] == ["released", "blocked", "released"]
    assert records[1]["refunded"] == COST and records[1]["guardrail_deadline_s"] == AUDIT_DEADLINE
    assert SECRET not in json.dumps(records)


class _HeldMemory(ConversationMemory):
    """A conversation memory whose writes wait until ``release`` is set (a database under load)."""

    def __init__(self) -> None:
        super().__init__(None)
        self.release, self.written = threading.Event(), threading.Event()

    def remember_releases(self, principal: str, released: Sequence[tuple[str, EarlierRelease]]) -> None:
        assert self.release.wait(60)
        super().remember_releases(principal, released)
        self.written.set()


def test_round3_8_a_slow_memory_write_never_holds_the_answer(tmp_path):
    """Review finding 3: the memory write came before the answer, so a slow one held it past LiteLLM's timeout. Now
    it runs after the answer: the answer comes while the write is still held. A repeat of the same text sent
    meanwhile waits for the write (within its own deadline), and is then sent as released, free."""
    ledger = Ledger(tmp_path / "l.sqlite", budgets={PrivacyUnit.EPSILON: 1000.0})
    memory = _HeldMemory()
    app = guardrail_app(fake_privacy(ledger=ledger), memory=memory)
    with (serving(app) as url, httpx.Client(base_url=url, timeout=TIMEOUT) as http, ThreadPoolExecutor(2) as pool):
        def send() -> httpx.Response:
            return http.post(GUARDRAIL_PATH, json=litellm.body([SECRET]), headers=litellm.headers())

        try:
            first = pool.submit(send).result(timeout=20)  # on main: held with the write
            assert first.json()["action"] == "GUARDRAIL_INTERVENED", first.text
            repeat = pool.submit(send)
            time.sleep(0.5)  # time for the repeat to reach the route (on a loaded machine it may not: no matter)
            assert not repeat.done()  # waiting for the first's write
        finally:
            memory.release.set()  # before the server stops: it waits for the write's thread
        again = repeat.result(timeout=20)
    assert memory.written.is_set()
    assert again.json()["texts"] == first.json()["texts"]
    assert again.headers["x-privlm-texts-remembered"] == "1" and float(again.headers["x-privlm-epsilon-spent"]) == 0
    assert spent(ledger) == COST


# -- 10: what Cape costs, in docs/litellm.md --------------------------------------------------------------------------

# One-sentence prompts: the docs' "typical prompt" is their average.
SENTENCES = ("My neighbour Alice Smith was diagnosed with diabetes in Boston.",
             "My friend Alice lives in Paris near the river with her cat Tom and works as a nurse.",
             "Alice Smith was diagnosed with diabetes in Boston last spring.",
             "I am Maria Gonzalez from Rotterdam and my doctor says I have asthma; what should I ask her tomorrow?")


def test_round3_10_litellm_md_states_capes_cost_per_perturbed_token_as_the_code_computes_it(smollm2_lm):
    """Every figure of docs/litellm.md's "What a release costs", recomputed: Cape's sound charge per perturbed token
    (eps + ln(N_b) + ln(|C|)), the share a per-request epsilon of 2 saves, and what the example budget buys."""
    privacy = PromptPrivacy.cape(smollm2_lm, epsilon=6.0, logit_bound=30.0)
    per_token = {}
    for eps in (6.0, 4.0, 2.0):
        result = privacy.privatize(list(SENTENCES), principal="docs", epsilon=eps)
        per_token[eps] = result.spent / result.tokens_perturbed
    overhead = per_token[6.0] - 6.0
    assert per_token[4.0] - 4.0 == pytest.approx(overhead) and per_token[2.0] - 2.0 == pytest.approx(overhead)
    prompt_tokens, prompt_perturbed = result.tokens / len(SENTENCES), result.tokens_perturbed / len(SENTENCES)
    text = (ROOT / "docs" / "litellm.md").read_text()
    section = " ".join(text[text.index("**What a release costs.**"):text.index("**Conversations.**")].split())
    run_it = text[text.index("## Run it"):text.index("## LiteLLM's `config.yaml`")]
    found = re.search(r"--chat-budget (\d+)", run_it)
    assert found is not None
    budget = float(found.group(1))  # the example's
    stated = [f"eps + {overhead:.2f}", f"{math.log(50):.3f} + {overhead - math.log(50):.3f}",
              *(f"{per_token[eps]:.2f}" for eps in (6.0, 4.0, 2.0)),
              f"{2 / per_token[4.0]:.1%}", f"{4 / per_token[6.0]:.1%}",
              f"{prompt_tokens:.0f} tokens", f"{prompt_perturbed:.1f} of them perturbed",
              f"{prompt_perturbed * per_token[4.0]:.0f}",
              f"{budget:,.0f} / {per_token[4.0]:.2f} = {budget / per_token[4.0]:,.0f} perturbed tokens",
              f"{budget / per_token[4.0] / prompt_perturbed:,.0f} such prompts",
              f"{budget / per_token[6.0] / prompt_perturbed:,.0f} at epsilon 6",
              f"5,000 / {per_token[4.0]:.2f} = {5000 / per_token[4.0]:.0f} perturbed tokens",
              f"about {5000 / 16 / per_token[4.0]:.0f} perturbed tokens at epsilon 4, against {prompt_perturbed:.1f}"]
    missing = [figure for figure in stated if figure not in section]
    assert not missing, (missing, section)
