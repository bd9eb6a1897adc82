"""A request-body limit enforced while the body is read, whatever ``Content-Length`` says.

The middleware reads the body chunk by chunk before the route runs. A request that carries a body
without an accepted key is refused (401) before any of it is read, so only authorised callers can
make the service hold a body. A declared ``Content-Length`` over the limit is refused before anything
is read; a body that crosses the limit while streaming (chunked, or lying about its length) is refused
as soon as it crosses. Memory therefore stays below the limit plus one chunk per request. The route
then reads the buffered body as usual.

Two more bounds keep slow or many clients from holding the service:

  - ``body_timeout`` (30 s by default): the whole body must arrive within that many seconds of the
    middleware starting to read it; a body that trickles in slower is answered 408
    (``request_timeout``) and the connection closes;
  - ``max_in_flight`` (32 by default): at most that many requests with a body are read or processed at
    once; one more is answered 503 (``server_busy``, ``retry-after: 1``, which privlm's
    :class:`~privlm.service.RetryPolicy` and OpenAI's SDKs retry) before any of its body is read. Memory
    for bodies is thus bounded by about ``max_in_flight * max_request_bytes``. A request leaves the count
    however it ends: answered, refused, failed, cancelled, or abandoned by its client;
  - ``max_in_flight_per_caller`` (a quarter of ``max_in_flight`` by default): on a service with keys, one
    API key may hold at most that many of those places, so that no caller fills them all; one more is
    answered 429 (``rate_limit_exceeded``, ``retry-after: 1``). A service without keys cannot tell its
    callers apart (on localhost they share one address), so there only ``max_in_flight`` applies;
  - ``lanes`` (path -> :class:`Lane`): a route whose requests have places of their own. Its requests count only
    against its lane's ``max_in_flight`` (all its callers together), neither against ``max_in_flight`` nor against
    a caller's quarter of it, and one more is refused as busy (503, naming the lane's setting). The LiteLLM
    guardrail has one: LiteLLM is one caller that sends a whole burst, whose requests must queue for the device
    model rather than be refused, and whose burst must not take the places of the other routes' callers.

A client that goes away mid-upload is one ``info`` line on the ``privlm.service`` logger, never a
traceback.

A route whose callers must never see an error status (a LiteLLM guardrail: a proxy set to fail open forwards the
original text on one) registers a :data:`RefusalAnswer` for its path in ``refusal_answers``: the 408, 413, 429 and
503 refusals above are then answered by it instead. A missing or wrong key is answered 401 on every path.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from privlm.service.auth import API_KEY_HEADER, BearerKeys, bearer_key, request_key
from privlm.service.errors import error_response
from privlm.settings.service import MAX_IN_FLIGHT
from privlm.validation import check_positive_int

BODY_TIMEOUT = 30.0  # seconds for a whole request body

log = logging.getLogger("privlm.service")

RefusalAnswer = Callable[[JSONResponse], Response]
"""A path's own answer to one of the middleware's refusals (given as the OpenAI-shaped error it would be)."""


@dataclass(frozen=True)
class Lane:
    """A route's own in-flight places: at most ``max_in_flight`` of its requests read or processed at once, set by
    the option ``param`` (named in the refusal)."""

    max_in_flight: int
    param: str

    def __post_init__(self) -> None:
        check_positive_int(self.param, self.max_in_flight)


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, *, max_bytes: int, auth: BearerKeys, body_timeout: float = BODY_TIMEOUT,
                 max_in_flight: int = MAX_IN_FLIGHT, max_in_flight_per_caller: int | None = None,
                 refusal_answers: Mapping[str, RefusalAnswer] | None = None,
                 lanes: Mapping[str, Lane] | None = None) -> None:
        if not body_timeout > 0:
            raise ValueError(f"body_timeout must be > 0 seconds, got {body_timeout}")
        if isinstance(max_in_flight, bool) or not isinstance(max_in_flight, int) or max_in_flight < 1:
            raise ValueError(f"max_in_flight must be an integer >= 1, got {max_in_flight!r}")
        self.app, self.max_bytes, self.auth = app, max_bytes, auth
        self.body_timeout, self.max_in_flight = float(body_timeout), max_in_flight
        if max_in_flight_per_caller is None:
            max_in_flight_per_caller = max(1, max_in_flight // 4)
        if isinstance(max_in_flight_per_caller, bool) or not isinstance(max_in_flight_per_caller, int) \
                or max_in_flight_per_caller < 1:
            raise ValueError(f"max_in_flight_per_caller must be an integer >= 1, got {max_in_flight_per_caller!r}")
        self.max_in_flight_per_caller = max_in_flight_per_caller
        self.in_flight = 0  # requests with a body being read or processed now (one event loop: no lock)
        self.in_flight_by_caller: Counter[str] = Counter()
        self.refusal_answers = dict(refusal_answers or {})
        self.lanes = dict(lanes or {})
        self.in_flight_by_lane: Counter[str] = Counter()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        declared = headers.get(b"content-length", b"")
        has_body = (declared.isdigit() and int(declared) > 0) or b"transfer-encoding" in headers
        authorization = [value.decode("latin-1") for name, value in scope["headers"] if name == b"authorization"]
        api_key = [value.decode("latin-1") for name, value in scope["headers"] if name == API_KEY_HEADER.encode()]
        # Two headers of a kind are refused on every route: this check would read one, the routes another.
        ambiguous = (len(authorization) > 1 or len(api_key) > 1) and not self.auth.open
        key = request_key(bearer_key(authorization[0] if authorization else None), api_key[0] if api_key else None)
        if ambiguous or (has_body and not self.auth.open and (key is None or not self.auth.accepts(key))):
            refusal = self.auth.refusal().response()
            refusal.headers["connection"] = "close"  # the unread body is not drained: the connection ends
            await refusal(scope, receive, send)
            return
        if declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(scope, receive, send, f"request of {int(declared)} bytes")
            return
        if not has_body:
            await self._read_and_run(scope, receive, send)
            return
        path = _route_path(scope)
        if path in self.lanes:
            await self._in_lane(path, scope, receive, send)
            return
        if self.in_flight >= self.max_in_flight:
            await self._busy(scope, receive, send)
            return
        caller = self.auth.principal(key) if key is not None and not self.auth.open else None  # accepted above
        if caller is not None and self.in_flight_by_caller[caller] >= self.max_in_flight_per_caller:
            await self._too_many(scope, receive, send)
            return
        self.in_flight += 1
        if caller is not None:
            self.in_flight_by_caller[caller] += 1
        try:
            await self._read_and_run(scope, receive, send)
        finally:
            self.in_flight -= 1
            if caller is not None:
                self.in_flight_by_caller[caller] -= 1
                if not self.in_flight_by_caller[caller]:
                    del self.in_flight_by_caller[caller]

    async def _in_lane(self, path: str, scope: Scope, receive: Receive, send: Send) -> None:
        lane = self.lanes[path]
        if self.in_flight_by_lane[path] >= lane.max_in_flight:
            response = error_response(503, f"the service is reading or processing {lane.param}={lane.max_in_flight} "
                                           "requests on this route; retry shortly", type="server_error",
                                      param=lane.param, code="server_busy",
                                      headers={"retry-after": "1", "connection": "close"})
            await self._send_refusal(response, scope, receive, send)
            return
        self.in_flight_by_lane[path] += 1
        try:
            await self._read_and_run(scope, receive, send)
        finally:
            self.in_flight_by_lane[path] -= 1

    async def _read_and_run(self, scope: Scope, receive: Receive, send: Send) -> None:
        chunks, size = [], 0
        deadline = asyncio.get_running_loop().time() + self.body_timeout
        while True:
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                await self._too_slow(scope, receive, send, size)
                return
            if message["type"] != "http.request":
                log.info("client went away after sending %d bytes of its request body", size)
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._refuse(scope, receive, send, f"request body of more than {size} bytes")
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        try:
            await self.app(scope, replay, send)
        except ClientDisconnect:  # the client left while the route was still reading or answering
            log.info("client went away before its answer")

    async def _too_slow(self, scope: Scope, receive: Receive, send: Send, size: int) -> None:
        log.info("request body incomplete after %g s (%d bytes): answered 408", self.body_timeout, size)
        response = error_response(408, f"the request body did not arrive within body_timeout={self.body_timeout:g} s "
                                       f"({size} bytes received)", param="body_timeout", code="request_timeout",
                                  headers={"connection": "close"})  # the rest is not drained
        await self._send_refusal(response, scope, receive, send)

    async def _busy(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = error_response(503, f"the service is reading or processing max_in_flight={self.max_in_flight} "
                                       "requests; retry shortly", type="server_error", param="max_in_flight",
                                  code="server_busy", headers={"retry-after": "1", "connection": "close"})
        await self._send_refusal(response, scope, receive, send)

    async def _too_many(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = error_response(429, "this caller has max_in_flight_per_caller="
                                       f"{self.max_in_flight_per_caller} requests in flight; retry after an answer",
                                  type="rate_limit_error", param="max_in_flight_per_caller",
                                  code="rate_limit_exceeded", headers={"retry-after": "1", "connection": "close"})
        await self._send_refusal(response, scope, receive, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, what: str) -> None:
        response = error_response(413, f"{what} exceeds max_request_bytes={self.max_bytes}", param="max_request_bytes",
                                  code="limit_exceeded", headers={"connection": "close"})  # the rest is not drained
        await self._send_refusal(response, scope, receive, send)

    async def _send_refusal(self, response: JSONResponse, scope: Scope, receive: Receive, send: Send) -> None:
        await answered(response, scope, self.refusal_answers)(scope, receive, send)


def _route_path(scope: Scope) -> str:
    """The request's path as the app routes it: without the server's ``root_path`` or a trailing ``/``."""
    path, root = str(scope.get("path", "")), str(scope.get("root_path", ""))
    if root and path.startswith(root):
        path = path[len(root):]
    return path.rstrip("/") or "/"


def answered(refusal: JSONResponse, scope: Scope, answers: Mapping[str, RefusalAnswer]) -> Response:
    """``refusal``, or the request path's own answer to it (``answers``), which keeps its connection header. The
    body-limit middleware and the connection cap (:mod:`privlm.service.serving`) both answer through this."""
    answer = answers.get(_route_path(scope))
    if answer is None:
        return refusal
    replaced = answer(refusal)
    if "connection" in refusal.headers:
        replaced.headers["connection"] = refusal.headers["connection"]
    return replaced
