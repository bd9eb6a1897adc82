"""``privlm.sap.Client``: the customer's side of SAP over HTTP.

It downloads the bottom for its split position (sha256 per file, the fingerprint checked), opens a session, and
runs :class:`privlm.sap.Customer` against the vendor through :class:`HttpTransport`: CTI, the privatizer, the
labels and (with ``head="customer"``) the head stay here. ``fit`` drives the training loop with validation on the
customer's own held-out data, early stopping and a progress bar, and returns a report of what it cost.

Resuming. Every exchange is idempotent (a retried gradient is answered from the vendor's record of the last step,
never applied twice), so a dropped connection is retried with back-off. When the vendor restarts it resumes the
session from its last checkpoint, whose step comes with every answer; the client keeps its own state at that step
(:meth:`privlm.sap.Customer.state`) and, on finding the vendor behind, rewinds to it and replays the steps from
there: the same batches, and for a trainable bottom the same releases, resent as they were (kept since the
checkpoint), charged once; the noise generator is never rewound, so no noise is used twice.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import torch
from safetensors.torch import load as load_safetensors

from privlm.accounting import Ledger
from privlm.models.sources import cache_dir as privlm_cache_dir
from privlm.sap.config import SapConfig
from privlm.sap.customer import Customer, CustomerState, check_every_class_present, check_labels
from privlm.sap.messages import CustomerMessage, Forward, OutputGradient, VendorMessage, from_bytes, to_bytes
from privlm.sap.service.bundle import bundle_path, is_bottom_bundle_file, load_bottom_bundle
from privlm.sap.service.routes import MULTIPLEX_HEADER, SAP_MESSAGE, SESSIONS_PATH
from privlm.sap.training import EpochRecord, Schedule
from privlm.sap.transport import Traffic, purpose_of
from privlm.service import RequestRefusedError, RetryPolicy, ServerError, download_bundle, get_capped
from privlm.service.bundle import MANIFEST_LIMIT, MAX_BUNDLE_BYTES

MAX_REWINDS_WITHOUT_PROGRESS = 3


class VendorBehindError(RuntimeError):
    """The vendor's session is behind this customer (it restarted from a checkpoint): rewind and replay."""

    def __init__(self, steps_done: int) -> None:
        super().__init__(f"the vendor's session is at step {steps_done}, behind this customer")
        self.steps_done = steps_done


class HttpTransport:
    """The :class:`privlm.sap.Transport` over HTTP: each message is POSTed to the session's exchange route."""

    def __init__(self, http: httpx.Client, session_id: str, retry: RetryPolicy, *,
                 max_answer_bytes: int = 256 * 2**20) -> None:
        self.http, self.session_id, self.retry = http, session_id, retry
        self.max_answer_bytes = max_answer_bytes
        self.traffic = Traffic()
        self.steps_done = 0
        self.checkpoint_step = 0

    def exchange(self, message: CustomerMessage) -> VendorMessage:
        body = to_bytes(message)
        path = f"{SESSIONS_PATH}/{self.session_id}/exchange"
        start = time.perf_counter()
        response = self.retry.call(lambda: vendor_answer(self.http.post(path, content=body,
                                                                        headers={"content-type": SAP_MESSAGE})))
        self.traffic.vendor_seconds += time.perf_counter() - start  # the round trip, as the customer waits for it
        self.traffic.count(purpose_of(message), to_vendor=len(body), to_customer=len(response.content))
        self.steps_done = _int_header(response, "x-privlm-steps-done")
        self.checkpoint_step = _int_header(response, "x-privlm-checkpoint-step")
        expected = message.step + 1 if isinstance(message, OutputGradient) else \
            message.step if isinstance(message, Forward) else None
        if expected is not None and self.steps_done < expected:  # it restarted and lost steps: do not use this answer
            raise VendorBehindError(self.steps_done)
        try:
            reply = from_bytes(response.content, max_bytes=self.max_answer_bytes)
        except ValueError as error:
            raise ServerError(f"the vendor's answer is not a SAP message: {error}") from error
        return reply  # type: ignore[return-value]


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


@dataclass
class FitReport:
    """What a remote fine-tuning run achieved and cost."""

    epochs: list[EpochRecord]
    best_epoch: int
    stopped_early: bool
    steps: int
    rewinds: int
    validation_accuracy: float
    account: dict[str, Any]
    traffic: dict[str, Any]
    seconds: float
    wait_seconds: float
    cti: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"epochs": [vars(e) for e in self.epochs], "best_epoch": self.best_epoch,
                "stopped_early": self.stopped_early, "steps": self.steps, "rewinds": self.rewinds,
                "validation_accuracy": self.validation_accuracy, "account": self.account, "traffic": self.traffic,
                "seconds": self.seconds, "wait_seconds": self.wait_seconds, "cti": self.cti}


class Client:
    """The customer: its data, labels, privatizer and (optionally) head, against a remote vendor."""

    def __init__(self, base_url: str, *, config: SapConfig, n_classes: int, api_key: str | None = None,
                 cache_dir: str | Path | None = None, timeout: float = 120.0, retry_for: float = 120.0,
                 backoff: float = 0.25, ledger: Ledger | None = None, principal: str = "customer",
                 transport: httpx.BaseTransport | None = None, max_bundle_bytes: int = MAX_BUNDLE_BYTES) -> None:
        self.config = config
        self.retry = RetryPolicy(retry_for=retry_for, backoff=backoff)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=base_url, timeout=timeout, headers=headers, transport=transport)
        prefix = bundle_path(config.blocks)
        self.manifest = get_capped(self.http, prefix, MANIFEST_LIMIT, self.retry).json()
        fingerprint = self.manifest.get("fingerprint") if isinstance(self.manifest, dict) else None
        if not isinstance(fingerprint, str):
            raise ServerError("the bottom bundle's manifest names no fingerprint")
        folder = download_bundle(self.manifest, lambda name, size: get_capped(
            self.http, f"{prefix}/files/{name}", size, self.retry).content,
            Path(cache_dir) if cache_dir else privlm_cache_dir(), namespace="sap-bottoms",
            allowed=is_bottom_bundle_file, max_bytes=max_bundle_bytes)
        bottom, tokenizer = load_bottom_bundle(folder, fingerprint)
        self.session = self._open_session(fingerprint, n_classes)
        self.session_id = str(self.session["id"])
        # On Ray Serve, requests that carry it go to the replica that holds the session (multiplexing by id).
        self.http.headers[MULTIPLEX_HEADER] = self.session_id
        self.transport = HttpTransport(self.http, self.session_id, self.retry)
        self.customer = Customer(bottom, tokenizer, self.transport, config=config, n_classes=n_classes,
                                 ledger=ledger, principal=principal, vendor_fingerprint=fingerprint)
        self.customer.keep_releases = True  # a rewind resends them
        self._states: dict[int, CustomerState] = {0: self.customer.state()}  # the vendor checkpoints at creation
        self.rewinds = 0

    def _open_session(self, fingerprint: str, n_classes: int) -> dict[str, Any]:
        config = self.config
        request = {"blocks": config.blocks, "n_classes": n_classes, "head": config.head,
                   "trainable_bottom": config.trainable_bottom, "learning_rate": config.learning_rate,
                   "seed": config.seed, "bottom_fingerprint": fingerprint,
                   "lora": {"rank": config.lora.rank, "alpha": config.lora.alpha, "dropout": config.lora.dropout,
                            "target_modules": list(config.lora.target_modules)}}
        # Not idempotent: a resent request could open two sessions.
        response = self.retry.call(lambda: self.http.post(SESSIONS_PATH, json=request), idempotent=False)
        return dict(response.json())

    def _post(self, path: str, payload: dict[str, Any]) -> dict[str, Any]:
        response = self.retry.call(lambda: vendor_answer(
            self.http.post(f"{SESSIONS_PATH}/{self.session_id}{path}", json=payload)))
        return dict(response.json())

    def info(self) -> dict[str, Any]:
        response = self.retry.call(lambda: vendor_answer(self.http.get(f"{SESSIONS_PATH}/{self.session_id}")))
        return dict(response.json())

    # --- training -----------------------------------------------------------------------------------------
    def _step(self, train: Any, labels: torch.Tensor, schedule: Schedule) -> float:
        """One training step, and the customer's state remembered when the vendor checkpointed after it."""
        loss = self.customer.train_step(train, labels, schedule.batch(self.customer.step))
        if self.transport.checkpoint_step == self.customer.step:
            self._remember(self.customer.step, self.customer.state())
        return loss

    def _keep_epoch(self) -> CustomerState:
        """Have the vendor keep a checkpoint at this epoch's end; the customer's state at that step."""
        info = self._post("/checkpoint", {"keep": True})
        if info.get("steps_done") != self.customer.step:
            raise VendorBehindError(int(info.get("steps_done", 0)))
        state = self.customer.state()
        self._remember(self.customer.step, state)
        return state

    def _remember(self, step: int, state: CustomerState) -> None:
        """The vendor checkpointed at ``step``: it resumes from there at worst, so older state can go."""
        self._states = {step: state}
        self.customer.sent_releases = {s: r for s, r in self.customer.sent_releases.items() if s >= step}

    def _rewind(self) -> None:
        resumed = int(self.info()["steps_done"])
        state = self._states.get(resumed)
        if state is None:
            raise ServerError(f"the vendor resumed the session at step {resumed}, but this client holds its own "
                              f"state only at step(s) {sorted(self._states)}: cannot resume")
        self.customer.load_state(state)
        self.rewinds += 1

    def fit(self, train_texts: Sequence[str], train_labels: Sequence[int] | np.ndarray,
            validation_texts: Sequence[str], validation_labels: Sequence[int] | np.ndarray, *,
            patience: int | None = None, progress: bool = True) -> FitReport:
        """Train for ``config.epochs`` epochs (fewer when validation accuracy has not improved for ``patience``
        epochs); the vendor then serves the adapter of the epoch best on validation, and the head here is that
        epoch's too."""
        from rich.progress import Progress

        from privlm.sap.training import HeldOut

        start, customer, config = time.perf_counter(), self.customer, self.config
        train = customer.tokenize(train_texts)
        labels = check_labels(train_labels, n=len(train), n_classes=customer.n_classes)
        check_every_class_present(labels, customer.n_classes)
        cti = customer.identify_contributing_tokens(train, labels)
        validation = HeldOut(customer, validation_texts, validation_labels, customer.n_classes)
        if not config.trainable_bottom:
            customer.upload(train)
        schedule = Schedule(len(train), batch_size=config.batch_size, epochs=config.epochs, seed=config.seed)
        records: list[EpochRecord] = []
        kept: dict[int, tuple[int, CustomerState]] = {}  # epoch -> (step, the customer's state then)
        losses: dict[int, float] = {}  # by step: a replayed step counts once
        stalled = 0
        with Progress(disable=not progress, transient=True) as bar:
            task = bar.add_task("SAP fine-tuning (remote)", total=schedule.total_steps)
            while customer.step < schedule.total_steps:
                step = customer.step
                try:
                    losses[step] = self._step(train, labels, schedule)
                    bar.update(task, completed=customer.step)
                    if not schedule.ends_epoch(step):
                        continue
                    epoch = (step + 1) // schedule.steps_per_epoch
                    del records[epoch - 1:]  # a rewind past an epoch's end scores it again
                    train_loss = float(np.mean([losses[s] for s in range(step + 1 - schedule.steps_per_epoch,
                                                                          step + 1)]))
                    records.append(EpochRecord(epoch=epoch, train_loss=train_loss,
                                               validation_accuracy=validation.accuracy(), test_accuracy=None))
                    kept[epoch] = (customer.step, self._keep_epoch())
                except (VendorBehindError, RequestRefusedError) as error:
                    if isinstance(error, RequestRefusedError) and error.status != 409:
                        raise
                    self._rewind()  # the vendor restarted from its last checkpoint: replay from there
                    stalled = stalled + 1 if customer.step <= step else 0
                    if stalled > MAX_REWINDS_WITHOUT_PROGRESS:
                        raise ServerError(f"the vendor sent this client back {stalled} times without a step "
                                          f"taken in between (last: {error}); giving up") from error
                    continue
                best = max(records, key=lambda r: (r.validation_accuracy, -r.epoch))
                if patience is not None and epoch - best.epoch >= patience:
                    break
        best = max(records, key=lambda r: (r.validation_accuracy, -r.epoch))
        step, state = kept[best.epoch]
        self._post("/select", {"step": step})
        steps_taken = customer.step
        customer.load_state(state)  # the chosen epoch's head (and bottom) here, as its adapter at the vendor
        customer.step, customer.sent_releases = steps_taken, {}
        return FitReport(epochs=records, best_epoch=best.epoch, stopped_early=len(records) < config.epochs,
                         steps=customer.step, rewinds=self.rewinds, validation_accuracy=best.validation_accuracy,
                         account=customer.account.to_dict(), traffic=self.transport.traffic.to_dict(),
                         seconds=time.perf_counter() - start, wait_seconds=self.transport.traffic.vendor_seconds,
                         cti=None if cti is None else cti.to_dict(
                             vocabulary=customer.tokenizer.convert_ids_to_tokens(list(range(len(customer.tokenizer))))))

    # --- after training -----------------------------------------------------------------------------------
    def predict(self, texts: Sequence[str]) -> torch.Tensor:
        """Class probabilities (n, C): privatized here (charged), the top at the vendor, the head here if held."""
        return self.customer.predict(self.customer.tokenize(texts))

    def adapter(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The trained adapter the vendor serves (LoRA, and the head when it sits there), and its settings."""
        response = self.retry.call(lambda: vendor_answer(
            self.http.get(f"{SESSIONS_PATH}/{self.session_id}/adapter")))
        data = response.content
        header = json.loads(data[8:8 + int.from_bytes(data[:8], "little")])
        return load_safetensors(data), json.loads(header["__metadata__"]["facts"])

    def delete(self) -> None:
        self.retry.call(lambda: self.http.delete(f"{SESSIONS_PATH}/{self.session_id}"))

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
