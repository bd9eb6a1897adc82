"""One retry policy for every privlm client, sync or async (tenacity drives both).

Connection errors and busy answers (429, 502, 503, 504) are retried with exponential back-off; any
other 4xx is the caller's mistake and raises ``ValueError`` with the server's message at once; any
other 5xx raises :class:`ServerError`. Every failed attempt is counted in ``failed_attempts``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
from tenacity import AsyncRetrying, RetryCallState, RetryError, Retrying, retry_if_exception_type, stop_after_attempt
from tenacity import wait_exponential as exponential_wait

from privlm._validation import check_non_negative_finite

RETRY_STATUSES = frozenset({429, 502, 503, 504})


class ServerError(RuntimeError):
    """The server failed, or stayed unreachable through every retry."""


class _BusyError(Exception):
    """A busy answer, worth another attempt."""

    def __init__(self, response: httpx.Response) -> None:
        super().__init__(f"server busy ({response.status_code})")


def final_response(response: httpx.Response) -> httpx.Response:
    """The response if it is final (2xx/3xx); a busy answer raises ``_BusyError`` (retried), a 4xx ``ValueError``
    naming the server's message, a 5xx :class:`ServerError`. ``x-should-retry: false`` (an exhausted privacy
    budget, say) makes a busy status final."""
    if response.status_code in RETRY_STATUSES and response.headers.get("x-should-retry") != "false":
        raise _BusyError(response)
    if 400 <= response.status_code < 500:
        try:
            message = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = response.text[:200]
        raise ValueError(f"server refused the request ({response.status_code}): {message}")
    if response.status_code >= 500:
        raise ServerError(f"server error {response.status_code}: {response.text[:200]}")
    return response


@dataclass
class RetryPolicy:
    """``retries`` further attempts after the first, waiting ``backoff * 2**k`` seconds (at most ``max_backoff``)."""

    retries: int = 5
    backoff: float = 0.25
    max_backoff: float = 8.0
    failed_attempts: int = field(default=0, init=False)  # connection errors and busy answers seen

    def __post_init__(self) -> None:
        if isinstance(self.retries, bool) or not isinstance(self.retries, int) or self.retries < 0:
            raise ValueError(f"retries must be an integer >= 0, got {self.retries!r}")
        check_non_negative_finite("backoff", self.backoff)
        check_non_negative_finite("max_backoff", self.max_backoff)

    def _settings(self) -> dict[str, Any]:
        return {"stop": stop_after_attempt(self.retries + 1),
                "wait": exponential_wait(multiplier=self.backoff, max=self.max_backoff),
                "retry": retry_if_exception_type((httpx.TransportError, _BusyError)), "after": self._count}

    def _count(self, _: RetryCallState) -> None:
        self.failed_attempts += 1

    def _exhausted(self, error: RetryError) -> ServerError:
        cause = error.last_attempt.exception()
        exhausted = ServerError(f"no answer after {self.retries + 1} attempts: {cause}")
        exhausted.__cause__ = cause
        return exhausted

    def call(self, send: Callable[[], httpx.Response]) -> httpx.Response:
        """Send until a final answer, blocking between attempts."""
        try:
            return Retrying(**self._settings())(lambda: final_response(send()))
        except RetryError as error:
            raise self._exhausted(error) from None

    async def acall(self, send: Callable[[], Awaitable[httpx.Response]]) -> httpx.Response:
        """The same policy for an async client."""
        async def attempt() -> httpx.Response:
            return final_response(await send())
        try:
            return await AsyncRetrying(**self._settings())(attempt)
        except RetryError as error:
            raise self._exhausted(error) from None
