"""``privlm.sap.Client``: the customer's side of SAP over HTTP.

It downloads the bottom for its split position (sha256 per file, the fingerprint checked), opens a session, and
runs :class:`privlm.sap.Customer` against the vendor through :class:`HttpTransport`: CTI, the privatizer, the
labels and (with ``head="customer"``) the head stay here. ``fit`` runs SAP's one training loop
(:func:`privlm.sap.training.fit`) over that transport and returns its :class:`privlm.sap.FitResult`.

Resuming. Every exchange is idempotent (a retried gradient is answered from the vendor's record of the last step,
never applied twice), so a dropped connection is retried with back-off. When the vendor restarts it resumes the
session from its last checkpoint, whose step comes with every answer: the transport reports a vendor that lost
steps as :class:`privlm.sap.transport.VendorBehindError`, and the training loop rewinds and replays.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import torch
from pydantic import BaseModel
from safetensors.torch import load as load_safetensors

from privlm.accounting import Ledger
from privlm.models.device import resolve_device
from privlm.sap.config import FitOptions, SapConfig
from privlm.sap.customer import Customer
from privlm.sap.messages import CustomerMessage, Forward, OutputGradient, VendorMessage, from_bytes, to_bytes
from privlm.sap.service.bundle import is_bottom_bundle_file, load_bottom_bundle
from privlm.sap.service.wire import (
    CHECKPOINT_STEP_HEADER,
    MULTIPLEX_HEADER,
    SAP_MESSAGE,
    SESSIONS_PATH,
    STEPS_DONE_HEADER,
    BottomManifest,
    CheckpointRequest,
    SelectRequest,
    SessionInfo,
    SessionRequest,
    bundle_path,
)
from privlm.sap.training import FitResult, fit
from privlm.sap.transport import Traffic, VendorBehindError, purpose_of
from privlm.service import RequestRefusedError, RetryPolicy, ServerError
from privlm.service.bundle import MAX_BUNDLE_BYTES
from privlm.service.sdk import ClosesHttp, fetch_bundle, open_http, read_answer
from privlm.wire import read_safetensors_metadata


class HttpTransport:
    """The :class:`privlm.sap.Transport` over HTTP: each message is POSTed to the session's exchange route, the
    epochs are kept and selected through its checkpoint and select routes."""

    def __init__(self, http: httpx.Client, session: SessionInfo, retry: RetryPolicy, *,
                 max_answer_bytes: int = 256 * 2**20) -> None:
        self.http, self.retry = http, retry
        self.path = f"{SESSIONS_PATH}/{session.id}"
        self.max_answer_bytes = max_answer_bytes
        self.traffic = Traffic()
        self.steps_done = session.steps_done
        self.checkpoint_step: int | None = session.checkpoint_step

    def exchange(self, message: CustomerMessage) -> VendorMessage:
        body = to_bytes(message)
        start = time.perf_counter()
        try:
            response = self.retry.call(lambda: vendor_answer(self.http.post(
                f"{self.path}/exchange", content=body, headers={"content-type": SAP_MESSAGE})))
        except RequestRefusedError as error:  # out of step (a step it never saw, no step in flight): it restarted
            if error.status == 409 and isinstance(message, Forward | OutputGradient):
                raise VendorBehindError(str(error)) from error
            raise
        self.traffic.vendor_seconds += time.perf_counter() - start  # the round trip, as the customer waits for it
        self.traffic.count(purpose_of(message), to_vendor=len(body), to_customer=len(response.content))
        self.steps_done = _int_header(response, STEPS_DONE_HEADER)
        self.checkpoint_step = _int_header(response, CHECKPOINT_STEP_HEADER)
        expected = message.step + 1 if isinstance(message, OutputGradient) else \
            message.step if isinstance(message, Forward) else None
        if expected is not None and self.steps_done < expected:  # it restarted and lost steps: do not use this answer
            raise VendorBehindError(f"the vendor's session is at step {self.steps_done}, behind this customer")
        try:
            reply = from_bytes(response.content, max_bytes=self.max_answer_bytes)
        except ValueError as error:
            raise ServerError(f"the vendor's answer is not a SAP message: {error}") from error
        return reply  # type: ignore[return-value]

    def _post(self, route: str, request: BaseModel) -> SessionInfo:
        return read_answer(SessionInfo, self.retry.call(lambda: vendor_answer(
            self.http.post(f"{self.path}{route}", json=request.model_dump()))))

    def keep(self, step: int) -> None:
        info = self._post("/checkpoint", CheckpointRequest(keep=True))
        if info.steps_done != step:
            raise VendorBehindError(f"the vendor's session is at step {info.steps_done}, not at {step}")
        self.checkpoint_step = info.checkpoint_step

    def select(self, step: int) -> None:
        self._post("/select", SelectRequest(step=step))

    def resumed_at(self) -> int:
        return self.info().steps_done

    def info(self) -> SessionInfo:
        return read_answer(SessionInfo, self.retry.call(lambda: vendor_answer(self.http.get(self.path))))


def vendor_answer(response: httpx.Response) -> httpx.Response:
    """The response, unless it is a 404 without the vendor's error body: that comes from something in front of the
    vendor that does not know the route yet (Ray Serve's proxy while the application restarts), so it is made a
    503, which the retry policy waits out. The vendor's own 404s (a session that does not exist) stay final."""
    if response.status_code == 404:
        try:
            ours = isinstance(response.json().get("error"), dict)
        except (ValueError, AttributeError):
            ours = False
        if not ours:
            return httpx.Response(503, request=response.request, text="the vendor's route is not ready")
    return response


def _int_header(response: httpx.Response, name: str) -> int:
    value = response.headers.get(name, "")
    if not value.isdigit():
        raise ServerError(f"the vendor's answer lacks a numeric {name} header")
    return int(value)


@dataclass(frozen=True, kw_only=True)
class ClientOptions:
    """The SAP client's rarely-set knobs. ``timeout``: per request, in seconds; ``retry_for`` and ``backoff``: how
    long, and how, a failed request is retried (:class:`~privlm.service.RetryPolicy`); ``max_bundle_bytes``: the
    largest bottom bundle downloaded; ``transport``: httpx's (an in-process app, say); ``ledger`` and
    ``principal``: where, and under which name, the customer's privacy spend is charged."""

    timeout: float = 120.0
    retry_for: float = 120.0
    backoff: float = 0.25
    max_bundle_bytes: int = MAX_BUNDLE_BYTES
    transport: httpx.BaseTransport | None = None
    ledger: Ledger | None = None
    principal: str = "customer"


class Client(ClosesHttp):
    """The customer: its data, labels, privatizer and (optionally) head, against a remote vendor."""

    def __init__(self, base_url: str, *, config: SapConfig, n_classes: int, api_key: str | None = None,
                 cache_dir: str | Path | None = None, device: str | torch.device = "auto",
                 options: ClientOptions | None = None) -> None:
        self.config = config
        options = options or ClientOptions()
        resolved = resolve_device(device)  # checked before anything is downloaded
        self.retry = RetryPolicy(retry_for=options.retry_for, backoff=options.backoff)
        self.http = open_http(base_url, api_key=api_key, timeout=options.timeout, transport=options.transport)
        self.manifest, folder = fetch_bundle(self.http, bundle_path(config.blocks), BottomManifest, self.retry,
                                             cache_dir=cache_dir, namespace="sap-bottoms",
                                             allowed=is_bottom_bundle_file, max_bytes=options.max_bundle_bytes)
        bottom, tokenizer = load_bottom_bundle(folder, self.manifest.fingerprint)
        self.session = self._open_session(SessionRequest.for_config(config, n_classes=n_classes,
                                                                    bottom_fingerprint=self.manifest.fingerprint))
        self.session_id = self.session.id
        # On Ray Serve, requests that carry it go to the replica that holds the session (multiplexing by id).
        self.http.headers[MULTIPLEX_HEADER] = self.session_id
        self.transport = HttpTransport(self.http, self.session, self.retry)
        self.customer = Customer(bottom.to(resolved), tokenizer, self.transport, config=config,
                                 n_classes=n_classes, ledger=options.ledger, principal=options.principal,
                                 vendor_fingerprint=self.manifest.fingerprint)
        self.customer.keep_releases = True  # a rewind resends them

    def _open_session(self, request: SessionRequest) -> SessionInfo:
        # Not idempotent: a resent request could open two sessions.
        return read_answer(SessionInfo, self.retry.call(
            lambda: self.http.post(SESSIONS_PATH, json=request.model_dump()), idempotent=False))

    def fit(self, train_texts: Sequence[str], train_labels: Sequence[int] | np.ndarray,
            validation_texts: Sequence[str], validation_labels: Sequence[int] | np.ndarray, *,
            test_texts: Sequence[str] | None = None, test_labels: Sequence[int] | np.ndarray | None = None,
            patience: int | None = None, progress: bool = True) -> FitResult:
        """:func:`privlm.sap.training.fit` against this vendor: it then serves the adapter of the epoch best on
        validation, and the head here is that epoch's too. A vendor this customer cannot resume with is a
        :class:`ServerError`, as every other failure of the vendor."""
        try:
            return fit(self.customer, train_texts, train_labels, validation_texts, validation_labels,
                       options=FitOptions(test_texts=test_texts, test_labels=test_labels, patience=patience,
                                          progress=progress))
        except VendorBehindError as error:
            raise ServerError(str(error)) from error

    # --- after training -----------------------------------------------------------------------------------
    def predict(self, texts: Sequence[str]) -> torch.Tensor:
        """Class probabilities (n, C): privatized here (charged), the top at the vendor, the head here if held."""
        return self.customer.predict(self.customer.tokenize(texts))

    def adapter(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The trained adapter the vendor serves (LoRA, and the head when it sits there), and its settings."""
        data = self.retry.call(lambda: vendor_answer(self.http.get(f"{self.transport.path}/adapter"))).content
        return load_safetensors(data), json.loads(read_safetensors_metadata(data)["facts"])

    def delete(self) -> None:
        self.retry.call(lambda: self.http.delete(self.transport.path))
