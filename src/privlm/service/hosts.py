"""The ``Host`` check that keeps a keyless service out of reach of DNS rebinding.

A web page on ``evil.example`` can make its own name resolve to 127.0.0.1 and then read, with the
browser's blessing, whatever a keyless service on localhost answers: the browser still sends
``Host: evil.example``. So an open service (no API keys) answers only requests whose ``Host`` is a
loopback name: ``localhost`` (and ``*.localhost``), ``127.0.0.0/8`` or ``[::1]``, with any port. Other
``Host`` values get a 400 ``invalid_host`` in OpenAI's error shape, on every route, before any body
is read. ``allowed_hosts`` adds names (``"*"``: any); a service with keys accepts any ``Host`` unless
it is given ``allowed_hosts``. Requests that do not come over a socket (an in-process test client)
are checked like the others.
"""

from __future__ import annotations

from collections.abc import Sequence

from starlette.types import ASGIApp, Receive, Scope, Send

from privlm.service.errors import error_response
from privlm.settings.service import ANY_HOST, host_name, is_loopback


class HostCheckMiddleware:
    """Refuses requests whose ``Host`` is not loopback and not in ``allowed_hosts`` (400, ``invalid_host``)."""

    def __init__(self, app: ASGIApp, *, allowed_hosts: Sequence[str]) -> None:
        self.app = app
        self.allowed = frozenset(host_name(host) if host != ANY_HOST else host for host in allowed_hosts)

    def accepts(self, host: str | None) -> bool:
        if ANY_HOST in self.allowed:
            return True
        return host is not None and (is_loopback(host) or host_name(host) in self.allowed)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        hosts = [value.decode("latin-1") for name, value in scope["headers"] if name == b"host"]
        if len(hosts) == 1 and self.accepts(hosts[0]):
            await self.app(scope, receive, send)
            return
        what = "this Host" if len(hosts) == 1 else f"{len(hosts)} Host headers"  # never quote the caller's input
        refusal = error_response(400, f"this service does not answer for {what}: a service without API keys "
                                      "answers loopback names only (localhost, 127.0.0.1, [::1]); configure "
                                      "allowed hosts to serve others", param="host", code="invalid_host",
                                 headers={"connection": "close"})  # a body, if any, is not read
        await refusal(scope, receive, send)
