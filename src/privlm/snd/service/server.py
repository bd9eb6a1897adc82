"""``privlm serve``: the vendor's SnD server. It receives noisy token embeddings, never text or ids.

POST /v1/snd/encode      privatized token embeddings + mask in, pooled embeddings out
GET  /v1/snd/bundle      what a client needs, with sha256 per file; files under /v1/snd/bundle/files/
GET  /health, /v1/models, /v1/models/{id}, /metrics (Prometheus text)

Every encode answer carries the weights fingerprint of the model that computed it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Unpack

import torch
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import Response
from prometheus_client import Histogram

from privlm.models import SplitModel
from privlm.service import (
    BearerKeys,
    MicroBatcher,
    ModelEntry,
    ServiceOptions,
    catalog_router,
    create_service_app,
    public_model_name,
)
from privlm.settings.snd import MAX_BATCH_ROWS, MAX_WAIT_MS, SndServeSettings
from privlm.snd.artefacts import default_denoiser_dir
from privlm.snd.service.bundle import BUNDLE_PATH, snd_bundle
from privlm.wire import (
    DTYPE_HEADER,
    LENGTHS_HEADER,
    MODEL_FINGERPRINT_HEADER,
    RAW,
    SAFETENSORS,
    SEQUENCE_HEADER_PATTERNS,
    SHAPE_HEADER,
    Limits,
    WireError,
    read_sequences,
    write_rows,
)

_BINARY = {"schema": {"type": "string", "format": "binary"}}


def _header(name: str, description: str) -> dict[str, object]:
    return {"name": name, "in": "header", "required": True, "description": description,
            "schema": {"type": "string", "pattern": SEQUENCE_HEADER_PATTERNS[name]}}


def _answer_header(description: str, pattern: str, *, required: bool) -> dict[str, object]:
    return {"description": description, "required": required, "schema": {"type": "string", "pattern": pattern}}


# What the encode route really reads and answers. Both body formats travel with the three X-Privlm-*
# headers that declare them; a request without them, or whose body does not match them, is refused with
# a 422. What the schema cannot say: the body's bytes must match the declared dtype and shape.
_ENCODE_OPENAPI: dict[str, object] = {
    "parameters": [
        _header(DTYPE_HEADER, "The embeddings' dtype, float32 or float16 (both body formats; a safetensors "
                              "body's 'embeddings' tensor must have it)."),
        _header(SHAPE_HEADER, "The embeddings' shape 'B,n,d': B sequences of n token vectors of the model's "
                              "dimension d, within the server's max_batch and max_tokens (both body formats; a "
                              "safetensors body's 'embeddings' tensor must have it)."),
        _header(LENGTHS_HEADER, "Each sequence's unpadded length 'l1,...,lB', B entries in [1, n] (both body "
                                "formats; a safetensors body's right-padded 'attention_mask' must match it).")],
    "requestBody": {"required": True, "description": "Safetensors with 'embeddings' (B, n, d) and "
                    "'attention_mask' (B, n), or the raw little-endian (B, n, d) array, as the headers declare.",
                    "content": {SAFETENSORS: _BINARY, RAW: _BINARY}},
    "responses": {"200": {
        "description": "Pooled embeddings (B, d), in the request's format and dtype: safetensors with an "
                       "'embeddings' tensor, or the raw little-endian array that X-Privlm-Dtype and "
                       "X-Privlm-Shape 'B,d' describe.",
        "content": {SAFETENSORS: _BINARY, RAW: _BINARY},
        "headers": {
            MODEL_FINGERPRINT_HEADER: _answer_header("sha256 of the weights that computed the answer",
                                                     "^[0-9a-f]{64}$", required=True),
            DTYPE_HEADER: _answer_header("Raw answers only: the array's dtype", "^(float32|float16)$",
                                         required=False),
            SHAPE_HEADER: _answer_header("Raw answers only: the array's shape 'B,d'", "^[1-9][0-9]*,[1-9][0-9]*$",
                                         required=False)}},
        "422": {"description": "Malformed payload: missing or malformed X-Privlm-* headers, a body that does not "
                               "match them, not finite, wrong shape or dtype, or values so large that the model's "
                               "output is not finite"}}}


def create_app(model: SplitModel, *, denoiser_dirs: Sequence[Path] | None = None, api_keys: Sequence[str] = (),
               limits: Limits | None = None, max_batch_rows: int = MAX_BATCH_ROWS, max_wait_ms: float = MAX_WAIT_MS,
               **service: Unpack[ServiceOptions]) -> FastAPI:
    """The server for ``model``. Bearer ``api_keys`` (if any) guard every endpoint but /health; ``service``
    options (docs, allowed hosts, in-flight cap, body timeout) go to :func:`create_service_app`."""
    if denoiser_dirs is None:
        default = default_denoiser_dir(str(model.name))
        denoiser_dirs = [default] if (default / "denoiser.json").exists() else []
    limits = limits or Limits(dim=model.hidden_size, max_tokens=model.max_length)
    bundle = snd_bundle(model, denoiser_dirs)

    @torch.inference_mode()
    def forward(embeddings: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return model.encode(embeddings, mask).float().cpu()

    batcher = MicroBatcher(forward, max_rows=max_batch_rows, max_wait_ms=max_wait_ms)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await batcher.start()
        yield
        await batcher.stop()

    router = APIRouter(tags=["snd"])
    name, fingerprint = public_model_name(str(model.name)), model.weights_fingerprint
    catalog = catalog_router([ModelEntry(id=name, dim=model.hidden_size, weights_fingerprint=fingerprint)])

    @router.post("/v1/snd/encode", openapi_extra=_ENCODE_OPENAPI, response_class=Response)
    async def encode(request: Request) -> Response:
        """Pooled embeddings (B, d) of privatized token embeddings (B, n, d), in the request's dtype and format.
        The answer names the weights it came from (``x-privlm-model-fingerprint``)."""
        sequences = read_sequences(await request.body(), request.headers, limits)
        pooled = await batcher.submit(sequences.embeddings, sequences.attention_mask)
        if not torch.isfinite(pooled).all():  # finite but huge inputs (1e38, say) overflow inside the model
            raise WireError("the model's output is not finite for these embeddings: their values are too large",
                            limit="finite")
        content, headers = write_rows(pooled, dtype=sequences.dtype, fmt=sequences.format)
        return Response(content, headers=headers | {MODEL_FINGERPRINT_HEADER: fingerprint})

    app = create_service_app(title="privlm SnD server", routers=[router, catalog, bundle.router(BUNDLE_PATH)],
                             auth=BearerKeys(api_keys), max_request_bytes=limits.max_request_bytes,
                             health=lambda: {"model": name, "weights_fingerprint": fingerprint},
                             lifespan=lifespan, **service)
    rows = Histogram("privlm_batch_rows", "Sentences per forward pass", registry=app.state.metrics.registry,
                     buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256))
    batcher.on_batch = rows.observe
    return app


def served_app(model: SplitModel, settings: SndServeSettings, api_keys: Sequence[str]) -> FastAPI:
    """The server as ``privlm snd serve`` builds it from its settings, in this process or in each Ray replica."""
    return create_app(model, denoiser_dirs=[Path(d) for d in settings.denoisers] or None, api_keys=api_keys,
                      max_batch_rows=settings.max_batch_rows, max_wait_ms=settings.max_wait_ms, **settings.options())
