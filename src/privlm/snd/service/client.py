"""``privlm.snd.Client``: the customer's SDK for a remote ``privlm serve``, and its async twin.

On construction it checks its own settings, then fetches the server's bundle once (tokenizer files,
word-embedding rows, model facts, denoisers), verifies every file against its sha256 and caches it on
disk by hash. Then ``encode(texts)`` privatizes locally, sends only X~ and the mask, and denoises the
answer locally: the same object interface as the in-process ``SnDEncoder``. Both clients retry through
one :class:`privlm.service.RetryPolicy`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from pathlib import Path

import httpx
import numpy as np
import torch

from privlm._validation import check_choice, check_positive_finite, check_positive_int
from privlm.accounting import Ledger
from privlm.models import Tokens, TruncationPolicy
from privlm.models.sources import cache_dir as privlm_cache_dir
from privlm.service import RequestRefusedError, RetryPolicy, ServerError, download_bundle, get_capped
from privlm.service.bundle import MANIFEST_LIMIT, MAX_BUNDLE_BYTES
from privlm.snd.encoder import LOCAL_PRINCIPAL, Encoded, IncompleteEncodingError, ModelChangedError, SnDEncoder
from privlm.snd.privatizer import PrivateBatch
from privlm.snd.service.bundle import BUNDLE_PATH, bundle_embedder, choose_denoiser, is_snd_bundle_file
from privlm.wire import (
    MODEL_FINGERPRINT_HEADER,
    RAW,
    SAFETENSORS,
    WIRE_DTYPES,
    WireDType,
    WireError,
    WireFormat,
    read_rows,
    write_sequences,
)

ENCODE_PATH = "/v1/snd/encode"


def _auth(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


class Client(SnDEncoder):
    """Private sentence embeddings from a remote SnD server; ``encode`` like sentence-transformers."""

    def __init__(self, base_url: str, *, eta: float, denoiser: str | None = "auto", api_key: str | None = None,
                 cache_dir: str | Path | None = None, timeout: float = 30.0, retry_for: float = 60.0,
                 retries: int | None = None, backoff: float = 0.25,
                 dtype: WireDType = "float32", wire_format: WireFormat = SAFETENSORS, batch_size: int = 32,
                 truncation: TruncationPolicy = "warn", generator: torch.Generator | None = None,
                 device: str | torch.device = "auto", transport: httpx.BaseTransport | None = None,
                 ledger: Ledger | None = None, max_bundle_bytes: int = MAX_BUNDLE_BYTES) -> None:
        # Every setting is checked before anything is downloaded.
        eta = check_positive_finite("eta", eta)
        check_positive_int("batch_size", batch_size)
        check_positive_int("max_bundle_bytes", max_bundle_bytes)
        self.dtype = check_choice("dtype", dtype, WIRE_DTYPES)
        self.wire_format = check_choice("wire_format", wire_format, (SAFETENSORS, RAW))
        self.retry = RetryPolicy(retry_for=retry_for, retries=retries, backoff=backoff)
        self.http = httpx.Client(base_url=base_url, timeout=timeout, headers=_auth(api_key), transport=transport)
        # Every bundle answer is read with a size cap: an endless body is refused, not buffered.
        self.manifest = _json(get_capped(self.http, BUNDLE_PATH, MANIFEST_LIMIT, self.retry))
        self.weights_fingerprint = _weights_fingerprint(self.manifest)
        folder = download_bundle(self.manifest, self._fetch, Path(cache_dir) if cache_dir else privlm_cache_dir(),
                                 namespace="snd-bundles", allowed=is_snd_bundle_file, max_bytes=max_bundle_bytes)
        super().__init__(bundle_embedder(folder, device=device), eta=eta,
                         denoiser=choose_denoiser(self.manifest, folder, eta, denoiser), batch_size=batch_size,
                         truncation=truncation, generator=generator, server=self._remote, ledger=ledger)

    def _fetch(self, name: str, size: int) -> bytes:
        return get_capped(self.http, f"{BUNDLE_PATH}/files/{name}", size, self.retry).content

    def _remote(self, noisy: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        # Idempotent: a retry resends the same noisy bytes (no new noise, no new release).
        body, headers = write_sequences(noisy, attention_mask, dtype=self.dtype, fmt=self.wire_format)
        response = self.retry.call(lambda: self.http.post(ENCODE_PATH, content=body, headers=headers))
        return self.check_answer(response, rows=len(noisy))

    def check_answer(self, response: httpx.Response, *, rows: int) -> torch.Tensor:
        """The (rows, d) answer, if it came from the model of the bundle; else a :class:`ServerError`."""
        served, expected = response.headers.get(MODEL_FINGERPRINT_HEADER), str(self.weights_fingerprint)
        if served != expected:
            raise ModelChangedError(f"the server answered with model weights {str(served)[:16]}..., not the "
                                    f"{expected[:16]}... of the bundle this client loaded (was the "
                                    "server restarted with another model?); refusing to mix two models' outputs: "
                                    "make a new Client")
        try:
            return read_rows(response.content, response.headers, rows=rows, dim=self.model.hidden_size)
        except WireError as error:
            raise ServerError(f"malformed answer: {error}") from error

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _json(response: httpx.Response) -> dict[str, object]:
    try:
        manifest = response.json()
    except ValueError as error:
        raise ServerError("the bundle manifest is not JSON") from error
    if not isinstance(manifest, dict):
        raise ServerError("the bundle manifest is not a JSON object")
    return manifest


def _weights_fingerprint(manifest: dict[str, object]) -> str:
    facts = manifest.get("model")
    fingerprint = facts.get("weights_fingerprint") if isinstance(facts, dict) else None
    if not isinstance(fingerprint, str) or len(fingerprint) != 64:
        raise ServerError("the bundle manifest names no weights fingerprint (a server older than this client?)")
    return fingerprint


class AsyncClient:
    """The async twin of ``Client``: the bundle is fetched once at construction; ``await encode(texts)``
    privatizes and denoises locally and sends the batches concurrently (at most ``max_concurrency``)."""

    def __init__(self, base_url: str, *, eta: float, max_concurrency: int = 4, timeout: float = 30.0,
                 api_key: str | None = None, transport: httpx.AsyncBaseTransport | None = None,
                 cache_dir: str | Path | None = None, retry_for: float = 60.0, retries: int | None = None,
                 backoff: float = 0.25,
                 dtype: WireDType = "float32", wire_format: WireFormat = SAFETENSORS, batch_size: int = 32,
                 denoiser: str | None = "auto", truncation: TruncationPolicy = "warn",
                 generator: torch.Generator | None = None, device: str | torch.device = "auto",
                 ledger: Ledger | None = None) -> None:
        self.local = Client(base_url, eta=eta, timeout=timeout, api_key=api_key, cache_dir=cache_dir,
                            retry_for=retry_for, retries=retries, backoff=backoff, dtype=dtype,
                            wire_format=wire_format, batch_size=batch_size, denoiser=denoiser, truncation=truncation,
                            generator=generator, device=device, ledger=ledger)
        self.http = httpx.AsyncClient(base_url=base_url, timeout=timeout, headers=_auth(api_key), transport=transport)
        self.semaphore = asyncio.Semaphore(check_positive_int("max_concurrency", max_concurrency))

    async def _release(self, private: PrivateBatch) -> torch.Tensor:
        local = self.local
        if not local.needs_server:
            return local.no_server_answer(private)
        body, headers = write_sequences(private.noisy, private.attention_mask, dtype=local.dtype,
                                        fmt=local.wire_format)
        async with self.semaphore:
            response = await local.retry.acall(lambda: self.http.post(ENCODE_PATH, content=body, headers=headers))
        return local.check_answer(response, rows=len(private.noisy)).to(private.noisy.device)

    async def encode_with_report(self, texts: Iterable[str] | Tokens, *, batch_size: int | None = None,
                                 principal: str = LOCAL_PRINCIPAL) -> Encoded:
        """The embeddings and this call's report; batches travel concurrently."""
        local = self.local
        # Tokenizing and the ledger's transaction block: they run in a worker thread, not on the event loop.
        call = await asyncio.to_thread(local.begin, texts, batch_size=batch_size, principal=principal)
        privates = [local.privatize(call.tokens.subset(b), generator=call.generator) for b in call.batches]
        answers = await asyncio.gather(*(self._release(p) for p in privates), return_exceptions=True)
        call.report.server_calls += len(answers) if local.needs_server else 0
        out = np.full((len(call.tokens), local.model.hidden_size), np.nan, dtype=np.float32)
        done: list[int] = []
        for indices, private, e_n in zip(call.batches, privates, answers, strict=True):
            if not isinstance(e_n, BaseException):
                out[indices] = local.denoise(private, e_n).float().cpu().numpy()
                done.extend(indices)
        failures = [e for e in answers if isinstance(e, BaseException)]
        unexpected = [e for e in failures if not isinstance(e, ServerError | RequestRefusedError)]
        if unexpected:  # a bug, not the server: raise it as it is
            raise unexpected[0]
        if failures:  # the batches that came back are kept; a model change is named first
            cause = next((e for e in failures if isinstance(e, ModelChangedError)), failures[0])
            raise IncompleteEncodingError(Encoded(out, call.report), done, cause,
                                          weights_fingerprint=local.weights_fingerprint) from cause
        return Encoded(out, call.report)

    async def encode(self, texts: Iterable[str], *, batch_size: int | None = None) -> np.ndarray:
        """(n, d) float32 private sentence embeddings, in the order of ``texts``."""
        return (await self.encode_with_report(texts, batch_size=batch_size)).vectors

    async def aclose(self) -> None:
        await self.http.aclose()
        self.local.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
