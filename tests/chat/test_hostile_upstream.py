"""The chat gateway against a hostile upstream (issue 22: findings 2, 3 and 4, and the note on retries).

The red team's scripts as a raw-socket upstream on localhost that misbehaves on purpose, by model name: an answer
of 256 MiB (sent chunked, or with its length declared), an answer that trickles in a byte at a time, a stream
of events that never ends, a stream that trickles bytes but never completes an event, streams cut in the middle
of an event, a 500 and a 429; and a port with nothing on it, for an upstream that cannot be reached. The
mechanism is the model-free ``FakePerturber``: these tests are about the forwarding, not about Cape.
"""

from __future__ import annotations

import asyncio
import json
import socket
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from privlm.accounting import Ledger
from privlm.chat.service.audit import AuditLog
from privlm.chat.service.privacy import PromptPrivacy
from privlm.chat.service.upstream import ChatUpstream
from privlm.mechanisms import PrivacyUnit
from tests.service.localhost import dead_url, serving
from tests.support.chat import CANNED, CHUNKS, EPS, assert_openai_error, chat_body, fake_privacy, sse_events
from tests.support.gateway import chat_app

KEY = "hostile-test-key"
PROMPT = "Alice Smith from Boston has asthma."
COST = EPS * len(PROMPT.split())  # what FakePerturber charges for PROMPT
BUDGET = 100 * COST
MIB = 2**20
HUGE_MIB = 256  # the huge answers (the red team sent 512 MiB; 256 is far past the 32 MiB cap)
TRICKLE_S = 0.3  # seconds between two bytes of a trickle
DEADLINE_S = 2.0  # the short deadline of these tests' gateways
WAIT_S = 30.0  # the client's own limit: far above every deadline here (a shared 2-core machine)


# -- the hostile upstream -----------------------------------------------------------------------------------
def _http_head(status: str, content_type: str, length: int | None = None) -> bytes:
    framing = f"content-length: {length}" if length is not None else "transfer-encoding: chunked"
    return (f"HTTP/1.1 {status}\r\ncontent-type: {content_type}\r\n{framing}\r\nconnection: close\r\n\r\n"
            ).encode()


def _chunk(data: bytes) -> bytes:
    """One chunk of a chunked body."""
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


class HostileUpstream:
    """An HTTP/1.1 upstream on raw sockets, one thread per connection. ``requests``: the JSON bodies received;
    ``sent``: body bytes written for the latest huge answer (before the gateway hung up)."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.requests: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []  # each request's headers, names in lower case
        self.sent = 0
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def clear(self) -> None:
        with self.lock:
            self.requests.clear()
            self.headers.clear()
            self.sent = 0

    def received(self) -> int:
        with self.lock:
            return len(self.requests)

    def close(self) -> None:
        self.listener.close()

    def _accept(self) -> None:
        while True:
            try:
                connection, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(connection,), daemon=True).start()

    def _serve(self, connection: socket.socket) -> None:
        with connection, suppress(OSError):  # the gateway hanging up is the point of most behaviours
            headers, body = _read_request(connection)
            with self.lock:
                self.requests.append(body)
                self.headers.append(headers)
            behaviour = BEHAVIOURS.get(str(body.get("model")), _canned)
            behaviour(self, connection, body)

    def count(self, n: int) -> None:
        with self.lock:
            self.sent += n


def _read_request(connection: socket.socket) -> tuple[dict[str, str], dict[str, Any]]:
    data = b""
    while b"\r\n\r\n" not in data:
        data += connection.recv(65536)
    head, body = data.split(b"\r\n\r\n", 1)
    lines = head.decode("latin-1").lower().split("\r\n")[1:]
    headers = {name.strip(): value.strip() for name, _, value in (line.partition(":") for line in lines)}
    length = int(headers["content-length"])
    while len(body) < length:
        body += connection.recv(65536)
    return headers, dict(json.loads(body))


def _canned(upstream: HostileUpstream, connection: socket.socket, body: dict[str, Any]) -> None:
    if body.get("stream"):
        connection.sendall(_http_head("200 OK", "text/event-stream") + b"".join(map(_chunk, CHUNKS)) + b"0\r\n\r\n")
    else:
        connection.sendall(_http_head("200 OK", "application/json", len(CANNED)) + CANNED)


def _huge(upstream: HostileUpstream, connection: socket.socket, body: dict[str, Any], *, declared: bool = False,
          status: str = "200 OK") -> None:
    """HUGE_MIB of JSON-ish bytes, one MiB at a time (never held here: memory is the gateway's to show)."""
    block = b"a" * MIB
    connection.sendall(_http_head(status, "application/json", HUGE_MIB * MIB if declared else None))
    for _ in range(HUGE_MIB):
        connection.sendall(block if declared else _chunk(block))
        upstream.count(MIB)
    if not declared:
        connection.sendall(b"0\r\n\r\n")


def _huge_event(upstream: HostileUpstream, connection: socket.socket, body: dict[str, Any]) -> None:
    """A stream whose one event never ends: ``data: aaaa...`` for HUGE_MIB."""
    connection.sendall(_http_head("200 OK", "text/event-stream") + _chunk(CHUNKS[0]) + _chunk(b"data: "))
    block = _chunk(b"a" * MIB)
    for _ in range(HUGE_MIB):
        connection.sendall(block)
        upstream.count(MIB)


def _trickle(upstream: HostileUpstream, connection: socket.socket, body: dict[str, Any]) -> None:
    """A whole answer, one byte every TRICKLE_S (the red team's was a byte every 2 s against a 5 s timeout)."""
    connection.sendall(_http_head("200 OK", "application/json", len(CANNED)))
    for i in range(len(CANNED)):
        connection.sendall(CANNED[i:i + 1])
        time.sleep(TRICKLE_S)


def _endless_events(upstream: HostileUpstream, connection: socket.socket, body: dict[str, Any]) -> None:
    """A stream of whole events, one every 0.1 s, for a minute: never idle, never done."""
    connection.sendall(_http_head("200 OK", "text/event-stream") + _chunk(CHUNKS[0]))
    for _ in range(600):
        connection.sendall(_chunk(CHUNKS[1]))
        time.sleep(0.1)


def _trickled_event(upstream: HostileUpstream, connection: socket.socket, body: dict[str, Any]) -> None:
    """One whole event, then a second one a byte every TRICKLE_S: bytes keep coming, no event ends."""
    connection.sendall(_http_head("200 OK", "text/event-stream") + _chunk(CHUNKS[0]))
    for i in range(len(CHUNKS[1])):
        connection.sendall(_chunk(CHUNKS[1][i:i + 1]))
        time.sleep(TRICKLE_S)


CUT_MID_JSON = CHUNKS[2][:40]  # `data: {"id": "chatcmpl-stub", "object": "c`
CUT_MID_FIELD = CHUNKS[2][:2]  # `da`: glued to a `data:` line that follows, a field SSE ignores
CUT_AFTER_LINE = CHUNKS[2][:-1]  # a whole `data:` line, without the blank line that ends the event


def _cut(partial: bytes) -> Callable[[HostileUpstream, socket.socket, dict[str, Any]], None]:
    """Two whole events, then ``partial``, then the connection dropped (no end of the chunked body)."""
    def behaviour(upstream: HostileUpstream, connection: socket.socket, body: dict[str, Any]) -> None:
        connection.sendall(_http_head("200 OK", "text/event-stream") + _chunk(CHUNKS[0]) + _chunk(CHUNKS[1]))
        time.sleep(0.2)
        connection.sendall(_chunk(partial))
        time.sleep(0.2)
        connection.shutdown(socket.SHUT_RDWR)
    return behaviour


def _status(status: str) -> Callable[[HostileUpstream, socket.socket, dict[str, Any]], None]:
    def behaviour(upstream: HostileUpstream, connection: socket.socket, body: dict[str, Any]) -> None:
        error = json.dumps({"error": {"message": "no", "type": "server_error", "param": None, "code": None}}).encode()
        connection.sendall(_http_head(status, "application/json", len(error)) + error)
    return behaviour


def _forged_headers(upstream: HostileUpstream, connection: socket.socket, body: dict[str, Any]) -> None:
    """A good answer whose headers speak for the gateway: a refund, a cost, a retry hint."""
    head = _http_head("200 OK", "application/json", len(CANNED)).replace(
        b"\r\n\r\n", b"\r\nx-privlm-refunded: 99\r\nx-privlm-epsilon-spent: 0\r\nx-privlm-fields-dropped: none"
                       b"\r\nx-should-retry: true\r\n\r\n")
    connection.sendall(head + CANNED)


BEHAVIOURS: dict[str, Callable[[HostileUpstream, socket.socket, dict[str, Any]], None]] = {
    "hostile:forged-headers": _forged_headers,
    "hostile:huge": _huge,
    "hostile:huge-declared": lambda u, c, b: _huge(u, c, b, declared=True),
    "hostile:huge-error": lambda u, c, b: _huge(u, c, b, status="400 Bad Request"),
    "hostile:huge-event": _huge_event,
    "hostile:trickle": _trickle,
    "hostile:endless-events": _endless_events,
    "hostile:trickled-event": _trickled_event,
    "hostile:cut-mid-json": _cut(CUT_MID_JSON),
    "hostile:cut-mid-field": _cut(CUT_MID_FIELD),
    "hostile:cut-after-line": _cut(CUT_AFTER_LINE),
    "hostile:500": _status("500 Internal Server Error"),
    "hostile:429": _status("429 Too Many Requests"),
}


@pytest.fixture(scope="module")
def hostile() -> Iterator[HostileUpstream]:
    upstream = HostileUpstream()
    yield upstream
    upstream.close()


@contextmanager
def gateway(upstream: ChatUpstream, *, privacy: PromptPrivacy | None = None, **service: Any) -> Iterator[str]:
    """The private chat gateway in front of ``upstream``, with one key, on a real server; yields its URL."""
    with serving(chat_app(privacy or fake_privacy(), upstream, api_keys=[KEY], **service)) as url:
        yield url


def post(url: str, model: str, *, stream: bool = False) -> tuple[httpx.Response, bytes]:
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=chat_body(PROMPT, model=model, stream=stream),
                      headers={"authorization": f"Bearer {KEY}"}, timeout=WAIT_S) as response:
        return response, response.read()


def error_event(body: bytes) -> dict[str, Any]:
    """The error of a stream's last event."""
    return dict(json.loads(sse_events(body)[-1].removeprefix(b"data: "))["error"])


# -- finding 2: a non-streaming answer was read whole, with no limit ----------------------------------------
class ResidentPeak:
    """This process's resident set, sampled every 10 ms from a thread: the peak over the baseline, in MiB."""

    def __init__(self) -> None:
        self.baseline = self.peak = self._resident()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def _resident() -> float:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * 4096 / MIB

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, self._resident())

    def __enter__(self) -> ResidentPeak:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def growth(self) -> float:
        return self.peak - self.baseline


@pytest.mark.parametrize("model", ["hostile:huge", "hostile:huge-declared"])
def test_finding_2_upstream_answer_over_the_cap_is_a_502_and_memory_stays_flat(hostile, model):
    """256 MiB answered to a gateway at its default cap (32 MiB): a 502 in OpenAI's shape once the cap is passed,
    the rest never read; the gateway (this process) grows by far less than the answer, at its peak."""
    hostile.clear()
    with (gateway(ChatUpstream(hostile.url)) as url, ResidentPeak() as memory,
          httpx.stream("POST", f"{url}/v1/chat/completions", json=chat_body(PROMPT, model=model),
                       headers={"authorization": f"Bearer {KEY}"}, timeout=WAIT_S) as response):
        assert response.status_code == 502  # before the body: on a 200, reading it would hold it all here
        response.read()
    assert_openai_error(response, 502, code="upstream_answer_too_large")
    assert response.headers["x-should-retry"] == "false"  # it was charged: a retry would pay again
    print(f"{model}: the gateway's peak RSS grew by {memory.growth:.1f} MiB; the upstream wrote "
          f"{hostile.sent / MIB:.1f} MiB before the gateway hung up")  # shown with -s
    assert memory.growth < 96, f"the gateway grew by {memory.growth:.0f} MiB"
    assert hostile.sent < HUGE_MIB * MIB // 2  # the gateway hung up long before the end


def test_finding_2_the_cap_is_exact_and_holds_for_stream_events_and_stream_errors(hostile):
    """``max_answer_bytes`` (``--max-upstream-answer-bytes``): an answer of exactly the cap passes whole, one byte
    more is a 502; a stream's event over the cap ends the stream with an error event; a stream's error answer
    is read within the cap too."""
    exact = len(CANNED)
    with gateway(ChatUpstream(hostile.url, max_answer_bytes=exact)) as at_cap, \
            gateway(ChatUpstream(hostile.url, max_answer_bytes=exact - 1)) as below:
        response, body = post(at_cap, "stub-model")
        assert response.status_code == 200 and body == CANNED
        response, _ = post(below, "stub-model")
        assert_openai_error(response, 502, code="upstream_answer_too_large")
    with gateway(ChatUpstream(hostile.url, max_answer_bytes=MIB)) as url:
        response, body = post(url, "hostile:huge-event", stream=True)
        assert response.status_code == 200 and sse_events(body)[0] == CHUNKS[0]
        assert error_event(body)["code"] == "upstream_stream_failed" and "more than" in error_event(body)["message"]
        response, _ = post(url, "hostile:huge-error", stream=True)
        assert_openai_error(response, 502, code="upstream_answer_too_large")


# -- finding 3: --upstream-timeout was not a deadline ---------------------------------------------------------
@pytest.mark.slow
def test_finding_3_a_trickling_answer_is_cut_at_the_deadline_with_a_504(hostile):
    """A byte every 0.3 s (about two minutes for the whole answer) against a 2 s deadline: a 504 long before
    the answer would end (the old per-read timeout never fired)."""
    with gateway(ChatUpstream(hostile.url, read_timeout=DEADLINE_S)) as url:
        started = time.monotonic()
        response, _ = post(url, "hostile:trickle")
        elapsed = time.monotonic() - started
    assert_openai_error(response, 504, code="upstream_timeout")
    assert response.headers["x-should-retry"] == "false"
    assert elapsed < WAIT_S / 2  # the deadline, not the trickle, ended it (a generous bound on a shared machine)


@pytest.mark.slow
def test_finding_3_a_request_cut_at_the_deadline_gives_back_the_keys_in_flight_place(hostile):
    """One place in flight per key: held while the trickle runs (a second request is a 429), free again once
    the deadline cuts it (the next request goes through)."""
    async def scenario(url: str) -> tuple[int, int, int]:
        headers = {"authorization": f"Bearer {KEY}"}
        async with httpx.AsyncClient(base_url=f"{url}/v1", timeout=WAIT_S, headers=headers) as http:
            slow = chat_body(PROMPT, model="hostile:trickle")
            trickle = asyncio.create_task(http.post("chat/completions", json=slow))
            await asyncio.sleep(DEADLINE_S / 2)
            during = await http.post("chat/completions", json=chat_body(PROMPT))
            cut = await trickle
            after = await http.post("chat/completions", json=chat_body(PROMPT))
            return during.status_code, cut.status_code, after.status_code

    with gateway(ChatUpstream(hostile.url, read_timeout=DEADLINE_S), max_in_flight_per_caller=1) as url:
        assert asyncio.run(scenario(url)) == (429, 504, 200)


@pytest.mark.slow
def test_finding_3_a_stream_that_never_ends_is_cut_at_the_deadline(hostile):
    """Whole events every 0.1 s for a minute (never idle) against a 2 s deadline: the events so far, then an
    error event, within the deadline's time."""
    with gateway(ChatUpstream(hostile.url, read_timeout=DEADLINE_S)) as url:
        started = time.monotonic()
        response, body = post(url, "hostile:endless-events", stream=True)
        elapsed = time.monotonic() - started
    assert response.status_code == 200 and sse_events(body)[:2] == [CHUNKS[0], CHUNKS[1]]
    assert error_event(body)["code"] == "upstream_stream_failed" and "deadline" in error_event(body)["message"]
    assert elapsed < WAIT_S / 2


def test_finding_3_a_stream_without_a_whole_event_for_the_idle_timeout_is_cut(hostile):
    """Bytes every 0.3 s that never complete an event: cut by the idle timeout (1.5 s), long before the
    deadline (60 s); the trickled part never reaches the caller."""
    with gateway(ChatUpstream(hostile.url, deadline=60.0, idle_timeout=1.5)) as url:
        started = time.monotonic()
        response, body = post(url, "hostile:trickled-event", stream=True)
        elapsed = time.monotonic() - started
    assert response.status_code == 200 and sse_events(body)[0] == CHUNKS[0] and len(sse_events(body)) == 2
    error = error_event(body)
    assert error["code"] == "upstream_stream_failed" and "no event for 1.5 s" in error["message"]
    assert elapsed < WAIT_S / 2


# -- finding 4: a stream cut in the middle of an event --------------------------------------------------------
@pytest.mark.parametrize("model", ["hostile:cut-mid-json", "hostile:cut-mid-field", "hostile:cut-after-line"])
def test_finding_4_a_stream_cut_mid_event_raises_in_the_openai_sdk(hostile, model):
    """The real ``openai`` client reads the events before the cut, then raises the gateway's error; it never
    returns a cut answer as if it were whole."""
    with gateway(ChatUpstream(hostile.url)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=WAIT_S)
        pieces = []
        with pytest.raises(openai.APIError, match=r"middle of an event|mid-stream"):
            for chunk in client.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPT}],
                                                        stream=True):
                pieces.append(chunk.choices[0].delta.content)
    assert pieces == ["", "Paris"]  # the two whole events; the cut one is dropped


@pytest.mark.parametrize("model", ["hostile:cut-mid-json", "hostile:cut-mid-field", "hostile:cut-after-line"])
def test_finding_4_the_partial_event_is_dropped_before_the_error_event(hostile, model):
    """What the caller receives: the two whole events, byte for byte, then the error event on its own, nothing
    of the cut event."""
    with gateway(ChatUpstream(hostile.url)) as url:
        _, body = post(url, model, stream=True)
    error = sse_events(body)[-1]
    assert body == CHUNKS[0] + CHUNKS[1] + error and error.startswith(b'data: {"error": ')
    assert error_event(body)["code"] == "upstream_stream_failed"


# -- the note: retries charged three times for nothing ------------------------------------------------------
def _ledger_rows(path: Path) -> tuple[float, list[float]]:
    """The ledger's total spent (all principals) and its rows' amounts, in order."""
    with sqlite3.connect(path) as db:
        total = db.execute("SELECT COALESCE(SUM(spent), 0) FROM totals").fetchone()[0]
        rows = [amount for (amount,) in db.execute("SELECT amount FROM spends ORDER BY id")]
    return float(total), rows


@pytest.fixture
def ledger_path(tmp_path) -> Path:
    return tmp_path / "ledger.sqlite"


def _ledgered(path: Path) -> PromptPrivacy:
    return fake_privacy(ledger=Ledger(path, budgets={PrivacyUnit.EPSILON: BUDGET}))


@pytest.mark.parametrize("stream", [False, True])
def test_note_retries_an_unreachable_upstream_refunds_the_charge(ledger_path, stream):
    """Nothing listens on the upstream's port: the release was never published, so its charge is given back in
    the same ledger (a row of its own), and the answer says so. Retrying is then harmless: the SDK's retries are
    each charged and refunded, and the budget is whole at the end."""
    with dead_url() as nowhere, gateway(ChatUpstream(nowhere), privacy=_ledgered(ledger_path)) as url:
        response, _ = post(url, "stub-model", stream=stream)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, timeout=WAIT_S)  # the default two retries
        with pytest.raises(openai.APIStatusError) as raised:
            client.chat.completions.create(model="stub-model", messages=[{"role": "user", "content": PROMPT}],
                                           stream=stream)
    error = assert_openai_error(response, 502, code="upstream_unreachable")
    assert "nothing was sent" in error["message"]
    assert float(response.headers["x-privlm-refunded"]) == pytest.approx(COST)
    assert response.headers["x-privlm-epsilon-spent"] == "0"
    assert float(response.headers["x-privlm-budget-remaining"]) == pytest.approx(BUDGET)
    assert "x-should-retry" not in response.headers
    assert raised.value.status_code == 502
    total, rows = _ledger_rows(ledger_path)
    assert total == pytest.approx(0, abs=1e-9)
    assert rows == pytest.approx([COST, -COST] * 4)  # ours, then the SDK's three tries: each charged, each refunded


def test_note_retries_a_refund_is_a_row_of_its_own_and_never_takes_a_total_below_zero(ledger_path):
    from privlm.mechanisms import Spend

    ledger = Ledger(ledger_path, budgets={PrivacyUnit.EPSILON: BUDGET})
    ledger.spend("caller", Spend(PrivacyUnit.EPSILON, 10.0))
    [receipt] = ledger.refund("caller", [Spend(PrivacyUnit.EPSILON, 4.0)], note="refund: test")
    assert receipt.total == 6.0 and ledger.spent("caller", PrivacyUnit.EPSILON) == 6.0
    [receipt] = ledger.refund("caller", [Spend(PrivacyUnit.EPSILON, 100.0)], note="refund: test")
    assert receipt.spend.amount == 6.0 and ledger.spent("caller", PrivacyUnit.EPSILON) == 0.0
    assert _ledger_rows(ledger_path) == (0.0, [10.0, -4.0, -6.0])
    with pytest.raises(ValueError, match="finite"):
        ledger.refund("caller", [Spend(PrivacyUnit.EPSILON, -1.0)], note="refund: test")


@pytest.mark.slow
@pytest.mark.parametrize(("model", "status"), [("hostile:500", 502), ("hostile:429", 429),
                                               ("hostile:trickle", 504), ("hostile:huge-declared", 502)])
def test_note_retries_a_failure_after_sending_is_charged_once_and_not_retried(hostile, ledger_path, model, status):
    """The upstream received the release (and failed, refused, was too slow or answered too much): the charge
    stands, and ``x-should-retry: false`` keeps the ``openai`` SDK (two retries by default) from releasing and
    paying again. The upstream saw exactly one request."""
    hostile.clear()
    with gateway(ChatUpstream(hostile.url, read_timeout=DEADLINE_S), privacy=_ledgered(ledger_path)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, timeout=WAIT_S)
        with pytest.raises(openai.APIStatusError) as raised:
            client.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPT}])
    assert raised.value.status_code == status
    assert raised.value.response.headers["x-should-retry"] == "false"
    assert hostile.received() == 1
    assert _ledger_rows(ledger_path) == (pytest.approx(COST), [pytest.approx(COST)])


class FailingAudit(AuditLog):
    """An audit log that cannot write one kind of record (a full disk, say)."""

    def __init__(self, path: Path, failing: str) -> None:
        super().__init__(path)
        self.failing = failing

    def write(self, event: str, record: Mapping[str, Any]) -> None:
        if event == self.failing:
            raise OSError("no space left on device")
        super().write(event, record)


def test_note_retries_a_gateway_failure_after_sending_is_charged_once_and_not_retried(hostile, ledger_path, tmp_path):
    """Not only the upstream's failures: the gateway's own after the release reached the upstream (here its audit
    log, failing on the upstream's record) is a 5xx in OpenAI's shape with the report and ``x-should-retry:
    false``, so the SDK does not release and pay again."""
    hostile.clear()
    audit = FailingAudit(tmp_path / "audit.sqlite", "upstream")
    with gateway(ChatUpstream(hostile.url, read_timeout=DEADLINE_S), privacy=_ledgered(ledger_path),
                 audit=audit) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, timeout=WAIT_S)
        with pytest.raises(openai.APIStatusError) as raised:
            client.chat.completions.create(model="stub-model", messages=[{"role": "user", "content": PROMPT}])
    assert raised.value.status_code == 500
    assert raised.value.response.headers["x-should-retry"] == "false"
    assert float(raised.value.response.headers["x-privlm-epsilon-spent"]) == pytest.approx(COST)
    assert raised.value.response.json()["error"]["code"] == "failed_after_release"
    assert hostile.received() == 1
    assert _ledger_rows(ledger_path) == (pytest.approx(COST), [pytest.approx(COST)])


@pytest.mark.parametrize("stream", [False, True])
def test_note_retries_a_release_the_audit_log_cannot_record_is_not_sent_and_refunded(hostile, ledger_path,
                                                                                       tmp_path, stream):
    """The release could not be recorded, so it is not sent: nothing crossed, and the charge is given back."""
    hostile.clear()
    audit = FailingAudit(tmp_path / "audit.sqlite", "released")
    with gateway(ChatUpstream(hostile.url), privacy=_ledgered(ledger_path), audit=audit) as url:
        response, _ = post(url, "stub-model", stream=stream)
    assert_openai_error(response, 500, code="failed_after_release")
    assert float(response.headers["x-privlm-refunded"]) == pytest.approx(COST)
    assert "x-should-retry" not in response.headers
    assert hostile.received() == 0
    total, rows = _ledger_rows(ledger_path)
    assert total == pytest.approx(0, abs=1e-9) and rows == pytest.approx([COST, -COST])


def test_note_retries_an_upstream_cannot_forge_the_gateways_report_headers(hostile, ledger_path):
    """``x-privlm-*`` and ``x-should-retry`` are the gateway's words: an upstream's are never passed on."""
    hostile.clear()
    with gateway(ChatUpstream(hostile.url), privacy=_ledgered(ledger_path)) as url:
        response, _ = post(url, "hostile:forged-headers")
    assert response.status_code == 200
    assert float(response.headers["x-privlm-epsilon-spent"]) == pytest.approx(COST)
    assert {"x-privlm-refunded", "x-privlm-fields-dropped", "x-should-retry"}.isdisjoint(response.headers)


def test_note_retries_the_upstream_is_asked_for_an_uncompressed_answer(hostile):
    """The answer cap counts arriving bytes: a compressed answer could expand far past it within one read."""
    hostile.clear()
    with gateway(ChatUpstream(hostile.url)) as url:
        post(url, "stub-model")
    assert hostile.headers[-1]["accept-encoding"] == "identity"


# -- the command's flags ------------------------------------------------------------------------------------
@pytest.mark.parametrize(("flag", "value"), [("--upstream-idle-timeout", "0"), ("--upstream-idle-timeout", "inf"),
                                             ("--max-upstream-answer-bytes", "0")])
def test_finding_3_the_gateway_command_refuses_bad_upstream_limits(flag, value):
    """``privlm gateway``'s new upstream limits, refused as usage errors naming the flag before anything loads."""
    from typer.testing import CliRunner

    from privlm.cli import app

    args = ["gateway", "--chat-upstream", "http://127.0.0.1:9/v1", "--epsilon", "6", "--logit-bound", "b.json",
            flag, value]
    result = CliRunner().invoke(app, args)
    message = " ".join(result.output.replace("│", " ").split())
    assert result.exit_code == 2 and flag in message and "must be" in message, result.output
