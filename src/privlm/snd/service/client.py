"""``privlm.snd.Client``: the customer's SDK for a remote ``privlm serve``, and its async twin, in httpx's shape.

:class:`BaseClient` does everything but talk: it checks its settings, reads the bundle's manifest
(:class:`~privlm.snd.service.bundle.SnDManifest`), privatizes and denoises locally, writes each encode request,
checks each answer and decides what a failed call leaves. :class:`Client` sends through an ``httpx.Client``,
:class:`AsyncClient` through an ``httpx.AsyncClient``; both retry through one :class:`privlm.service.RetryPolicy`.
On construction a client checks its settings, then fetches the server's bundle once (tokenizer files,
word-embedding rows, model facts, denoisers), verifies every file against its sha256 and caches it on disk
by hash. Then ``encode(texts)`` privatizes locally, sends only X~ and the mask, and denoises the answer
locally: the same object interface as the in-process ``SnDEncoder``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import torch

from privlm.accounting import Ledger
from privlm.models import Tokens, TruncationPolicy
from privlm.service import RequestRefusedError, RetryPolicy, ServerError
from privlm.service.bundle import MAX_BUNDLE_BYTES
from privlm.service.sdk import ClosesHttp, bearer, fetch_bundle, open_http
from privlm.snd.encoder import LOCAL_PRINCIPAL, BaseEncoder, EncodeCall, Encoded, EncoderOptions, SnDEncoder
from privlm.snd.privatizer import PrivateBatch
from privlm.snd.service.bundle import BUNDLE_PATH, SnDManifest, bundle_embedder, choose_denoiser, is_snd_bundle_file
from privlm.validation import check_choice, check_positive_finite, check_positive_int
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


class ModelChangedError(ServerError):
    """An answer came from other weights than the bundle's: the server now runs another model."""


class IncompleteEncodingError(ServerError):
    """The server failed or refused part-way through a call. Nothing finished is lost: ``encoded.vectors``
    holds the rows of the texts in ``done`` (NaN elsewhere), computed by the weights ``weights_fingerprint``.
    Encode the texts at ``missing`` again to finish, which is a new release (the failed batches may have
    reached the server) — unless the cause is a :class:`ModelChangedError`: rows of two models must not be
    combined, so then encode every text again with a new client."""

    def __init__(self, encoded: Encoded, done: Sequence[int], cause: BaseException, *,
                 weights_fingerprint: str | None = None) -> None:
        self.encoded, self.done, self.weights_fingerprint = encoded, sorted(done), weights_fingerprint
        finished = set(self.done)
        self.missing = [i for i in range(len(encoded.vectors)) if i not in finished]
        advice = ("the server's model changed: encode every text again with a new client (rows of two models must "
                  "not be combined)" if isinstance(cause, ModelChangedError) else
                  "error.encoded holds them, error.missing lists the texts still to encode")
        super().__init__(f"{len(self.done)} of {len(encoded.vectors)} texts were encoded before the server failed "
                         f"({cause}); {advice}")


@dataclass(frozen=True)
class ClientOptions:
    """A client's rarely-set knobs: the HTTP ``timeout`` and retries (:class:`privlm.service.RetryPolicy`:
    ``retry_for``, ``retries``, ``backoff``), the wire's ``dtype`` and ``wire_format``, texts a batch, the
    ``truncation`` policy, the largest bundle downloaded, the batches an :class:`AsyncClient` sends at once
    (``max_concurrency``), the httpx ``transport`` of a :class:`Client` (``async_transport``: an
    :class:`AsyncClient`'s), and the ``ledger`` every call's release is spent in first (its principal's)."""

    timeout: float = 30.0
    retry_for: float = 60.0
    retries: int | None = None
    backoff: float = 0.25
    dtype: WireDType = "float32"
    wire_format: WireFormat = SAFETENSORS
    batch_size: int = 32
    truncation: TruncationPolicy = "warn"
    max_bundle_bytes: int = MAX_BUNDLE_BYTES
    max_concurrency: int = 4
    transport: httpx.BaseTransport | None = None
    async_transport: httpx.AsyncBaseTransport | None = None
    ledger: Ledger | None = None


class BaseClient(BaseEncoder):
    """What both clients share, with no I/O of its own: the checked settings, the bundle's manifest and client half,
    the encode request, the checks on each answer, and what a call that failed part-way leaves. (``fetch_bundle``
    runs on the blocking HTTP client its subclass hands it.)"""

    def __init__(self, *, eta: float, options: ClientOptions) -> None:
        # Every setting is checked before anything is downloaded (the subclass downloads, then calls load_bundle).
        self._eta = check_positive_finite("eta", eta)
        self.options = options
        self.batch_size = check_positive_int("batch_size", options.batch_size)
        self.max_bundle_bytes = check_positive_int("max_bundle_bytes", options.max_bundle_bytes)
        self.dtype = check_choice("dtype", options.dtype, WIRE_DTYPES)
        self.wire_format = check_choice("wire_format", options.wire_format, (SAFETENSORS, RAW))
        self.retry = RetryPolicy(retry_for=options.retry_for, retries=options.retries, backoff=options.backoff)

    def fetch_bundle(self, http: httpx.Client, cache_dir: str | Path | None) -> tuple[SnDManifest, Path]:
        """The manifest and the folder of the bundle, fetched through ``http`` (blocking: a constructor cannot
        await) and cached by hash."""
        return fetch_bundle(http, BUNDLE_PATH, SnDManifest, self.retry, cache_dir=cache_dir,
                            namespace="snd-bundles", allowed=is_snd_bundle_file, max_bytes=self.max_bundle_bytes)

    def load_bundle(self, manifest: SnDManifest, folder: Path, *, denoiser: str | None,
                    generator: torch.Generator | None, device: str | torch.device) -> None:
        """The encoder's own setup, from the downloaded bundle."""
        self.manifest, self.weights_fingerprint = manifest, manifest.model.weights_fingerprint
        BaseEncoder.__init__(self, bundle_embedder(folder, device=device), eta=self._eta,
                             denoiser=choose_denoiser(manifest, folder, self._eta, denoiser), generator=generator,
                             ledger=self.options.ledger, options=EncoderOptions(batch_size=self.batch_size,
                                                                   truncation=self.options.truncation))

    def encode_request(self, private: PrivateBatch) -> tuple[bytes, dict[str, str]]:
        """The body and headers of one encode request: X~ and the mask only. A retry resends the same bytes
        (no new noise, no new release)."""
        return write_sequences(private.noisy, private.attention_mask, dtype=self.dtype, fmt=self.wire_format)

    def check_answer(self, response: httpx.Response, private: PrivateBatch) -> torch.Tensor:
        """e_n for ``private``, if it came from the model of the bundle; else a :class:`ServerError`."""
        served, expected = response.headers.get(MODEL_FINGERPRINT_HEADER), self.weights_fingerprint
        if served != expected:
            raise ModelChangedError(f"the server answered with model weights {str(served)[:16]}..., not the "
                                    f"{expected[:16]}... of the bundle this client loaded (was the "
                                    "server restarted with another model?); refusing to mix two models' outputs: "
                                    "make a new Client")
        try:
            rows = read_rows(response.content, response.headers, rows=len(private.noisy), dim=self.model.hidden_size)
        except WireError as error:
            raise ServerError(f"malformed answer: {error}") from error
        return rows.to(private.noisy.device)

    def finish(self, call: EncodeCall, out: np.ndarray, done: list[int], failures: Sequence[BaseException]) -> Encoded:
        """The call's rows, or an :class:`IncompleteEncodingError` that keeps those that came back (a model
        change named first). A failure that is not the server's is a bug, raised as it is."""
        unexpected = [e for e in failures if not isinstance(e, ServerError | RequestRefusedError)]
        if unexpected:
            raise unexpected[0]
        if failures:
            cause = next((e for e in failures if isinstance(e, ModelChangedError)), failures[0])
            raise IncompleteEncodingError(Encoded(out, call.report), done, cause,
                                          weights_fingerprint=self.weights_fingerprint) from cause
        return Encoded(out, call.report)


class Client(BaseClient, SnDEncoder, ClosesHttp):
    """Private sentence embeddings from a remote SnD server; ``encode`` like sentence-transformers."""

    def __init__(self, base_url: str, *, eta: float, denoiser: str | None = "auto", api_key: str | None = None,
                 cache_dir: str | Path | None = None, device: str | torch.device = "auto",
                 generator: torch.Generator | None = None, options: ClientOptions | None = None) -> None:
        options = options or ClientOptions()
        super().__init__(eta=eta, options=options)
        self.http = open_http(base_url, api_key=api_key, timeout=options.timeout, transport=options.transport)
        self.load_bundle(*self.fetch_bundle(self.http, cache_dir), denoiser=denoiser, generator=generator,
                         device=device)

    def server_encode(self, private: PrivateBatch) -> torch.Tensor:
        body, headers = self.encode_request(private)
        return self.check_answer(self.retry.call(lambda: self.http.post(ENCODE_PATH, content=body, headers=headers)),
                                 private)

    def encode_with_report(self, texts: Iterable[str] | Tokens, *, batch_size: int | None = None,
                           principal: str = LOCAL_PRINCIPAL, truncation: TruncationPolicy | None = None) -> Encoded:
        """As :meth:`SnDEncoder.encode_with_report`; a server failure part-way raises an
        :class:`IncompleteEncodingError` that keeps the finished rows."""
        call = self.begin(texts, batch_size=batch_size, principal=principal, truncation=truncation)
        out, done = self.blank_rows(call), list[int]()
        for indices in call.batches:
            try:
                out[indices] = self.encode_batch(call, indices)
            except (ServerError, RequestRefusedError) as error:
                return self.finish(call, out, done, [error])
            done.extend(indices)
        return self.finish(call, out, done, [])


class AsyncClient(BaseClient):
    """The async twin of ``Client``: the bundle is fetched once at construction; ``await encode(texts)``
    privatizes and denoises locally and sends the batches concurrently (at most ``max_concurrency``)."""

    def __init__(self, base_url: str, *, eta: float, denoiser: str | None = "auto", api_key: str | None = None,
                 cache_dir: str | Path | None = None, device: str | torch.device = "auto",
                 generator: torch.Generator | None = None, options: ClientOptions | None = None) -> None:
        options = options or ClientOptions()
        super().__init__(eta=eta, options=options)
        self.semaphore = asyncio.Semaphore(check_positive_int("max_concurrency", options.max_concurrency))
        with open_http(base_url, api_key=api_key, timeout=options.timeout) as http:
            bundle = self.fetch_bundle(http, cache_dir)
        self.load_bundle(*bundle, denoiser=denoiser, generator=generator, device=device)
        self.http = httpx.AsyncClient(base_url=base_url, timeout=options.timeout, headers=bearer(api_key),
                                      transport=options.async_transport)

    async def _release(self, private: PrivateBatch) -> torch.Tensor:
        if not self.needs_server:
            return self.no_server_answer(private)
        body, headers = self.encode_request(private)
        async with self.semaphore:
            response = await self.retry.acall(lambda: self.http.post(ENCODE_PATH, content=body, headers=headers))
        return self.check_answer(response, private)

    async def encode_with_report(self, texts: Iterable[str] | Tokens, *, batch_size: int | None = None,
                                 principal: str = LOCAL_PRINCIPAL) -> Encoded:
        """The embeddings and this call's report; batches travel concurrently."""
        # Tokenizing and the ledger's transaction block: they run in a worker thread, not on the event loop.
        call = await asyncio.to_thread(self.begin, texts, batch_size=batch_size, principal=principal)
        privates = [self.privatize(call.tokens.subset(b), generator=call.generator) for b in call.batches]
        answers = await asyncio.gather(*(self._release(p) for p in privates), return_exceptions=True)
        call.report.server_calls += len(answers) if self.needs_server else 0
        out, done = self.blank_rows(call), list[int]()
        for indices, private, e_n in zip(call.batches, privates, answers, strict=True):
            if not isinstance(e_n, BaseException):
                out[indices] = self.denoise(private, e_n).float().cpu().numpy()
                done.extend(indices)
        return self.finish(call, out, done, [e for e in answers if isinstance(e, BaseException)])

    async def encode(self, texts: Iterable[str], *, batch_size: int | None = None) -> np.ndarray:
        """(n, d) float32 private sentence embeddings, in the order of ``texts``."""
        return (await self.encode_with_report(texts, batch_size=batch_size)).vectors

    async def aclose(self) -> None:
        await self.http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
