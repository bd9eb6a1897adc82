"""Issue 10, the transport of every privlm service (findings 7 and 10), each attack reproduced against a
real uvicorn server on 127.0.0.1: slow headers and bodies, too many connections, aborted uploads, DNS
rebinding through the Host header, the docs pages, and the cap on requests in flight."""

import asyncio
import json
import logging
import re
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from typing import ClassVar

import httpx
import pytest
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from typer.testing import CliRunner

from privlm.cli import app as cli
from privlm.service import BearerKeys, RetryPolicy, ServiceError, create_service_app
from privlm.service.auth import KEY_ENV_VARS
from privlm.service.limits import BodyLimitMiddleware
from tests.models.tiny import tiny_bert_folder
from tests.service.localhost import serving, serving_guarded

LIMIT = 1 << 20


class Gate:
    """Holds ``/hold`` requests (after their body is read) until ``opened`` is set."""

    def __init__(self) -> None:
        self.opened = threading.Event()
        self.entered = 0


def _app(*, keys=(), gate: Gate | None = None, **options):
    router = APIRouter()

    @router.post("/echo")
    async def echo(request: Request) -> dict[str, int]:
        return {"bytes": len(await request.body())}

    @router.post("/hold")
    async def hold(request: Request) -> dict[str, int]:
        body = await request.body()
        assert gate is not None
        gate.entered += 1
        await asyncio.to_thread(gate.opened.wait, 30)
        return {"bytes": len(body)}

    @router.post("/refuse")
    async def refuse(request: Request) -> None:
        await request.body()
        raise ServiceError(400, "refused on purpose", code="refused")

    return create_service_app(title="toy", routers=[router], auth=BearerKeys(keys), max_request_bytes=LIMIT,
                              **options)


def _error(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def _wait_for(condition: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.02)


def _read_until_closed(sock: socket.socket, timeout: float = 15.0) -> bytes:
    sock.settimeout(timeout)
    data = b""
    with suppress(ConnectionResetError):
        while chunk := sock.recv(65536):
            data += chunk
    return data


class Slow:
    """One connection that sends its request a byte per tick and never finishes it."""

    PREFIX: ClassVar[dict[str, bytes]] = {
        "headers": b"GET /health HTTP/1.1\r\nhost: localhost\r\nx-slow: ",
        "keep-alive": b"GET /health HTTP/1.1\r\nhost: localhost\r\nx-slow: ",
        "body": b"POST /echo HTTP/1.1\r\nhost: localhost\r\ncontent-length: 100000\r\n\r\n"}

    def __init__(self, port: int, kind: str) -> None:
        self.kind, self.closed_after = kind, None
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        if kind == "keep-alive":  # a first request is answered; the second one trickles on the same connection
            self.sock.sendall(b"GET /health HTTP/1.1\r\nhost: localhost\r\n\r\n")
            answer = b""
            while not answer.endswith(b"}"):
                answer += self.sock.recv(4096)
            assert answer.startswith(b"HTTP/1.1 200")
        self.sock.sendall(self.PREFIX[kind])
        self.started = time.monotonic()
        self.sock.setblocking(False)

    def poll(self) -> None:
        """Note whether the server closed the connection."""
        try:
            if self.sock.recv(65536) == b"":
                self.closed_after = time.monotonic() - self.started
        except BlockingIOError:
            pass
        except OSError:
            self.closed_after = time.monotonic() - self.started

    def trickle(self) -> None:
        try:
            self.sock.send(b"x" if self.kind == "body" else b"a")
        except BlockingIOError:
            pass
        except OSError:
            self.closed_after = time.monotonic() - self.started


@pytest.mark.slow
def test_finding_10_slow_headers_and_bodies_are_cut_off_while_others_are_served():
    """20 slow connections (8 trickle their headers, 4 the headers of a second request on a kept-alive
    connection, 8 their body) against header_timeout=1 s and body_timeout=2 s: every one is closed by the
    server within its timeout plus 5 s, none early, and normal requests are answered meanwhile. Before
    the fix none of them was ever closed (uvicorn has no header timeout; bodies could trickle forever)."""
    header_timeout, body_timeout, slack = 1.0, 2.0, 5.0
    with serving_guarded(_app(body_timeout=body_timeout), header_timeout=header_timeout) as url:
        slow = [Slow(_port(url), kind) for kind in ["headers"] * 8 + ["keep-alive"] * 4 + ["body"] * 8]
        served: list[float] = []

        def normal_requests() -> None:
            for _ in range(3):
                started = time.monotonic()
                assert httpx.get(f"{url}/health", timeout=10).status_code == 200
                assert httpx.post(f"{url}/echo", content=b"abc", timeout=10).json() == {"bytes": 3}
                served.append(time.monotonic() - started)
                time.sleep(0.2)

        normal = threading.Thread(target=normal_requests)
        normal.start()
        deadline, next_byte = time.monotonic() + body_timeout + slack + 1, 0.0
        while time.monotonic() < deadline and any(c.closed_after is None for c in slow):
            for connection in slow:
                if connection.closed_after is None:
                    connection.poll()
                if connection.closed_after is None and time.monotonic() >= next_byte:
                    connection.trickle()
            if time.monotonic() >= next_byte:
                next_byte = time.monotonic() + 0.1
            time.sleep(0.01)
        normal.join(timeout=30)
        for connection in slow:
            connection.sock.close()
    assert len(served) == 3 and max(served) < 5.0  # answered while the slow ones hung on
    for connection in slow:
        timeout = body_timeout if connection.kind == "body" else header_timeout
        assert connection.closed_after is not None, f"a slow {connection.kind} connection is still open"
        # not before half its timeout (the deadline closed it, nothing else), and within it plus the slack
        assert timeout / 2 <= connection.closed_after <= timeout + slack, (connection.kind, connection.closed_after)


def test_finding_10_a_body_that_trickles_gets_a_408_in_openai_shape():
    """A body that stops arriving is answered 408 (request_timeout, connection: close) at body_timeout."""
    with serving_guarded(_app(body_timeout=1.0)) as url, \
            socket.create_connection(("127.0.0.1", _port(url)), timeout=10) as sock:
        sock.sendall(b"POST /echo HTTP/1.1\r\nhost: localhost\r\ncontent-length: 1000\r\n\r\n" + b"x" * 10)
        started = time.monotonic()
        answer = _read_until_closed(sock)
        elapsed = time.monotonic() - started
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408") and b"connection: close" in head.lower()
    error = json.loads(body)["error"]
    assert (error["code"], error["param"]) == ("request_timeout", "body_timeout")
    assert "10 bytes received" in error["message"]
    assert 0.8 <= elapsed <= 6.0


def test_finding_10_connections_over_the_cap_get_a_json_503():
    """With max_connections=3 and three idle connections open, a fourth is answered 503 (server_busy,
    retry-after) in OpenAI's shape; once they close, requests are served again."""
    with serving_guarded(_app(), max_connections=3, header_timeout=30) as url:
        idle = [socket.create_connection(("127.0.0.1", _port(url)), timeout=10) for _ in range(3)]
        try:
            def busy() -> bool:
                return httpx.get(f"{url}/health", timeout=10).status_code == 503

            _wait_for(busy)
            refused = httpx.get(f"{url}/health", timeout=10)
            assert refused.headers["retry-after"] == "1"
            assert (_error(refused)["code"], _error(refused)["param"]) == ("server_busy", "max_connections")
        finally:
            for sock in idle:
                sock.close()
        _wait_for(lambda: httpx.get(f"{url}/health", timeout=10).status_code == 200)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextmanager
def _captured_logs() -> Iterator[list[logging.LogRecord]]:
    """Every record of uvicorn's loggers (which do not propagate), asyncio's and privlm's, at any level
    privlm.service logs (info included). Entered after the server started: uvicorn's config resets its loggers."""
    handler = _Records()
    loggers = [logging.getLogger(), logging.getLogger("uvicorn")]
    service, level = logging.getLogger("privlm.service"), logging.getLogger("privlm.service").level
    for logger in loggers:
        logger.addHandler(handler)
    service.setLevel(logging.INFO)
    try:
        yield handler.records
    finally:
        for logger in loggers:
            logger.removeHandler(handler)
        service.setLevel(level)


def _abort_upload(port: int, way: str) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        if way in ("reset", "after-100-continue"):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close with a RST
        head = b"POST /echo HTTP/1.1\r\nhost: localhost\r\n"
        if way == "chunked":
            sock.sendall(head + b"transfer-encoding: chunked\r\n\r\n1000\r\n" + b"x" * 100)
        elif way == "after-100-continue":
            sock.sendall(head + b"expect: 100-continue\r\ncontent-length: 100000\r\n\r\n")
            assert sock.recv(100).startswith(b"HTTP/1.1 100")
            sock.sendall(b"x" * 5000)
        else:  # "close" or "reset"
            sock.sendall(head + b"content-length: 100000\r\n\r\n" + b"x" * 5000)
        time.sleep(0.01)


def _count(metrics: str, status: str, endpoint: str = '[^"]*') -> float:
    pattern = rf'privlm_requests_total{{endpoint="{endpoint}",status="{status}"}} (\S+)'
    return sum(float(value) for value in re.findall(pattern, metrics))


@pytest.mark.parametrize("server", ["run_service", "uvicorn defaults"])
def test_finding_10_aborted_uploads_log_no_traceback(server):
    """40 uploads aborted mid-body (closed, reset, chunked, after 100-continue) and 5 abandoned while the
    route runs: no traceback and no warning in any log, at most one short info line each, and the
    aborts are counted as 499 (client closed), never as a 500. On ``privlm serve``'s server and on
    uvicorn's defaults (httptools)."""
    gate = Gate()
    run = serving_guarded if server == "run_service" else serving
    ways = ["close", "reset", "chunked", "after-100-continue"] * 10
    with run(_app(gate=gate)) as url, _captured_logs() as records:
        port = _port(url)
        for way in ways:
            _abort_upload(port, way)
        for held in range(1, 6):  # the whole body, then the client leaves while the route still holds it
            with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                sock.sendall(b"POST /hold HTTP/1.1\r\nhost: localhost\r\ncontent-length: 3\r\n\r\nabc")
                _wait_for(lambda held=held: gate.entered == held)
        gate.opened.set()
        _wait_for(lambda: _count(httpx.get(f"{url}/metrics").text, "499") >= len(ways)
                  and _count(httpx.get(f"{url}/metrics").text, "200", "/hold") == 5)
        metrics = httpx.get(f"{url}/metrics").text
    assert _count(metrics, "499") == len(ways) and _count(metrics, "500") == 0
    tracebacks = [r for r in records if r.exc_info or "Traceback" in r.getMessage()]
    assert not tracebacks, [r.getMessage() for r in tracebacks]
    assert not [r for r in records if r.levelno >= logging.WARNING], [r.getMessage() for r in records]
    lines = [r.getMessage() for r in records if r.name == "privlm.service"]
    assert len(lines) <= len(ways) + 5 and all("\n" not in line and len(line) < 120 for line in lines)


def test_finding_10_an_open_service_answers_loopback_hosts_only():
    """DNS rebinding: a page on evil.example that resolves its name to 127.0.0.1 reaches a keyless
    service with ``Host: evil.example``. It is refused (400 invalid_host) on every route, before any body is
    read; loopback names, with or without a port, are answered."""
    with serving_guarded(_app()) as url:
        port = _port(url)
        for host in ("localhost", f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "LOCALHOST.",
                     "api.localhost", "127.0.0.2"):
            assert httpx.get(f"{url}/health", headers={"host": host}).status_code == 200, host
        for host in ("evil.example", f"evil.example:{port}", "localhost.evil.example", "127.0.0.1.nip.io",
                     "0.0.0.0", "192.168.1.10", "[::ffff:7f00:1]"):
            for refused in (httpx.get(f"{url}/health", headers={"host": host}),
                            httpx.get(f"{url}/openapi.json", headers={"host": host}),
                            httpx.post(f"{url}/echo", content=b"abc", headers={"host": host})):
                assert refused.status_code == 400, host
                assert (_error(refused)["code"], _error(refused)["param"]) == ("invalid_host", "host")
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:  # a large body is never read
            sock.sendall(b"POST /echo HTTP/1.1\r\nhost: evil.example\r\ncontent-length: 1000000\r\n\r\n" + b"x" * 100)
            assert sock.recv(4096).startswith(b"HTTP/1.1 400")


def test_finding_10_services_with_keys_or_allowed_hosts_answer_other_hosts():
    with serving(_app(keys=["k"])) as url:  # a keyed service: the key protects it, any Host is fine
        answered = httpx.post(f"{url}/echo", content=b"abc", headers={"host": "embeddings.example",
                                                                      "authorization": "Bearer k"})
        assert answered.json() == {"bytes": 3}
    with serving(_app(allowed_hosts=["gw.internal"])) as url:
        assert httpx.get(f"{url}/health", headers={"host": "gw.internal:8001"}).status_code == 200
        assert httpx.get(f"{url}/health", headers={"host": "localhost"}).status_code == 200
        assert httpx.get(f"{url}/health", headers={"host": "evil.example"}).status_code == 400
    with serving(_app(keys=["k"], allowed_hosts=["gw.internal"])) as url:
        assert httpx.get(f"{url}/health", headers={"host": "evil.example"}).status_code == 400


def test_finding_10_the_cli_refuses_a_keyless_service_beyond_loopback(monkeypatch):
    from privlm.settings.service import ServiceSettings

    for name in KEY_ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    runner = CliRunner()
    for args in (["serve", "--host", "0.0.0.0", "--model", "not-loaded"], ["serve", "--host", "::", "--ray"],
                 ["gateway", "--server", "http://127.0.0.1:9", "--eta", "50", "--host", "0.0.0.0"]):
        result = runner.invoke(cli, args)
        assert result.exit_code == 2, (args, result.output)
        said = " ".join(re.sub("[\u2500-\u257f]", " ", result.output).split())  # without rich's box
        assert "no API key is set" in said and "--allow-keyless" in said
    beyond, loopback = ServiceSettings(host="0.0.0.0"), ServiceSettings(host="localhost")
    assert beyond.exposed(("k",)).options() == loopback.exposed(()).options() == {"docs": False, "max_in_flight": 32}
    opened = ServiceSettings(host="0.0.0.0", allow_keyless=True).exposed(()).options()
    assert opened["allowed_hosts"] == ["*"]  # open on purpose: remote callers' Host names are answered


def test_finding_10_serve_runs_on_the_guarded_server_with_its_options(monkeypatch, tmp_path):
    """``privlm serve`` hands its app to ``run_service`` (not to ``uvicorn.run``) with --docs and --max-in-flight."""
    calls = []
    monkeypatch.setattr("privlm.service.run_service", lambda app, **where: calls.append((app, where)))
    for name in KEY_ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    result = CliRunner().invoke(cli, ["serve", "--model", str(tiny_bert_folder(tmp_path)), "--device", "cpu",
                                      "--port", "8123", "--docs", "--max-in-flight", "3"])
    assert result.exit_code == 0, result.output
    (app, where), = calls
    assert where == {"host": "127.0.0.1", "port": 8123} and app.docs_url == "/docs"
    limits, = [m for m in app.user_middleware if m.cls is BodyLimitMiddleware]
    assert limits.kwargs["max_in_flight"] == 3


def test_finding_10_docs_are_opt_in():
    """/docs and /redoc (Swagger UI and ReDoc, loaded from a CDN) are off unless docs=True; /openapi.json stays."""
    with serving(_app()) as url:
        for path in ("/docs", "/redoc"):
            missing = httpx.get(url + path)
            assert missing.status_code == 404 and _error(missing)["type"] == "not_found_error"
        assert httpx.get(f"{url}/openapi.json").json()["info"]["title"] == "toy"
    with serving(_app(docs=True)) as url:
        for path in ("/docs", "/redoc"):
            shown = httpx.get(url + path)
            assert shown.status_code == 200 and "text/html" in shown.headers["content-type"]


def test_finding_7_requests_in_flight_are_capped():
    """max_in_flight=2 and two requests held open: a third with a body is answered 503 (server_busy,
    retry-after: 1) before its body is read; requests without a body still pass; once the two finish,
    requests are accepted again, and privlm's RetryPolicy rides out the 503."""
    gate = Gate()
    with serving_guarded(_app(gate=gate, max_in_flight=2)) as url, ThreadPoolExecutor(3) as pool:
        held = [pool.submit(httpx.post, f"{url}/hold", content=b"x" * 1000, timeout=30) for _ in range(2)]
        _wait_for(lambda: gate.entered == 2)
        busy = httpx.post(f"{url}/echo", content=b"abc", timeout=10)
        assert busy.status_code == 503 and busy.headers["retry-after"] == "1"
        assert (_error(busy)["code"], _error(busy)["param"], _error(busy)["type"]) == (
            "server_busy", "max_in_flight", "server_error")
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
        policy = RetryPolicy(retries=20, backoff=0.05, max_backoff=0.3)
        with httpx.Client(base_url=url, timeout=10) as http:
            retried = pool.submit(policy.call, lambda: http.post("/echo", content=b"abcd"))
            _wait_for(lambda: policy.failed_attempts >= 1)
            gate.opened.set()
            assert [future.result().json() for future in held] == [{"bytes": 1000}] * 2
            assert retried.result().json() == {"bytes": 4}
        assert httpx.post(f"{url}/echo", content=b"abc", timeout=10).json() == {"bytes": 3}


def test_a_path_can_answer_the_limits_refusals_itself_and_the_others_keep_theirs():
    """refusal_answers: busy, /echo gets its own answer (built from the refusal, with its connection header) and
    /refuse still the 503; an over-limit body on /echo too."""
    def own(refusal: JSONResponse) -> Response:
        return JSONResponse({"own": json.loads(bytes(refusal.body))["error"]["code"]})

    gate = Gate()
    app = _app(gate=gate, max_in_flight=1, refusal_answers={"/echo": own})
    with serving_guarded(app) as url, ThreadPoolExecutor(1) as pool:
        held = pool.submit(httpx.post, f"{url}/hold", content=b"x", timeout=30)
        _wait_for(lambda: gate.entered == 1)
        answered = httpx.post(f"{url}/echo", content=b"abc", timeout=10)
        assert answered.status_code == 200 and answered.json() == {"own": "server_busy"}
        assert answered.headers["connection"] == "close"
        assert httpx.post(f"{url}/refuse", content=b"abc", timeout=10).status_code == 503
        gate.opened.set()
        assert held.result().json() == {"bytes": 1}
        too_large = httpx.post(f"{url}/echo", content=b"x" * (LIMIT + 1), timeout=10)
        assert too_large.status_code == 200 and too_large.json() == {"own": "limit_exceeded"}


def test_finding_7_the_in_flight_count_is_released_on_every_path():
    """With max_in_flight=1, a request that fails, is refused over the limit, times out, or is abandoned
    mid-body leaves the count: the next request is served (a leak would make it a 503)."""
    with serving_guarded(_app(max_in_flight=1, body_timeout=1.0)) as url:
        port = _port(url)

        def served() -> bool:
            return httpx.post(f"{url}/echo", content=b"abc", timeout=10).status_code == 200

        assert httpx.post(f"{url}/refuse", content=b"abc").status_code == 400
        assert served()
        over = httpx.post(f"{url}/echo", content=iter([b"x" * (LIMIT // 2)] * 4), timeout=30)
        assert over.status_code == 413
        assert served()
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:  # times out: 408
            sock.sendall(b"POST /echo HTTP/1.1\r\nhost: localhost\r\ncontent-length: 100\r\n\r\nabc")
            assert _read_until_closed(sock).startswith(b"HTTP/1.1 408")
        assert served()
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:  # abandoned mid-body
            sock.sendall(b"POST /echo HTTP/1.1\r\nhost: localhost\r\ncontent-length: 100\r\n\r\nabc")
        _wait_for(served)


def test_finding_7_a_cancelled_request_leaves_the_in_flight_count():
    """Cancellation (a server shutting down, say) also releases the request's place."""
    async def forever(scope, receive, send) -> None:
        await asyncio.sleep(3600)

    async def main() -> None:
        middleware = BodyLimitMiddleware(forever, max_bytes=100, auth=BearerKeys(), max_in_flight=1)

        async def receive():
            return {"type": "http.request", "body": b"abc", "more_body": False}

        async def send(message) -> None:
            pass

        scope = {"type": "http", "method": "POST", "path": "/", "headers": [(b"content-length", b"3")]}
        task = asyncio.create_task(middleware(scope, receive, send))
        while middleware.in_flight == 0:
            await asyncio.sleep(0.001)
        task.cancel()
        with suppress(asyncio.CancelledError):
            await task
        assert middleware.in_flight == 0

    asyncio.run(main())


@pytest.mark.parametrize(("option", "value"), [("max_in_flight", 0), ("max_in_flight", 1.5), ("body_timeout", 0),
                                               ("body_timeout", float("inf"))])
def test_bad_limits_are_refused_when_the_app_is_made(option, value):
    with pytest.raises(ValueError, match=option):
        _app(**{option: value})


def test_finding_10_ray_replicas_take_the_same_options():
    ray = pytest.importorskip("privlm.snd.service.ray")
    deployment = ray.app_builder({"model": "minilm", "allowed_hosts": "embeddings.internal, *",
                                  "max_in_flight": "8"})._bound_deployment
    [settings] = deployment.init_args
    assert settings.options() == {"docs": False, "allowed_hosts": ["embeddings.internal", "*"], "max_in_flight": 8}
