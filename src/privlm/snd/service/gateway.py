"""``privlm gateway``: a local OpenAI-compatible ``POST /v1/embeddings`` that turns every request
into a private SnD round trip to a remote ``privlm serve``. Apps switch by changing ``base_url``.

Requests are served concurrently: each is tokenized once, and its tokens, generator and report stay
within the request. With a ledger, each request's release (eta per token row) is spent against the
caller's key before anything leaves; an exhausted budget is a 429 naming it.
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Sequence
from typing import Literal

import numpy as np
from fastapi import APIRouter, Depends, FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from privlm.service import BearerKeys, ServerError, ServiceError, create_service_app
from privlm.snd.encoder import Encoded
from privlm.snd.service.client import Client

MAX_REQUEST_BYTES = 8 * 2**20


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


def _privacy_headers(client: Client, encoded: Encoded, too_long: list[int]) -> dict[str, str]:
    """The privacy report of one request, as response headers."""
    report = encoded.report
    headers = {"x-privlm-mechanism": "snd-dchi", "x-privlm-eta": f"{client.eta:g}",
               "x-privlm-tokens-perturbed": str(report.tokens)}
    if report.receipt is not None:
        headers |= {"x-privlm-eta-tokens-spent": f"{report.receipt.spend.amount:.6g}",
                    "x-privlm-budget-remaining": f"{report.receipt.remaining:.6g}"}
    if too_long:
        headers["x-privlm-truncated"] = ",".join(map(str, too_long))
    return headers


def create_gateway(client: Client, *, api_keys: Sequence[str] = (), max_inputs: int = 2048, truncate: bool = False,
                   max_request_bytes: int = MAX_REQUEST_BYTES) -> FastAPI:
    """The gateway around one configured ``Client`` (eta, denoiser, server and ledger are fixed at start).

    A text longer than the model's maximum is refused with a 400 (``param`` = ``input``, ``code`` =
    ``context_length_exceeded``, as OpenAI does), unless ``truncate``: then it is cut and the response
    header ``x-privlm-truncated`` lists the indices of the cut inputs.
    """
    auth = BearerKeys(api_keys)
    model_id = f"privlm-snd-{client.model.name}"
    max_length = client.model.max_length
    router = APIRouter(tags=["embeddings"])

    @router.get("/v1/models")
    async def models() -> dict[str, object]:
        return {"object": "list", "data": [{"id": model_id, "object": "model", "owned_by": "privlm"}]}

    @router.post("/v1/embeddings")
    async def embeddings(request: EmbeddingRequest, principal: str = Depends(auth)) -> JSONResponse:
        texts = [request.input] if isinstance(request.input, str) else request.input
        if not texts or len(texts) > max_inputs:
            raise ServiceError(400, f"input must hold 1 to {max_inputs} texts, got {len(texts)}", param="input")
        if request.dimensions is not None and request.dimensions != client.model.hidden_size:
            raise ServiceError(400, f"dimensions must be {client.model.hidden_size} for this model",
                               param="dimensions")
        try:  # in a worker thread: the tokenizer is serialised, and the event loop must not wait on it
            tokens = await asyncio.to_thread(client.model.tokens, texts)
        except ValueError as error:
            raise ServiceError(400, str(error), param="input") from None
        too_long = tokens.longer_than(max_length)
        if too_long and not truncate:
            raise ServiceError(400, f"inputs {too_long[:10]} exceed the model's maximum of {max_length} tokens "
                                    "(start the gateway with --truncate to cut them instead)",
                               param="input", code="context_length_exceeded")
        try:
            # "count": cut texts are reported in the x-privlm-truncated header, not as a warning
            encoded = await asyncio.to_thread(client.encode_with_report, tokens, principal=principal,
                                              truncation="count")
        except ServerError as error:
            raise ServiceError(502, f"the SnD server failed: {error}", type="upstream_error") from None
        except ValueError as error:
            raise ServiceError(400, str(error)) from None
        data = [_embedding_item(i, v, request.encoding_format) for i, v in enumerate(encoded.vectors)]
        usage = {"prompt_tokens": encoded.report.tokens, "total_tokens": encoded.report.tokens}
        return JSONResponse({"object": "list", "data": data, "model": model_id, "usage": usage},
                            headers=_privacy_headers(client, encoded, too_long))

    return create_service_app(title="privlm gateway (OpenAI-compatible embeddings)", routers=[router], auth=auth,
                              max_request_bytes=max_request_bytes,
                              health=lambda: {"eta": client.eta, "server": str(client.http.base_url)})
