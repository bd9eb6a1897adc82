"""``privlm serve``: the vendor's SnD server. It receives noisy token embeddings, never text or ids.

POST /v1/snd/encode      privatized token embeddings + mask in, pooled embeddings out
GET  /v1/snd/bundle      what a client needs, with sha256 per file; files under /v1/snd/bundle/files/
GET  /health, /v1/models, /metrics (Prometheus text)
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import torch
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest

from privlm.models import SplitModel
from privlm.serve.batching import MicroBatcher
from privlm.serve.bundle import build_bundle
from privlm.serve.wire import RAW, SAFETENSORS, Limits, WireError, decode_raw_request, decode_safetensors_request
from privlm.serve.wire import encode_embeddings as encode_answer
from privlm.snd.artefacts import default_denoiser_dir


def error_response(status: int, message: str, *, kind: str = "invalid_request_error",
                   limit: str | None = None) -> JSONResponse:
    return JSONResponse(status_code=status, content={"error": {"message": message, "type": kind, "limit": limit}})


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("privlm_requests", "Requests by endpoint and status", ["endpoint", "status"],
                                registry=self.registry)
        self.latency = Histogram("privlm_request_seconds", "Request latency", ["endpoint"], registry=self.registry)
        self.batch_rows = Histogram("privlm_batch_rows", "Sentences per forward pass", registry=self.registry,
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256))


def create_app(model: SplitModel, *, denoiser_dirs: Sequence[Path] | None = None, api_keys: Sequence[str] = (),
               limits: Limits | None = None, max_batch_rows: int = 64, max_wait_ms: float = 5.0) -> FastAPI:
    """The server for ``model``. Bearer ``api_keys`` (if any) guard every endpoint but /health."""
    if denoiser_dirs is None:
        default = default_denoiser_dir(str(model.name))
        denoiser_dirs = [default] if (default / "denoiser.json").exists() else []
    limits = limits or Limits(dim=model.hidden_size, max_tokens=model.max_length)
    manifest, files = build_bundle(model, denoiser_dirs)
    metrics = Metrics()

    @torch.inference_mode()
    def forward(embeddings: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return model.encode(embeddings, mask).float().cpu()

    batcher = MicroBatcher(forward, max_rows=max_batch_rows, max_wait_ms=max_wait_ms,
                           on_batch=metrics.batch_rows.observe)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        await batcher.start()
        yield
        await batcher.stop()

    app = FastAPI(title="privlm SnD server", version="1", lifespan=lifespan)
    keys = frozenset(api_keys)

    async def authorised(request: Request) -> None:
        if keys and request.headers.get("authorization", "").removeprefix("Bearer ").strip() not in keys:
            raise _UnauthorisedError

    @app.exception_handler(_UnauthorisedError)
    async def unauthorised(_: Request, __: Exception) -> JSONResponse:
        return error_response(401, "missing or invalid API key (Authorization: Bearer <key>)",
                              kind="authentication_error")

    @app.get("/health")
    async def health() -> dict[str, object]:
        return {"status": "ok", "model": model.name, "fingerprint": model.fingerprint}

    @app.get("/v1/models", dependencies=[Depends(authorised)])
    async def models() -> dict[str, object]:
        return {"object": "list", "data": [{"id": model.name, "object": "model", "owned_by": "privlm",
                                            "dim": model.hidden_size}]}

    @app.get("/metrics", dependencies=[Depends(authorised)])
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/snd/bundle", dependencies=[Depends(authorised)])
    async def bundle() -> dict[str, object]:
        return manifest

    @app.get("/v1/snd/bundle/files/{name:path}", dependencies=[Depends(authorised)])
    async def bundle_file(name: str) -> Response:
        if name not in files:
            return error_response(404, f"no bundle file {name!r}", kind="not_found_error")
        return Response(files[name].content, media_type="application/octet-stream",
                        headers={"x-privlm-sha256": files[name].sha256})

    @app.post("/v1/snd/encode", dependencies=[Depends(authorised)],
              openapi_extra={"requestBody": {"required": True, "content": {
                  SAFETENSORS: {"schema": {"type": "string", "format": "binary"}},
                  RAW: {"schema": {"type": "string", "format": "binary"}}}}})
    async def encode(request: Request) -> Response:
        started = time.perf_counter()
        response = await _encode(request)
        metrics.requests.labels("encode", str(response.status_code)).inc()
        metrics.latency.labels("encode").observe(time.perf_counter() - started)
        return response

    async def _encode(request: Request) -> Response:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limits.max_request_bytes:
            return error_response(413, f"request of {declared} bytes exceeds max_request_bytes="
                                       f"{limits.max_request_bytes}", limit="max_request_bytes")
        content_type = request.headers.get("content-type", "").split(";")[0].strip()
        if content_type not in (SAFETENSORS, RAW):
            return error_response(415, f"content-type must be {SAFETENSORS} or {RAW}, got {content_type!r}",
                                  limit="content-type")
        body = await request.body()
        try:
            if content_type == SAFETENSORS:
                decoded = decode_safetensors_request(body, limits)
            else:
                headers = request.headers
                decoded = decode_raw_request(body, dtype=headers.get("x-privlm-dtype"),
                                             shape=headers.get("x-privlm-shape"),
                                             lengths=headers.get("x-privlm-lengths"), limits=limits)
        except WireError as error:
            return error_response(error.status, str(error), limit=error.limit)
        pooled = await batcher.submit(decoded.embeddings, decoded.attention_mask)
        content, headers = encode_answer(pooled, dtype=decoded.dtype, fmt=content_type)
        return Response(content, headers=headers)

    return app


class _UnauthorisedError(Exception):
    pass
