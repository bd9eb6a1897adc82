"""A request-body limit enforced while the body is read, whatever ``Content-Length`` says.

The middleware reads the body chunk by chunk before the route runs. A request that carries a body
without an accepted key is refused (401) before any of it is read, so only authorised callers can
make the service hold a body. A declared ``Content-Length`` over the limit is refused before anything
is read; a body that crosses the limit while streaming (chunked, or lying about its length) is refused
as soon as it crosses. Memory therefore stays below the limit plus one chunk per request. The route
then reads the buffered body as usual.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from privlm.service.auth import BearerKeys
from privlm.service.errors import error_response


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, *, max_bytes: int, auth: BearerKeys) -> None:
        self.app, self.max_bytes, self.auth = app, max_bytes, auth

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        declared = headers.get(b"content-length", b"")
        has_body = (declared.isdigit() and int(declared) > 0) or b"transfer-encoding" in headers
        if has_body and not self.auth.accepts_header(headers.get(b"authorization", b"").decode("latin-1")):
            refusal = self.auth.refusal().response()
            refusal.headers["connection"] = "close"  # the unread body is not drained: the connection ends
            await refusal(scope, receive, send)
            return
        if declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(scope, receive, send, f"request of {int(declared)} bytes")
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
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

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, what: str) -> None:
        response = error_response(413, f"{what} exceeds max_request_bytes={self.max_bytes}", param="max_request_bytes",
                                  code="limit_exceeded", headers={"connection": "close"})  # the rest is not drained
        await response(scope, receive, send)
