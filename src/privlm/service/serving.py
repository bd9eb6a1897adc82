"""Running a service on uvicorn with the transport limits uvicorn leaves out: :func:`run_service`.

uvicorn has no timeout for request headers: a client that sends them a byte at a time holds its
connection (and slows down a graceful shutdown) for as long as it likes, on a fresh connection or on a
kept-alive one, where the keep-alive timer stops at the first byte. :func:`run_service` serves with
:class:`GuardedH11Protocol`, uvicorn's h11 protocol with three limits:

  - ``header_timeout``: a connection whose request headers are not all in within that many seconds of
    the connection opening, or of the previous answer on a kept-alive connection, is closed;
  - ``keep_alive_timeout``: an idle kept-alive connection is closed after that many seconds (uvicorn's own);
  - ``max_connections``: over that many open connections, requests on the extra ones are answered 503
    (``server_busy``, ``retry-after: 1``, in OpenAI's error shape) and the connection closes.

Bodies are the app's business: :mod:`privlm.service.limits` bounds their size, the time they take to
arrive and the number read or processed at once. Logs are at ``warning`` by default.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import h11
import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from privlm.service.errors import error_response
from privlm.service.limits import RefusalAnswer, answered

HEADER_TIMEOUT = 10.0  # seconds for a request's headers
KEEP_ALIVE_TIMEOUT = 5  # seconds an idle kept-alive connection stays open
MAX_CONNECTIONS = 512  # open connections; a process usually may open 1024 files
SHUTDOWN_TIMEOUT = 25  # seconds a graceful stop waits for requests in flight (systemd waits 30)

log = logging.getLogger("privlm.service")


def _overloaded(answers: Mapping[str, RefusalAnswer]) -> ASGIApp:
    """The app of a connection over the cap: a 503, or its path's own answer to it (``refusal_answers``)."""
    async def overloaded(scope: Scope, receive: Receive, send: Send) -> None:
        response = error_response(503, "the service has too many open connections; retry shortly",
                                  type="server_error", param="max_connections", code="server_busy",
                                  headers={"retry-after": "1", "connection": "close"})
        await answered(response, scope, answers)(scope, receive, send)
    return overloaded


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline for request headers and a cap on open connections.

    The limits are class attributes: :func:`guarded_protocol` makes a subclass with the ones wanted,
    since uvicorn builds one protocol per connection from the class it is given.
    """

    header_timeout: float = HEADER_TIMEOUT
    max_connections: int | None = MAX_CONNECTIONS
    refusal_answers: Mapping[str, RefusalAnswer] = MappingProxyType({})

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if self.max_connections is not None and len(self.connections) > self.max_connections:
            self.app = _overloaded(self.refusal_answers)  # every request on it gets a 503, then it closes
        self._watch_headers()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_deadline()
        super().connection_lost(exc)

    def handle_events(self) -> None:
        super().handle_events()
        self._watch_headers()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch_headers()

    def _waiting_for_headers(self) -> bool:
        """Between requests, or still receiving a request the app already answered without reading it."""
        their, ours = self.conn.their_state, self.conn.our_state
        return their is h11.IDLE or (ours is h11.DONE and their is h11.SEND_BODY)

    def _watch_headers(self) -> None:
        if self.transport is None or self.transport.is_closing() or not self._waiting_for_headers():
            self._stop_deadline()
        elif self._header_deadline is None:
            self._header_deadline = self.loop.call_later(self.header_timeout, self._headers_timed_out)

    def _stop_deadline(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _headers_timed_out(self) -> None:
        self._header_deadline = None
        if not self.transport.is_closing():
            log.info("closed a connection whose request headers took more than %g s", self.header_timeout)
            self.transport.close()


def guarded_protocol(*, header_timeout: float = HEADER_TIMEOUT, max_connections: int | None = MAX_CONNECTIONS,
                     refusal_answers: Mapping[str, RefusalAnswer] | None = None) -> type[GuardedH11Protocol]:
    """A :class:`GuardedH11Protocol` with these limits, for uvicorn's ``http=``; ``refusal_answers``: the app's
    own answers to the connection cap's 503, by path (what ``create_service_app`` keeps in ``app.state``)."""
    if not header_timeout > 0:
        raise ValueError(f"header_timeout must be > 0 seconds, got {header_timeout}")
    if max_connections is not None and max_connections < 1:
        raise ValueError(f"max_connections must be >= 1 (or None), got {max_connections}")
    return type("GuardedH11Protocol", (GuardedH11Protocol,),
                {"header_timeout": float(header_timeout), "max_connections": max_connections,
                 "refusal_answers": MappingProxyType(dict(refusal_answers or {}))})


def service_config(app: ASGIApp, *, host: str, port: int, header_timeout: float = HEADER_TIMEOUT,
                   keep_alive_timeout: int = KEEP_ALIVE_TIMEOUT, max_connections: int | None = MAX_CONNECTIONS,
                   shutdown_timeout: int | None = SHUTDOWN_TIMEOUT, log_level: str = "warning") -> uvicorn.Config:
    """The uvicorn configuration :func:`run_service` runs (tests run it on a thread)."""
    answers = getattr(getattr(app, "state", None), "refusal_answers", None)
    return uvicorn.Config(app, host=host, port=port, http=guarded_protocol(header_timeout=header_timeout,
                                                                         max_connections=max_connections,
                                                                         refusal_answers=answers),
                          timeout_keep_alive=keep_alive_timeout, timeout_graceful_shutdown=shutdown_timeout,
                          log_level=log_level, server_header=False)


def run_service(app: ASGIApp, *, host: str, port: int, header_timeout: float = HEADER_TIMEOUT,
                keep_alive_timeout: int = KEEP_ALIVE_TIMEOUT, max_connections: int | None = MAX_CONNECTIONS,
                shutdown_timeout: int | None = SHUTDOWN_TIMEOUT, log_level: str = "warning") -> None:
    """Serve ``app`` on ``host:port`` until SIGINT/SIGTERM, with the limits above (the module's docstring)."""
    uvicorn.Server(service_config(app, host=host, port=port, header_timeout=header_timeout,
                                  keep_alive_timeout=keep_alive_timeout, max_connections=max_connections,
                                  shutdown_timeout=shutdown_timeout, log_level=log_level)).run()
