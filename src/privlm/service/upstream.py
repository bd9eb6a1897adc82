"""Forwarding to an OpenAI-compatible upstream (the chat API a gateway protects the prompts for).

One ``httpx.AsyncClient`` per gateway, with separate connect and read timeouts. What the upstream answers
comes back as it is: its status, its body, its content type; a stream passes through chunk by chunk. What
fails on the way is the gateway's error, in OpenAI's shape: an upstream that cannot be reached is a 502
(``upstream_unreachable``), one that does not answer in time a 504 (``upstream_timeout``). The upstream's
key is sent as ``Authorization: Bearer``; it is never logged and never part of an error message.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import Any

import httpx

from privlm._validation import check_positive_finite
from privlm.service.errors import ServiceError

CONNECT_TIMEOUT = 10.0
READ_TIMEOUT = 300.0  # a long generation may take minutes before its first byte
# Not passed on: they describe the upstream connection, not the answer (httpx has already decoded the body).
_HOP_BY_HOP = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length", "content-encoding",
                         "server", "date", "set-cookie", "proxy-authenticate", "upgrade", "trailer", "te"})


@dataclass(frozen=True)
class UpstreamAnswer:
    """The upstream's answer as it came: status, the headers worth passing on, and the body."""

    status: int
    headers: dict[str, str]
    body: bytes

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300


def passed_headers(headers: httpx.Headers) -> dict[str, str]:
    """The upstream's response headers a caller may see: all but the hop-by-hop ones."""
    return {name: value for name, value in headers.items() if name.lower() not in _HOP_BY_HOP}


class ChatUpstream:
    """An OpenAI-compatible API at ``base_url`` (``http://host:port/v1``, or without ``/v1``: it is added).

    ``api_key``: sent as a Bearer token (read it from the environment; never put it on a command line).
    ``transport``: an httpx transport, for tests.
    """

    def __init__(self, base_url: str, *, api_key: str | None = None, connect_timeout: float = CONNECT_TIMEOUT,
                 read_timeout: float = READ_TIMEOUT, transport: httpx.AsyncBaseTransport | None = None) -> None:
        check_positive_finite("connect_timeout", connect_timeout)
        check_positive_finite("read_timeout", read_timeout)
        url = httpx.URL(base_url)
        if url.scheme not in ("http", "https") or not url.host:
            raise ValueError(f"the upstream's base URL must be http(s)://host[:port][/v1], got {base_url!r}")
        path = url.path.rstrip("/")
        self.base_url = str(url.copy_with(path=path if path.endswith("/v1") else f"{path}/v1"))
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        timeout = httpx.Timeout(read_timeout, connect=connect_timeout)
        self._client = httpx.AsyncClient(base_url=self.base_url + "/", headers=headers, timeout=timeout,
                                         transport=transport, limits=httpx.Limits(max_connections=256))

    def __repr__(self) -> str:  # never the key
        return f"ChatUpstream({self.base_url})"

    async def post(self, path: str, body: Mapping[str, Any]) -> UpstreamAnswer:
        """POST ``body`` as JSON and read the whole answer."""
        with _failures():
            response = await self._client.post(path, json=dict(body))
            return UpstreamAnswer(response.status_code, passed_headers(response.headers), response.content)

    @asynccontextmanager
    async def stream(self, path: str, body: Mapping[str, Any]) -> AsyncIterator[httpx.Response]:
        """POST ``body`` and hold the answer open: its headers are read, its body is read by the caller
        (``aiter_bytes``). A failure while opening it is a 502/504 :class:`ServiceError`."""
        request = self._client.build_request("POST", path, json=dict(body))
        with _failures():
            response = await self._client.send(request, stream=True)
        try:
            yield response
        finally:
            await response.aclose()

    async def models(self) -> list[str]:
        """The model ids the upstream lists at ``GET /models`` (empty when it lists none or fails)."""
        try:
            response = await self._client.get("models", timeout=10.0)
            data = response.json().get("data", []) if response.status_code == 200 else []
            return [str(entry["id"]) for entry in data if isinstance(entry, dict) and "id" in entry]
        except (httpx.HTTPError, ValueError, AttributeError):
            return []

    async def aclose(self) -> None:
        await self._client.aclose()


@contextmanager
def _failures() -> Iterator[None]:
    """Transport failures as the gateway's 502 / 504 (what the caller sent never appears in the message)."""
    try:
        yield
    except httpx.TimeoutException as error:
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
