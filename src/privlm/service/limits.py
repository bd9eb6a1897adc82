"""A request-body limit enforced while the body is read, whatever ``Content-Length`` says.

The middleware reads the body chunk by chunk before the route runs. A declared ``Content-Length`` over
the limit is refused before anything is read; a body that crosses the limit while streaming (chunked,
or lying about its length) is refused as soon as it crosses. Memory therefore stays below the limit
plus one chunk. The route then reads the buffered body as usual.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from privlm.service.errors import error_response


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, *, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
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
                                  code="limit_exceeded", headers={"connection": "close"})
        await response(scope, receive, send)
