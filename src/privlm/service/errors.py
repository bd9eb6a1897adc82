"""One error model for every privlm service, in OpenAI's shape:

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_batch", "code": "limit_exceeded"}}

``param`` names the request field or the limit at fault; ``code`` is a stable machine-readable reason.
OpenAI's SDKs and tools that speak its API read these errors as they read OpenAI's own.
"""

from __future__ import annotations

from typing import Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel

ErrorType = Literal["invalid_request_error", "authentication_error", "not_found_error", "insufficient_quota",
                    "rate_limit_error", "upstream_error", "server_error"]


class ErrorDetail(BaseModel):
    message: str
    type: ErrorType
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    error: ErrorDetail


class ServiceError(Exception):
    """Raised anywhere in a request; the scaffolding answers ``status`` with an :class:`ErrorBody`."""

    def __init__(self, status: int, message: str, *, type: ErrorType = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None) -> None:
        message, param = _encodable(message), None if param is None else _encodable(param)
        super().__init__(message)
        self.status, self.headers = status, headers
        self.detail = ErrorDetail(message=message, type=type, param=param, code=code)

    def response(self) -> JSONResponse:
        return JSONResponse(ErrorBody(error=self.detail).model_dump(), status_code=self.status, headers=self.headers)


def _encodable(text: str) -> str:
    """``text`` with anything UTF-8 cannot carry (lone surrogates) replaced, so that an error always renders."""
    return text.encode("utf-8", "replace").decode("utf-8")


def ledger_unavailable() -> ServiceError:
    """A database of the privacy ledger (or memory) could not be reached: 503, the database unnamed. Nothing was sent
    upstream; a retry may succeed (a charge may stand if the database failed after it: the safe side)."""
    return ServiceError(503, "the privacy ledger is unavailable; nothing was sent upstream", type="server_error",
                        code="ledger_unavailable", headers={"retry-after": "1"})


def error_response(status: int, message: str, *, type: ErrorType = "invalid_request_error", param: str | None = None,
                   code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    return ServiceError(status, message, type=type, param=param, code=code, headers=headers).response()


# For the OpenAPI document: every route may answer these with an ErrorBody.
ERROR_RESPONSES: dict[int | str, dict[str, object]] = {
    status: {"model": ErrorBody, "description": description} for status, description in (
        (400, "Invalid request"), (401, "Missing or invalid API key"), (404, "Not found"),
        (408, "Request body too slow"), (413, "Request too large"), (415, "Unsupported content type"),
        (422, "Malformed payload"),
        (429, "Privacy budget exhausted, or too many requests in flight for one caller"),
        (502, "Upstream failed or unreachable"), (503, "Busy: retry after a second"),
        (504, "Upstream timed out"))}
