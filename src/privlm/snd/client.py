"""``privlm.snd.Client``: the customer's SDK for a remote ``privlm serve``.

On construction it fetches the server's bundle once (tokenizer files, word-embedding rows, model
facts, denoisers), verifies every file against its sha256 and caches it on disk by hash. Then
``encode(texts)`` privatizes locally, sends only X~ and the mask, and denoises the answer
locally: the same object interface as the in-process ``SnDEncoder``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

from privlm.models import TokenEmbedder
from privlm.models.batching import length_sorted_batches
from privlm.models.sources import cache_dir as privlm_cache_dir
from privlm.serve.wire import SAFETENSORS, WireError, decode_embeddings, encode_request
from privlm.snd.encoder import SnDEncoder

RETRY_STATUSES = frozenset({429, 502, 503, 504})


class ServerError(RuntimeError):
    """The server failed, or stayed unreachable through every retry."""


def _auth(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def final_response(response: httpx.Response) -> httpx.Response | None:
    """The response if it is final; None if it should be retried. 4xx raise ValueError, 5xx ServerError."""
    if response.status_code in RETRY_STATUSES:
        return None
    if 400 <= response.status_code < 500:
        try:
            message = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = response.text[:200]
        raise ValueError(f"server refused the request ({response.status_code}): {message}")
    if response.status_code >= 500:
        raise ServerError(f"server error {response.status_code}: {response.text[:200]}")
    return response


class Retrying:
    """Exponential back-off on connection errors and on 429/502/503/504."""

    def __init__(self, *, retries: int, backoff: float, max_backoff: float = 8.0) -> None:
        self.retries, self.backoff, self.max_backoff = retries, backoff, max_backoff
        self.failed_attempts = 0  # connection errors and busy answers seen so far (all retried or raised)
        self.last_failure: Exception | None = None

    def delay(self, attempt: int) -> float:
        return min(self.max_backoff, self.backoff * 2**attempt)

    def settle(self, outcome: httpx.Response | httpx.TransportError) -> httpx.Response | None:
        """The final response, or None after recording a failure worth retrying."""
        if isinstance(outcome, httpx.Response) and (response := final_response(outcome)) is not None:
            return response
        self.last_failure = outcome if isinstance(outcome, Exception) else ServerError("server busy (429/502/503/504)")
        self.failed_attempts += 1
        return None

    def exhausted(self) -> ServerError:
        error = ServerError(f"no answer after {self.retries + 1} attempts: {self.last_failure}")
        error.__cause__ = self.last_failure
        return error

    def call(self, send: Callable[[], httpx.Response]) -> httpx.Response:
        for attempt in range(self.retries + 1):
            try:
                outcome: httpx.Response | httpx.TransportError = send()
            except httpx.TransportError as error:
                outcome = error
            if (response := self.settle(outcome)) is not None:
                return response
            if attempt < self.retries:
                time.sleep(self.delay(attempt))
        raise self.exhausted()


def download_bundle(manifest: dict, fetch: Callable[[str], bytes], cache: Path) -> Path:
    """Every listed file, verified against its sha256; reused from ``cache`` when already there."""
    folder = cache / "snd-bundles" / hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()[:20]
    for entry in manifest["files"]:
        target = folder / entry["name"]
        if target.exists() and hashlib.sha256(target.read_bytes()).hexdigest() == entry["sha256"]:
            continue
        content = fetch(entry["url"])
        if hashlib.sha256(content).hexdigest() != entry["sha256"]:
            raise ServerError(f"bundle file {entry['name']} does not match its sha256; refusing it")
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(target.suffix + ".part")
        partial.write_bytes(content)
        os.replace(partial, target)
    return folder


def bundle_embedder(folder: Path, *, device: str | torch.device = "auto") -> TokenEmbedder:
    """The client half from a downloaded bundle, checked against the advertised fingerprint."""
    facts = json.loads((folder / "model.json").read_text())
    embedder = TokenEmbedder(AutoTokenizer.from_pretrained(folder / "tokenizer"),
                             load_file(str(folder / "embeddings.safetensors"))["embeddings"],
                             config=facts["config"], max_length=facts["max_length"], normalize=facts["normalize"],
                             name=facts["name"], device=device)
    if embedder.fingerprint != facts["fingerprint"]:
        raise ServerError("the bundle's embedding rows do not match the model fingerprint it advertises")
    return embedder


def choose_denoiser(manifest: dict, folder: Path, eta: float, denoiser: str | None) -> Path | None:
    """``auto``: the SnD denoiser whose eta range holds eta (else the first, with a warning)."""
    if denoiser is None:
        return None
    offered = manifest["denoisers"]
    if denoiser != "auto":
        if denoiser not in {d["name"] for d in offered}:
            raise ValueError(f"server offers denoisers {[d['name'] for d in offered]}, not {denoiser!r}")
        return folder / "denoisers" / denoiser
    snd = [d for d in offered if d["variant"] == "snd"]
    if not snd:
        raise ValueError("the server offers no SnD denoiser; pass denoiser=None to use e_n as it comes")
    fitting = [d for d in snd if d["eta_range"][0] <= eta <= d["eta_range"][1]]
    return folder / "denoisers" / (fitting or snd)[0]["name"]


class Client(SnDEncoder):
    """Private sentence embeddings from a remote SnD server; ``encode`` like sentence-transformers."""

    def __init__(self, base_url: str, *, eta: float, denoiser: str | None = "auto", api_key: str | None = None,
                 cache_dir: str | Path | None = None, timeout: float = 30.0, retries: int = 5, backoff: float = 0.25,
                 dtype: str = "float32", wire_format: str = SAFETENSORS, batch_size: int = 32,
                 truncation: str = "warn", generator: torch.Generator | None = None,
                 device: str | torch.device = "auto", transport: httpx.BaseTransport | None = None) -> None:
        self.http = httpx.Client(base_url=base_url, timeout=timeout, headers=_auth(api_key), transport=transport)
        self.retrying = Retrying(retries=retries, backoff=backoff)
        self.dtype, self.wire_format = dtype, wire_format
        self.manifest = self.retrying.call(lambda: self.http.get("/v1/snd/bundle")).json()
        folder = download_bundle(self.manifest, self._fetch, Path(cache_dir) if cache_dir else privlm_cache_dir())
        embedder = bundle_embedder(folder, device=device)
        super().__init__(embedder, eta=eta, denoiser=choose_denoiser(self.manifest, folder, eta, denoiser),
                         batch_size=batch_size, truncation=truncation, generator=generator, server=self._remote)

    def _fetch(self, url: str) -> bytes:
        return self.retrying.call(lambda: self.http.get(url)).content

    def _remote(self, noisy: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        body, headers = encode_request(noisy, attention_mask, dtype=self.dtype, fmt=self.wire_format)
        response = self.retrying.call(lambda: self.http.post("/v1/snd/encode", content=body, headers=headers))
        try:
            return decode_embeddings(response.content, dict(response.headers))
        except WireError as error:
            raise ServerError(str(error)) from error

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient:
    """The async twin of ``Client``: the bundle is fetched once at construction, ``await encode(texts)``
    privatizes and denoises locally and sends the batches concurrently (at most ``max_concurrency``)."""

    def __init__(self, base_url: str, *, eta: float, max_concurrency: int = 4, timeout: float = 30.0,
                 api_key: str | None = None, transport: httpx.AsyncBaseTransport | None = None,
                 **client_options: object) -> None:
        self.local = Client(base_url, eta=eta, timeout=timeout, api_key=api_key, **client_options)  # type: ignore[arg-type]
        self.http = httpx.AsyncClient(base_url=base_url, timeout=timeout, headers=_auth(api_key), transport=transport)
        self.semaphore = asyncio.Semaphore(max_concurrency)

    @property
    def last_report(self) -> object:
        return self.local.last_report

    async def _post(self, body: bytes, headers: dict[str, str]) -> httpx.Response:
        retrying = self.local.retrying
        for attempt in range(retrying.retries + 1):
            try:
                outcome: httpx.Response | httpx.TransportError = await self.http.post(
                    "/v1/snd/encode", content=body, headers=headers)
            except httpx.TransportError as error:
                outcome = error
            if (response := retrying.settle(outcome)) is not None:
                return response
            if attempt < retrying.retries:
                await asyncio.sleep(retrying.delay(attempt))
        raise retrying.exhausted()

    async def _encode_batch(self, texts: list[str]) -> np.ndarray:
        local = self.local
        private = local.privatize(texts, truncation="count")
        local._count(private)
        body, headers = encode_request(private.noisy, private.attention_mask, dtype=local.dtype,
                                       fmt=local.wire_format)
        async with self.semaphore:
            response = await self._post(body, headers)
        local.last_report.server_calls += 1
        e_n = decode_embeddings(response.content, dict(response.headers)).to(private.noisy.device)
        with torch.inference_mode():
            return local.denoise(private, e_n).float().cpu().numpy()

    async def encode(self, texts: list[str], *, batch_size: int | None = None) -> np.ndarray:
        """(n, d) float32 private sentence embeddings, in the order of ``texts``."""
        texts = self.local.prepare(texts)
        batches = list(length_sorted_batches(texts, batch_size or self.local.batch_size))
        results = await asyncio.gather(*(self._encode_batch([texts[i] for i in b]) for b in batches))
        out = np.empty((len(texts), self.local.model.hidden_size), dtype=np.float32)
        for indices, rows in zip(batches, results, strict=True):
            out[indices] = rows
        return out

    async def aclose(self) -> None:
        await self.http.aclose()
        self.local.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
