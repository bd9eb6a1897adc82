"""``privlm gateway``: a local OpenAI-compatible ``POST /v1/embeddings`` that turns every request
into a private SnD round trip to a remote ``privlm serve``. Apps switch by changing ``base_url``.

Requests are served concurrently: each is tokenized once, and its tokens, generator and report stay
within the request. With a ledger, each request's release (eta per token row) is spent against the
caller's key before anything leaves; an exhausted budget is a 429 naming it.

No caller can hold the gateway: a request may carry at most ``max_request_tokens`` tokens (OpenAI's
300,000 by default), CPU work runs in worker threads, and each request's batches take turns with other callers'
(:class:`privlm.service.FairScheduler`: round-robin between keys, or between requests on an open
gateway). Error messages name inputs by index, never by their text.
"""

# No `from __future__ import annotations` here: the route's request is annotated with this gateway's own class
# (EmbeddingsRoutes.router), which FastAPI must get as the class itself; a name could not be resolved.
import asyncio
import base64
import json
from typing import Annotated, Literal

import numpy as np
from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field, StringConstraints

from privlm.models import Tokens, check_texts
from privlm.service import (
    BearerKeys,
    FairScheduler,
    ModelEntry,
    RequestRefusedError,
    ServerError,
    ServiceError,
    check_model,
    public_model_name,
)
from privlm.settings.gateway import EmbeddingsOptions
from privlm.snd.encoder import Encoded
from privlm.snd.service.client import Client
from privlm.validation import check_positive_int

TOKENIZE_CHUNK = 64  # texts tokenized in one turn


class EmbeddingRequest(BaseModel):
    input: str | list[str] = Field(description="Text or list of texts (token arrays are refused: send text).")
    model: str
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None


class EmbeddingItem(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str = Field(description="Floats, or base64 of little-endian float32.")


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(BaseModel):
    """OpenAI's embeddings answer."""

    object: Literal["list"] = "list"
    data: list[EmbeddingItem]
    model: str
    usage: EmbeddingUsage


def _report_header(description: str) -> dict[str, object]:
    return {"description": description, "schema": {"type": "string"}}


_PRIVACY_HEADERS = {
    "x-privlm-mechanism": _report_header("The mechanism: snd-dchi."),
    "x-privlm-eta": _report_header("eta: the d_chi privacy level per token row."),
    "x-privlm-tokens-perturbed": _report_header("Token rows released (eta each)."),
    "x-privlm-eta-tokens-spent": _report_header("With a ledger: this request's spend."),
    "x-privlm-budget-remaining": _report_header("With a ledger: the caller's budget left."),
    "x-privlm-truncated": _report_header("Indices of the inputs cut to the model's maximum (--truncate)."),
    "x-privlm-unknown-tokens": _report_header("Indices of the inputs with unknown tokens."),
    "x-privlm-no-content": _report_header("Indices of the inputs with no content tokens at all.")}


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
    for name, indices in (("x-privlm-truncated", too_long), ("x-privlm-unknown-tokens", report.unknown_indices),
                          ("x-privlm-no-content", report.contentless_indices)):
        if indices:
            headers[name] = ",".join(map(str, indices))
    return headers


def _render(model_id: str, encoded: Encoded, encoding: str) -> bytes:
    data = [_embedding_item(i, v, encoding) for i, v in enumerate(encoded.vectors)]
    usage = {"prompt_tokens": encoded.report.tokens, "total_tokens": encoded.report.tokens}
    return json.dumps({"object": "list", "data": data, "model": model_id, "usage": usage}).encode()


def _upstream_failure(error: Exception) -> ServiceError:
    """An upstream failure is the gateway's problem, never the caller's: 502, naming what went wrong."""
    if isinstance(error, RequestRefusedError) and error.status in (401, 403):
        return ServiceError(502, f"the SnD server refused this gateway's key ({error.status}); the gateway's "
                                 "operator must fix --server-api-key", type="upstream_error",
                            code="upstream_authentication_failed")
    if isinstance(error, RequestRefusedError):
        return ServiceError(502, f"the SnD server refused the gateway's request ({error.status}): "
                                 f"{error.server_message[:200]}", type="upstream_error", code="upstream_refused")
    return ServiceError(502, f"the SnD server failed: {str(error)[:300]}", type="upstream_error",
                        code="upstream_failed")


def _request_model(max_inputs: int, model_id: str, width: int) -> type[EmbeddingRequest]:
    """This gateway's request: its real constraints, for validation and its OpenAPI schema."""
    Text = Annotated[str, StringConstraints(pattern=r"\S")]

    class GatewayEmbeddingRequest(EmbeddingRequest):
        input: Text | Annotated[list[Text], Field(min_length=1, max_length=max_inputs)] = Field(
            description=f"Text or 1 to {max_inputs} texts, none blank (token arrays are refused: send text).")
        model: str = Field(json_schema_extra={"enum": [model_id]}, description="This gateway's model.")
        dimensions: int | None = Field(None, json_schema_extra={"enum": [width, None]},
                                       description=f"{width}, the model's width, if given.")

    return GatewayEmbeddingRequest


class EmbeddingsRoutes:
    """``POST /v1/embeddings`` around one configured ``Client`` (eta, denoiser, server and ledger are fixed at
    start), behind ``auth``; :meth:`router` mounts it, ``offered`` is its model for ``/v1/models``, ``health`` its
    facts for ``/health``.

    The model must be named by its id (``privlm-snd-<model>``, as ``/v1/models`` lists it), else 404
    ``model_not_found``. A request over ``max_inputs`` texts or ``options.max_request_tokens`` tokens is refused
    (400). A text longer than the model's maximum is refused with a 400 (``param`` = ``input``, ``code`` =
    ``context_length_exceeded``, as OpenAI does), unless ``options.truncate``: then it is cut and the response
    header ``x-privlm-truncated`` lists the indices of the cut inputs. Texts with unknown tokens, or with
    no content tokens at all, are listed in ``x-privlm-unknown-tokens`` and ``x-privlm-no-content``.
    """

    def __init__(self, client: Client, *, auth: BearerKeys, options: EmbeddingsOptions | None = None,
                 max_inputs: int = 2048) -> None:
        options = options or EmbeddingsOptions()  # its values checked when made
        self.client, self.truncate, self.max_request_tokens = client, options.truncate, options.max_request_tokens
        self.auth = auth.charging(client.ledger)  # callers named as the client's ledger names them
        self.max_inputs = check_positive_int("max_inputs", max_inputs)
        self.model_id = f"privlm-snd-{public_model_name(str(client.model.name))}"
        self.offered = [ModelEntry(id=self.model_id, dim=client.model.hidden_size)]
        self.health: dict[str, object] = {"model": self.model_id, "eta": client.eta}
        self.request_model = _request_model(self.max_inputs, self.model_id, client.model.hidden_size)
        self.scheduler = FairScheduler(options.max_concurrent_batches)
        self.tokenizing = FairScheduler(1)  # the tokenizer is serialised anyway: one turn at a time, fairly shared

    def router(self) -> APIRouter:
        """The route, its request typed by this gateway's own model: FastAPI reads the class itself, not a name."""
        body = self.request_model

        async def embeddings(request: body, principal: str = Depends(self.auth.dependency)  # type: ignore[valid-type]
                             ) -> Response:
            return await self.create(request, principal)

        router = APIRouter(tags=["embeddings"])
        router.add_api_route("/v1/embeddings", embeddings, methods=["POST"], response_class=JSONResponse,
                             responses={200: {"model": EmbeddingList, "description": "Private embeddings, in input "
                                                                                     "order",
                                              "headers": _PRIVACY_HEADERS}})
        return router

    async def create(self, request: EmbeddingRequest, principal: str) -> Response:
        """The private embeddings of one request, with its privacy report in the headers."""
        check_model(request.model, self.offered)
        texts = [request.input] if isinstance(request.input, str) else request.input
        if not texts or len(texts) > self.max_inputs:
            raise ServiceError(400, f"input must hold 1 to {self.max_inputs} texts, got {len(texts)}", param="input")
        width = self.client.model.hidden_size
        if request.dimensions is not None and request.dimensions != width:
            raise ServiceError(400, f"dimensions must be {width} for this model", param="dimensions")
        caller = self.auth.fair_caller(principal)
        tokens = await self.tokenize(texts, caller)
        encoded = await self.encode(tokens, caller, principal)
        content = await asyncio.to_thread(_render, self.model_id, encoded, request.encoding_format)
        too_long = tokens.longer_than(self.client.model.max_length)
        return Response(content, media_type="application/json",
                        headers=_privacy_headers(self.client, encoded, too_long))

    async def tokenize(self, texts: list[str], caller: str) -> Tokens:
        try:
            check_texts(texts)
        except ValueError as error:
            raise ServiceError(400, str(error), param="input", code="invalid_input") from None
        parts, total = [], 0
        for start in range(0, len(texts), TOKENIZE_CHUNK):  # a turn per chunk: others' requests interleave
            async with self.tokenizing.turn(caller):
                try:  # in a worker thread: the event loop must not wait on the tokenizer
                    part = await asyncio.to_thread(self.client.model.tokens, texts[start:start + TOKENIZE_CHUNK])
                except ValueError as error:
                    raise ServiceError(400, f"{error} (counted from input {start})", param="input",
                                       code="invalid_input") from None
            parts.append(part)
            total += sum(part.counts)
            if total > self.max_request_tokens:  # refused as soon as it is known, untokenized rest and all
                raise ServiceError(400, f"the request holds more than the {self.max_request_tokens} tokens allowed "
                                        f"per request ({total} in its first {start + len(part)} inputs); split it",
                                   param="input", code="max_tokens_per_request")
        tokens = Tokens.join(parts)
        max_length = self.client.model.max_length
        too_long = tokens.longer_than(max_length)
        if too_long and not self.truncate:
            raise ServiceError(400, f"inputs {too_long[:10]} exceed the model's maximum of {max_length} tokens "
                                    "(start the gateway with --truncate to cut them instead)",
                               param="input", code="context_length_exceeded")
        return tokens

    async def encode(self, tokens: Tokens, caller: str, principal: str) -> Encoded:
        client = self.client
        try:
            # "count": cut texts are reported in the x-privlm-truncated header, not as a warning
            call = await asyncio.to_thread(client.begin, tokens, principal=principal, truncation="count")
        except (ServerError, RequestRefusedError) as error:
            raise _upstream_failure(error) from None
        try:
            vectors = np.empty((len(tokens), client.model.hidden_size), dtype=np.float32)
            for indices in call.batches:  # one turn per batch: other callers' batches interleave
                async with self.scheduler.turn(caller):
                    vectors[indices] = await asyncio.to_thread(client.encode_batch, call, indices)
        except (ServerError, RequestRefusedError) as error:
            # Charged, and batches may have reached the server (the client already retried what it safely could):
            # an SDK's retry would be a new release and a new charge.
            failure = _upstream_failure(error)
            failure.headers = {**(failure.headers or {}), "x-should-retry": "false"}
            raise failure from None
        return Encoded(vectors, call.report)
