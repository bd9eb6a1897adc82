"""Forwarding to an OpenAI-compatible upstream (the chat API a gateway protects the prompts for).

One ``httpx.AsyncClient`` per gateway. What the upstream answers comes back as it is: its status, its body,
its content type; a stream passes through event by event. What fails on the way is the gateway's error, in
OpenAI's shape: an upstream that cannot be reached is a 502 (``upstream_unreachable``), one that does not
answer in time a 504 (``upstream_timeout``), an answer over the size cap a 502 (``upstream_answer_too_large``).

Three limits hold against a slow or hostile upstream:

  - ``deadline``: the whole answer, from sending the request to its last byte (a whole body, or a whole
    stream), however slowly the bytes trickle in;
  - ``idle_timeout``: a stream's longest wait for its next complete event (a byte now and then is not an event);
  - ``max_answer_bytes``: a whole answer is read while it streams in, and refused once it passes the cap,
    before the rest is read; a stream's single event is held to the same cap.

An upstream that could not be connected to (refused, unknown host, no free connection in time) provably
received nothing: that failure is a :class:`NothingSentError`, so that the caller may refund the charge.

The upstream's key is sent as ``Authorization: Bearer``; it is never logged and never part of an error message.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import Any

import httpx

from privlm.service.errors import ServiceError
from privlm.settings.chat import MAX_UPSTREAM_ANSWER_BYTES, UPSTREAM_IDLE_TIMEOUT, UPSTREAM_TIMEOUT
from privlm.validation import check_positive_finite, check_positive_int

CONNECT_TIMEOUT = 10.0
DEADLINE, IDLE_TIMEOUT, MAX_ANSWER_BYTES = UPSTREAM_TIMEOUT, UPSTREAM_IDLE_TIMEOUT, MAX_UPSTREAM_ANSWER_BYTES
# Not passed on: they describe the upstream connection, not the answer (httpx has already decoded the body).
_HOP_BY_HOP = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length", "content-encoding",
                         "server", "date", "set-cookie", "proxy-authenticate", "upgrade", "trailer", "te"})
# Failures before a connection existed: not one byte of the request left (httpx sends only once connected).
_NOTHING_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)
_GATEWAY_HEADERS = ("x-privlm-", "x-should-retry")  # the gateway's own: never taken from an upstream


@dataclass(frozen=True)
class UpstreamAnswer:
    """The upstream's answer as it came: status, the headers worth passing on, and the body."""

    status: int
    headers: dict[str, str]
    body: bytes

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300


class NothingSentError(ServiceError):
    """The upstream could not be connected to: it received nothing of the request (a charge may be refunded)."""


class UpstreamStreamError(Exception):
    """A stream that failed after it started (cut, too slow, too large); the message says how, never the text."""


def passed_headers(headers: httpx.Headers) -> dict[str, str]:
    """The upstream's response headers a caller may see: all but the hop-by-hop ones and those the gateway speaks
    in (``x-privlm-*``, ``x-should-retry``), which an upstream must not be able to forge."""
    return {name: value for name, value in headers.items()
            if name.lower() not in _HOP_BY_HOP and not name.lower().startswith(_GATEWAY_HEADERS)}


class ChatUpstream:
    """An OpenAI-compatible API at ``base_url`` (``http://host:port/v1``, or without ``/v1``: it is added).

    ``api_key``: sent as a Bearer token (read it from the environment; never put it on a command line).
    ``deadline``, ``idle_timeout``, ``max_answer_bytes``: see the module doc (``read_timeout`` is the former
    name of ``deadline``, still accepted). ``transport``: an httpx transport, for tests.
    """

    def __init__(self, base_url: str, *, api_key: str | None = None, connect_timeout: float = CONNECT_TIMEOUT,
                 deadline: float = DEADLINE, idle_timeout: float = IDLE_TIMEOUT,
                 max_answer_bytes: int = MAX_ANSWER_BYTES, read_timeout: float | None = None,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        check_positive_finite("connect_timeout", connect_timeout)
        self.deadline = check_positive_finite("deadline", deadline if read_timeout is None else read_timeout)
        self.idle_timeout = check_positive_finite("idle_timeout", idle_timeout)
        self.max_answer_bytes = check_positive_int("max_answer_bytes", max_answer_bytes)
        url = httpx.URL(base_url)
        if url.scheme not in ("http", "https") or not url.host:
            raise ValueError(f"the upstream's base URL must be http(s)://host[:port][/v1], got {base_url!r}")
        path = url.path.rstrip("/")
        self.base_url = str(url.copy_with(path=path if path.endswith("/v1") else f"{path}/v1"))
        # identity: the cap counts the bytes that arrive, and no compressed answer can expand past it in one read
        headers = {"Accept-Encoding": "identity"} | ({"Authorization": f"Bearer {api_key}"} if api_key else {})
        # httpx's own timeouts are per operation; the deadline above bounds the whole answer.
        timeout = httpx.Timeout(self.deadline, connect=min(connect_timeout, self.deadline))
        self._client = httpx.AsyncClient(base_url=self.base_url + "/", headers=headers, timeout=timeout,
                                         transport=transport, limits=httpx.Limits(max_connections=256))

    def __repr__(self) -> str:  # never the key
        return f"ChatUpstream({self.base_url})"

    async def post(self, path: str, body: Mapping[str, Any]) -> UpstreamAnswer:
        """POST ``body`` as JSON and read the whole answer, by the deadline and within the cap."""
        async with self.stream(path, body) as answer:
            return UpstreamAnswer(answer.status, answer.headers, await answer.read())

    def stream(self, path: str, body: Mapping[str, Any]) -> AbstractAsyncContextManager[UpstreamStream]:
        """POST ``body`` and hold the answer open: its headers are read, its body is read by the caller
        (:meth:`UpstreamStream.read` or :meth:`UpstreamStream.events`). A failure while opening it is a
        502/504 :class:`ServiceError` (:class:`NothingSentError` when nothing was sent)."""
        return self._open(self._client.build_request("POST", path, json=dict(body)), self.deadline)

    @asynccontextmanager
    async def _open(self, request: httpx.Request, seconds: float) -> AsyncIterator[UpstreamStream]:
        """Send ``request``; its whole answer must come within ``seconds`` from now."""
        deadline_at = asyncio.get_running_loop().time() + seconds
        with _failures():
            async with asyncio.timeout_at(deadline_at):
                response = await self._client.send(request, stream=True)
        try:
            yield UpstreamStream(response, deadline_at=deadline_at, idle_timeout=self.idle_timeout,
                                 max_bytes=self.max_answer_bytes)
        finally:
            await response.aclose()  # unread: the connection is closed, not reused

    async def models(self) -> list[str]:
        """The model ids the upstream lists at ``GET /models`` (empty when it lists none or fails; at most 10 s)."""
        try:
            async with self._open(self._client.build_request("GET", "models"), min(self.deadline, 10.0)) as answer:
                data = json.loads(await answer.read()).get("data", []) if answer.status == 200 else []
            return [str(entry["id"]) for entry in data if isinstance(entry, dict) and "id" in entry]
        except (ServiceError, ValueError, AttributeError):
            return []

    async def aclose(self) -> None:
        await self._client.aclose()


class UpstreamStream:
    """An open answer: ``status`` and ``headers`` (those worth passing on), then its body, read once, by the
    deadline and within the cap: whole (:meth:`read`) or event by event (:meth:`events`)."""

    def __init__(self, response: httpx.Response, *, deadline_at: float, idle_timeout: float, max_bytes: int) -> None:
        self._response, self.deadline_at, self.idle_timeout, self.max_bytes = (response, deadline_at, idle_timeout,
                                                                              max_bytes)
        self.status = response.status_code
        self.headers = passed_headers(response.headers)

    async def read(self) -> bytes:
        """The whole body; a 502 ``upstream_answer_too_large`` as soon as it passes the cap (the rest unread),
        a 504 at the deadline."""
        declared = self._response.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_bytes:
            raise _too_large(self.max_bytes)
        chunks, size = [], 0
        with _failures():
            async with asyncio.timeout_at(self.deadline_at):
                async for chunk in self._response.aiter_bytes():
                    size += len(chunk)
                    if size > self.max_bytes:
                        raise _too_large(self.max_bytes)
                    chunks.append(chunk)
        return b"".join(chunks)

    async def events(self, *, max_total_bytes: int | None = None) -> AsyncIterator[bytes]:
        """The stream's Server-Sent Events, each whole and as it came (bytes unchanged, with its blank line).
        A partial event is never yielded. A stream cut in the middle of an event, an event over the cap, more
        than ``max_total_bytes`` in all, no event within ``idle_timeout``, or the deadline passed: an
        :class:`UpstreamStreamError`."""
        loop = asyncio.get_running_loop()
        framer, chunks, total = SseFramer(), self._response.aiter_bytes(), 0
        idle_at = loop.time() + self.idle_timeout
        while True:
            chunk = await self._next_chunk(chunks, min(self.deadline_at, idle_at))
            if chunk is None:
                break
            total += len(chunk)
            if max_total_bytes is not None and total > max_total_bytes:
                raise UpstreamStreamError(f"the upstream's stream passed {max_total_bytes} bytes")
            for event in framer.feed(chunk):
                yield event
                idle_at = loop.time() + self.idle_timeout
            if framer.pending > self.max_bytes:
                raise UpstreamStreamError(f"the upstream sent an event of more than {self.max_bytes} bytes")
        if framer.pending:
            raise UpstreamStreamError("the upstream's stream ended in the middle of an event")

    async def _next_chunk(self, chunks: AsyncIterator[bytes], until: float) -> bytes | None:
        """The next chunk of the body (None at its end), or a :class:`UpstreamStreamError` at ``until``."""
        try:
            async with asyncio.timeout_at(until):
                return await anext(chunks, None)
        except TimeoutError:
            why = "the deadline passed" if until >= self.deadline_at else f"no event for {self.idle_timeout:g} s"
            raise UpstreamStreamError(f"the upstream's stream was cut: {why}") from None
        except httpx.HTTPError as error:
            raise UpstreamStreamError(f"the upstream failed mid-stream ({type(error).__name__})") from None


class SseFramer:
    """Cuts a byte stream into whole Server-Sent Events, leaving every byte as it came. An event ends at an
    empty line; a line ends at CRLF, LF or CR (a CR at the end of the data waits for what follows it)."""

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._line_start = 0  # the first line of the held event not yet ended
        self._scanned = 0  # where the search for that line's end resumes (no terminator before it)

    @property
    def pending(self) -> int:
        """Bytes held: an event not yet ended."""
        return len(self._buffer)

    def feed(self, chunk: bytes) -> list[bytes]:
        self._buffer += chunk
        events = []
        while (end := self._line_end()) is not None:
            empty = end - self._line_start == (2 if self._buffer[self._line_start:end] == b"\r\n" else 1)
            self._line_start = self._scanned = end
            if empty:
                events.append(bytes(self._buffer[:end]))
                del self._buffer[:end]
                self._line_start = self._scanned = 0
        return events

    def _line_end(self) -> int | None:
        """Where the current line ends (after its terminator), or None if it has not ended yet."""
        buffer, start = self._buffer, self._scanned
        lf, cr = buffer.find(b"\n", start), buffer.find(b"\r", start)
        if cr == -1 or (lf != -1 and lf < cr):
            if lf == -1:
                self._scanned = len(buffer)
                return None
            return lf + 1
        if cr + 1 == len(buffer):
            self._scanned = cr  # a CR last: CRLF or CR alone, the next byte tells
            return None
        return cr + 2 if buffer[cr + 1] == 0x0A else cr + 1


def _too_large(cap: int) -> ServiceError:
    return ServiceError(502, f"the upstream's answer passed the gateway's cap of {cap} bytes "
                             "(--max-upstream-answer-bytes)", type="upstream_error", code="upstream_answer_too_large")


@contextmanager
def _failures() -> Iterator[None]:
    """Transport failures as the gateway's 502 / 504 (what the caller sent never appears in the message)."""
    try:
        yield
    except _NOTHING_SENT as error:
        status, code = (504, "upstream_timeout") if isinstance(error, httpx.TimeoutException) else \
            (502, "upstream_unreachable")
        raise NothingSentError(status, f"the upstream could not be reached ({type(error).__name__}); nothing was "
                                       "sent to it", type="upstream_error", code=code) from None
    except (httpx.TimeoutException, TimeoutError) as error:
        raise ServiceError(504, f"the upstream did not answer in time ({type(error).__name__})",
                           type="upstream_error", code="upstream_timeout") from None
    except httpx.TransportError as error:
        raise ServiceError(502, f"the upstream could not be reached ({type(error).__name__})",
                           type="upstream_error", code="upstream_unreachable") from None
    except httpx.HTTPError as error:  # an answer that cannot be read (a bad encoding, say)
        raise ServiceError(502, f"the upstream's answer could not be read ({type(error).__name__})",
                           type="upstream_error", code="upstream_invalid") from None


def upstream_error(status: int) -> ServiceError:
    """An upstream server error (5xx) as the gateway's 502: the upstream failed, not the caller."""
    return ServiceError(502, f"the upstream failed with status {status}", type="upstream_error",
                        code="upstream_failed")
