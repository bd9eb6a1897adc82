"""One retry policy for every privlm client, sync or async (tenacity drives both).

What is retried, with exponential back-off, for up to ``retry_for`` seconds (default 60 s, longer
than a cold start of ``privlm serve``: 9.1 s for MiniLM as measured in issue 10, and
``test_finding_8_a_client_started_with_the_server_rides_out_its_cold_start`` starts the two together):
  - busy answers (429, 502, 503, 504) unless the server says ``x-should-retry: false``;
  - connection failures before the request was sent (connect errors and timeouts, a full pool);
  - for an idempotent request only (``idempotent=True``, the default: every SnD call is one, since a
    retry resends the same bytes), failures after it may have been sent: read and write timeouts, a
    dropped connection. A request that is not idempotent is never sent twice after it may have arrived.
What is final at once: any other 4xx raises :class:`RequestRefusedError` (a ``ValueError`` with the
server's status, code and message), any other 5xx :class:`ServerError`, and a redirect
:class:`ServerError` too: privlm clients never follow one, so a key never travels to another origin.
Every failed attempt is counted in ``failed_attempts``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    RetryError,
    Retrying,
    retry_if_exception,
    stop_after_attempt,
    stop_before_delay,
)
from tenacity import wait_exponential as exponential_wait
from tenacity.stop import stop_base

from privlm.validation import check_non_negative_finite, check_positive_finite

RETRY_STATUSES = frozenset({429, 502, 503, 504})
# The request never left: resending it cannot repeat anything.
_NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)
# It may have arrived: resent only when idempotent. Other transport errors (an unsupported scheme, a request
# httpx itself refuses to send) will not go away by waiting, and are not retried.
_MAY_HAVE_ARRIVED = (httpx.TimeoutException, httpx.NetworkError, httpx.RemoteProtocolError)


class ServerError(RuntimeError):
    """The server failed, answered something malformed, or stayed unreachable through every retry."""


class RequestRefusedError(ValueError):
    """The server refused the request (4xx): ``status``, ``code`` and ``message`` are the server's."""

    def __init__(self, status: int, message: str, *, code: str | None = None) -> None:
        super().__init__(f"server refused the request ({status}): {message}")
        self.status, self.code, self.server_message = status, code, message


class _BusyError(Exception):
    """A busy answer, worth another attempt."""

    def __init__(self, response: httpx.Response) -> None:
        super().__init__(f"server busy ({response.status_code})")


def final_response(response: httpx.Response) -> httpx.Response:
    """The response if it is a 2xx; a busy answer raises ``_BusyError`` (retried), a 4xx
    :class:`RequestRefusedError`, a 3xx or 5xx :class:`ServerError`. ``x-should-retry: false`` (an
    exhausted privacy budget, say) makes a busy status final."""
    status = response.status_code
    if status in RETRY_STATUSES and response.headers.get("x-should-retry") != "false":
        raise _BusyError(response)
    if 300 <= status < 400:
        location = response.headers.get("location", "")[:120]
        raise ServerError(f"the server answered a redirect ({status}) to {location!r}; privlm clients do not "
                          "follow redirects, so that the API key never travels to another address")
    if 400 <= status < 500:
        message, code = response.text[:200], None
        try:
            error = response.json()["error"]
            message, code = str(error["message"]), error.get("code")
        except (ValueError, KeyError, TypeError, AttributeError):
            pass
        raise RequestRefusedError(status, message, code=code if isinstance(code, str) else None)
    if status >= 500:
        raise ServerError(f"server error {status}: {response.text[:200]}")
    return response


@dataclass(kw_only=True)
class RetryPolicy:
    """Attempts until ``retry_for`` seconds have passed (and at most ``retries`` further attempts, when
    given), waiting ``backoff * 2**k`` seconds between them (at most ``max_backoff``)."""

    retry_for: float = 60.0
    retries: int | None = None
    backoff: float = 0.25
    max_backoff: float = 4.0
    failed_attempts: int = field(default=0, init=False)  # connection errors and busy answers seen

    def __post_init__(self) -> None:
        check_positive_finite("retry_for", self.retry_for)
        if self.retries is not None and (isinstance(self.retries, bool) or not isinstance(self.retries, int)
                                         or self.retries < 0):
            raise ValueError(f"retries must be None or an integer >= 0, got {self.retries!r}")
        check_non_negative_finite("backoff", self.backoff)
        check_non_negative_finite("max_backoff", self.max_backoff)

    def _settings(self, idempotent: bool) -> dict[str, Any]:
        stop: stop_base = stop_before_delay(self.retry_for)
        if self.retries is not None:
            stop = stop | stop_after_attempt(self.retries + 1)

        def worth_another(error: BaseException) -> bool:
            if isinstance(error, (_BusyError, *_NOT_SENT)):
                return True
            return idempotent and isinstance(error, _MAY_HAVE_ARRIVED)

        return {"stop": stop, "wait": exponential_wait(multiplier=self.backoff, max=self.max_backoff),
                "retry": retry_if_exception(worth_another), "after": self._count}

    def _count(self, _: RetryCallState) -> None:
        self.failed_attempts += 1

    def _exhausted(self, error: RetryError) -> ServerError:
        attempt = error.last_attempt
        cause = attempt.exception()
        exhausted = ServerError(f"no answer after {attempt.attempt_number} attempts over up to {self.retry_for:g} s "
                                f"(retry_for): {cause}")
        exhausted.__cause__ = cause
        return exhausted

    def call(self, send: Callable[[], httpx.Response], *, idempotent: bool = True) -> httpx.Response:
        """Send until a final answer, blocking between attempts."""
        try:
            return Retrying(**self._settings(idempotent))(lambda: final_response(send()))
        except RetryError as error:
            raise self._exhausted(error) from None
        except httpx.TransportError as error:  # not retried: not idempotent, or not worth it
            raise ServerError(f"the request failed and was not resent: {error}") from error

    async def acall(self, send: Callable[[], Awaitable[httpx.Response]], *, idempotent: bool = True
                    ) -> httpx.Response:
        """The same policy for an async client."""
        async def attempt() -> httpx.Response:
            return final_response(await send())
        try:
            return await AsyncRetrying(**self._settings(idempotent))(attempt)
        except RetryError as error:
            raise self._exhausted(error) from None
        except httpx.TransportError as error:
            raise ServerError(f"the request failed and was not resent: {error}") from error
