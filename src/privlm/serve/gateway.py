"""``privlm gateway``: a local OpenAI-compatible ``POST /v1/embeddings`` that turns every request
into a private SnD round trip to a remote ``privlm serve``. Apps switch by changing ``base_url``.
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Sequence
from typing import Literal

import numpy as np
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from privlm.serve.server import error_response
from privlm.snd.client import Client, ServerError


class EmbeddingRequest(BaseModel):
    input: str | list[str] = Field(description="Text or list of texts (token arrays are refused: send text).")
    model: str
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None


def _embedding_item(index: int, vector: np.ndarray, encoding: str) -> dict[str, object]:
    value: object = (base64.b64encode(vector.astype("<f4").tobytes()).decode() if encoding == "base64"
                     else vector.astype(float).tolist())
    return {"object": "embedding", "index": index, "embedding": value}


MAX_REQUEST_BYTES = 8 * 2**20


def create_gateway(client: Client, *, api_keys: Sequence[str] = (), max_inputs: int = 2048,
                   truncate: bool = False, max_request_bytes: int = MAX_REQUEST_BYTES) -> FastAPI:
    """The gateway around one configured ``Client`` (eta, denoiser and server are fixed at start).

    A text longer than the model's maximum is refused with a 400 naming ``max_tokens`` (as OpenAI
    does), unless ``truncate``: then it is cut and the response header ``x-privlm-truncated``
    lists the indices of the cut inputs.
    """
    app = FastAPI(title="privlm gateway (OpenAI-compatible embeddings)", version="1")
    keys = frozenset(api_keys)
    model_id = f"privlm-snd-{client.model.name}"
    lock = asyncio.Lock()  # the client's generator and report are not shared across threads

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, error: RequestValidationError) -> JSONResponse:
        return error_response(400, f"invalid request: {error.errors()[:3]}")

    async def authorised(request: Request) -> None:
        if keys and request.headers.get("authorization", "").removeprefix("Bearer ").strip() not in keys:
            raise _AuthError

    @app.exception_handler(_AuthError)
    async def unauthorised(_: Request, __: Exception) -> JSONResponse:
        return error_response(401, "missing or invalid API key", kind="authentication_error")

    @app.get("/health")
    async def health() -> dict[str, object]:
        return {"status": "ok", "eta": client.eta, "server": str(client.http.base_url)}

    @app.get("/v1/models", dependencies=[Depends(authorised)])
    async def models() -> dict[str, object]:
        return {"object": "list", "data": [{"id": model_id, "object": "model", "owned_by": "privlm"}]}

    @app.middleware("http")
    async def bounded_body(request: Request, call_next):  # before the JSON is parsed
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > max_request_bytes:
            return error_response(413, f"request of {declared} bytes exceeds max_request_bytes={max_request_bytes}",
                                  limit="max_request_bytes")
        return await call_next(request)

    @app.post("/v1/embeddings", dependencies=[Depends(authorised)])
    async def embeddings(request: EmbeddingRequest) -> JSONResponse:
        texts = [request.input] if isinstance(request.input, str) else request.input
        if not texts or len(texts) > max_inputs:
            return error_response(400, f"input must hold 1 to {max_inputs} texts, got {len(texts)}", limit="input")
        too_long = [i for i, n in enumerate(client.model.token_counts(texts)) if n > client.model.max_length]
        if too_long and not truncate:
            return error_response(400, f"inputs {too_long[:10]} exceed the model's maximum of "
                                       f"{client.model.max_length} tokens (start the gateway with --truncate "
                                       "to cut them instead)", limit="max_tokens")
        if request.dimensions is not None and request.dimensions != client.model.hidden_size:
            return error_response(400, f"dimensions must be {client.model.hidden_size} for this model",
                                  limit="dimensions")
        try:
            async with lock:
                vectors = await asyncio.to_thread(client.encode, texts)
                tokens = client.last_report.tokens
        except ValueError as error:
            return error_response(400, str(error))
        except ServerError as error:
            return error_response(502, f"the SnD server failed: {error}", kind="upstream_error")
        data = [_embedding_item(i, v, request.encoding_format) for i, v in enumerate(vectors)]
        headers = {"x-privlm-truncated": ",".join(map(str, too_long))} if too_long else None
        return JSONResponse({"object": "list", "data": data, "model": model_id,
                             "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}, headers=headers)

    return app


class _AuthError(Exception):
    pass
