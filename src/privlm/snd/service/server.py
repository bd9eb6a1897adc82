"""``privlm serve``: the vendor's SnD server. It receives noisy token embeddings, never text or ids.

POST /v1/snd/encode      privatized token embeddings + mask in, pooled embeddings out
GET  /v1/snd/bundle      what a client needs, with sha256 per file; files under /v1/snd/bundle/files/
GET  /health, /v1/models, /metrics (Prometheus text)
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import torch
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import Response
from prometheus_client import Histogram

from privlm.models import SplitModel
from privlm.service import BearerKeys, MicroBatcher, create_service_app
from privlm.snd.artefacts import default_denoiser_dir
from privlm.snd.service.bundle import BUNDLE_PATH, snd_bundle
from privlm.wire import RAW, SAFETENSORS, Limits, read_sequences, write_rows

_BINARY_BODY = {"requestBody": {"required": True, "content": {
    SAFETENSORS: {"schema": {"type": "string", "format": "binary"}},
    RAW: {"schema": {"type": "string", "format": "binary"}}}}}


def create_app(model: SplitModel, *, denoiser_dirs: Sequence[Path] | None = None, api_keys: Sequence[str] = (),
               limits: Limits | None = None, max_batch_rows: int = 64, max_wait_ms: float = 5.0) -> FastAPI:
    """The server for ``model``. Bearer ``api_keys`` (if any) guard every endpoint but /health."""
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

    @router.get("/v1/models")
    async def models() -> dict[str, object]:
        return {"object": "list", "data": [{"id": model.name, "object": "model", "owned_by": "privlm",
                                            "dim": model.hidden_size}]}

    @router.post("/v1/snd/encode", openapi_extra=_BINARY_BODY, response_class=Response)
    async def encode(request: Request) -> Response:
        """Pooled embeddings (B, d) of privatized token embeddings (B, n, d), in the request's dtype and format."""
        sequences = read_sequences(await request.body(), request.headers, limits)
        pooled = await batcher.submit(sequences.embeddings, sequences.attention_mask)
        content, headers = write_rows(pooled, dtype=sequences.dtype, fmt=sequences.format)
        return Response(content, headers=headers)

    app = create_service_app(title="privlm SnD server", routers=[router, bundle.router(BUNDLE_PATH)],
                             auth=BearerKeys(api_keys), max_request_bytes=limits.max_request_bytes,
                             health=lambda: {"model": model.name, "fingerprint": model.fingerprint},
                             lifespan=lifespan)
    rows = Histogram("privlm_batch_rows", "Sentences per forward pass", registry=app.state.metrics.registry,
                     buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256))
    batcher.on_batch = rows.observe
    return app
