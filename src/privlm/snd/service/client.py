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
from privlm.service import RetryPolicy, ServerError, download_bundle
from privlm.snd.encoder import LOCAL_PRINCIPAL, Encoded, SnDEncoder
from privlm.snd.privatizer import PrivateBatch
from privlm.snd.service.bundle import BUNDLE_PATH, bundle_embedder, choose_denoiser
from privlm.wire import RAW, SAFETENSORS, WIRE_DTYPES, WireDType, WireError, WireFormat, read_rows, write_sequences

ENCODE_PATH = "/v1/snd/encode"


def _auth(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


class Client(SnDEncoder):
    """Private sentence embeddings from a remote SnD server; ``encode`` like sentence-transformers."""

    def __init__(self, base_url: str, *, eta: float, denoiser: str | None = "auto", api_key: str | None = None,
                 cache_dir: str | Path | None = None, timeout: float = 30.0, retries: int = 5, backoff: float = 0.25,
                 dtype: WireDType = "float32", wire_format: WireFormat = SAFETENSORS, batch_size: int = 32,
                 truncation: TruncationPolicy = "warn", generator: torch.Generator | None = None,
                 device: str | torch.device = "auto", transport: httpx.BaseTransport | None = None,
                 ledger: Ledger | None = None) -> None:
        # Every setting is checked before anything is downloaded.
        eta = check_positive_finite("eta", eta)
        check_positive_int("batch_size", batch_size)
        self.dtype = check_choice("dtype", dtype, WIRE_DTYPES)
        self.wire_format = check_choice("wire_format", wire_format, (SAFETENSORS, RAW))
        self.retry = RetryPolicy(retries=retries, backoff=backoff)
        self.http = httpx.Client(base_url=base_url, timeout=timeout, headers=_auth(api_key), transport=transport)
        self.manifest = self.retry.call(lambda: self.http.get(BUNDLE_PATH)).json()
        folder = download_bundle(self.manifest, self._fetch, Path(cache_dir) if cache_dir else privlm_cache_dir(),
                                 namespace="snd-bundles")
        super().__init__(bundle_embedder(folder, device=device), eta=eta,
                         denoiser=choose_denoiser(self.manifest, folder, eta, denoiser), batch_size=batch_size,
                         truncation=truncation, generator=generator, server=self._remote, ledger=ledger)

    def _fetch(self, name: str) -> bytes:
        return self.retry.call(lambda: self.http.get(f"{BUNDLE_PATH}/files/{name}")).content

    def _remote(self, noisy: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        body, headers = write_sequences(noisy, attention_mask, dtype=self.dtype, fmt=self.wire_format)
        response = self.retry.call(lambda: self.http.post(ENCODE_PATH, content=body, headers=headers))
        return _answer(response)

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _answer(response: httpx.Response) -> torch.Tensor:
    try:
        return read_rows(response.content, response.headers)
    except WireError as error:
        raise ServerError(str(error)) from error


class AsyncClient:
    """The async twin of ``Client``: the bundle is fetched once at construction; ``await encode(texts)``
    privatizes and denoises locally and sends the batches concurrently (at most ``max_concurrency``)."""

    def __init__(self, base_url: str, *, eta: float, max_concurrency: int = 4, timeout: float = 30.0,
                 api_key: str | None = None, transport: httpx.AsyncBaseTransport | None = None,
                 cache_dir: str | Path | None = None, retries: int = 5, backoff: float = 0.25,
                 dtype: WireDType = "float32", wire_format: WireFormat = SAFETENSORS, batch_size: int = 32,
                 denoiser: str | None = "auto", truncation: TruncationPolicy = "warn",
                 generator: torch.Generator | None = None, device: str | torch.device = "auto",
                 ledger: Ledger | None = None) -> None:
        self.local = Client(base_url, eta=eta, timeout=timeout, api_key=api_key, cache_dir=cache_dir, retries=retries,
                            backoff=backoff, dtype=dtype, wire_format=wire_format, batch_size=batch_size,
                            denoiser=denoiser, truncation=truncation, generator=generator, device=device,
                            ledger=ledger)
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
        return _answer(response).to(private.noisy.device)

    async def encode_with_report(self, texts: Iterable[str] | Tokens, *, batch_size: int | None = None,
                                 principal: str = LOCAL_PRINCIPAL) -> Encoded:
        """The embeddings and this call's report; batches travel concurrently."""
        local = self.local
        # Tokenizing and the ledger's transaction block: they run in a worker thread, not on the event loop.
        call = await asyncio.to_thread(local.begin, texts, batch_size=batch_size, principal=principal)
        privates = [local.privatize(call.tokens.subset(b), generator=call.generator) for b in call.batches]
        answers = await asyncio.gather(*(self._release(p) for p in privates))
        call.report.server_calls += len(answers) if local.needs_server else 0
        out = np.empty((len(call.tokens), local.model.hidden_size), dtype=np.float32)
        for indices, private, e_n in zip(call.batches, privates, answers, strict=True):
            out[indices] = local.denoise(private, e_n).float().cpu().numpy()
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
