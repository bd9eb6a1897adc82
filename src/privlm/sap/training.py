"""Driving a whole SAP fine-tuning run over a transport: train for some epochs, pick the epoch on validation.

:func:`fit` is the one training loop, whatever the customer's transport: in this process (:func:`connect` sets
both parties up; :func:`fine_tune`) or over HTTP (:meth:`privlm.sap.Client.fit`). The customer's held-out
validation texts choose the epoch; test texts, when given, are only scored (at every epoch, so the chosen epoch's
test accuracy can be read off without selecting anything on them). Validation and test texts are privatized once
per bottom state: once for a frozen bottom (a reused release costs nothing), once per epoch for a trainable one.

Resuming. The vendor keeps its state at every epoch's end (the epoch is chosen at the end of the run). A vendor
that restarts resumes from its last checkpoint, whose step the transport reports (:class:`VendorBehindError`
when it lost steps); the loop keeps the customer's own state at that step (:meth:`Customer.state`) and rewinds to
it, then replays the steps from there: the same batches, and for a trainable bottom the same releases, resent as
they were (kept since the checkpoint, ``Customer.keep_releases``), charged once; the noise generator is never
rewound, so no noise is used twice.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from privlm.accounting import Ledger
from privlm.sap.config import FitOptions, SapConfig
from privlm.sap.cti import CtiReport
from privlm.sap.customer import (
    Customer,
    CustomerState,
    PrivacyAccount,
    TokenizedTexts,
    check_every_class_present,
    check_labels,
)
from privlm.sap.messages import PrivatizedBatch
from privlm.sap.model import SplitParts
from privlm.sap.transport import InProcessTransport, Observer, Traffic, VendorBehindError
from privlm.sap.vendor import Vendor

MAX_REWINDS_WITHOUT_PROGRESS = 3


@dataclass
class Parties:
    customer: Customer
    vendor: Vendor
    transport: InProcessTransport


def connect(parts: SplitParts, *, config: SapConfig, n_classes: int, observer: Observer | None = None,
            ledger: Ledger | None = None, principal: str = "customer") -> Parties:
    """A vendor holding ``parts.top`` and a customer holding ``parts.bottom``, talking in-process."""
    if parts.bottom.config.fingerprint != parts.top.bottom_fingerprint:
        raise ValueError(f"this bottom ({parts.bottom.config.fingerprint[:12]}…) is not the one the vendor's top was "
                         f"split from ({parts.top.bottom_fingerprint[:12]}…)")
    if config.blocks != parts.bottom.depth:
        raise ValueError(f"config.blocks is {config.blocks} but the bottom has {parts.bottom.depth} blocks")
    head = parts.top.head
    if (head is not None) != (config.head == "vendor"):
        raise ValueError(f"config.head is {config.head!r} but the top {'has' if head is not None else 'has no'} head")
    if head is not None and head.out_features != n_classes:
        raise ValueError(f"n_classes is {n_classes} but the vendor's head has {head.out_features} classes")
    vendor = Vendor(parts.top, lora=config.lora, learning_rate=config.learning_rate,
                    send_cut_gradient=config.trainable_bottom, seed=config.seed)
    transport = InProcessTransport(vendor, observer=observer)
    customer = Customer(parts.bottom, parts.tokenizer, transport, config=config, n_classes=n_classes, ledger=ledger,
                        principal=principal, vendor_fingerprint=parts.top.bottom_fingerprint)
    return Parties(customer=customer, vendor=vendor, transport=transport)


@dataclass
class EpochRecord:
    epoch: int
    train_loss: float
    validation_accuracy: float
    test_accuracy: float | None


@dataclass
class FitResult:
    """What a fine-tuning run achieved and cost, in this process or over HTTP (``traffic`` and ``account`` as the
    run left them: the customer's own go on counting what it sends after, its predictions)."""

    epochs: list[EpochRecord]
    best_epoch: int  # 1-based, chosen on validation accuracy (first of ties)
    steps: int
    traffic: Traffic
    wall_seconds: float
    vendor_seconds: float  # in this process the vendor's compute; over HTTP the round trips the customer waited on
    account: PrivacyAccount
    cti: CtiReport | None
    truncated: dict[str, int] = field(default_factory=dict)
    stopped_early: bool = False  # validation stopped improving for ``patience`` epochs
    rewinds: int = 0  # times the vendor restarted from a checkpoint and the customer replayed steps

    @property
    def best(self) -> EpochRecord:
        return self.epochs[self.best_epoch - 1]

    @property
    def customer_seconds(self) -> float:
        """Wall time not spent waiting on the vendor: the customer's compute (and, in process, the transport)."""
        return self.wall_seconds - self.vendor_seconds

    def to_dict(self, *, vocabulary: Sequence[str] | None = None) -> dict[str, Any]:
        """Plain JSON values; with ``vocabulary`` (token strings by id) the CTI report names its tokens."""
        return {"epochs": [vars(e) for e in self.epochs], "best_epoch": self.best_epoch,
                "stopped_early": self.stopped_early, "steps": self.steps, "rewinds": self.rewinds,
                "validation_accuracy": self.best.validation_accuracy, "test_accuracy": self.best.test_accuracy,
                "traffic": self.traffic.to_dict(), "bytes_per_step": self.bytes_per_step(),
                "wall_seconds": self.wall_seconds, "vendor_seconds": self.vendor_seconds,
                "customer_seconds": self.customer_seconds, "privacy": self.account.to_dict(),
                "cti": None if self.cti is None else self.cti.to_dict(vocabulary=vocabulary),
                "truncated": self.truncated}

    def bytes_per_step(self) -> float:
        """Payload bytes both ways of the training steps (forward passes, outputs, gradients) per step; a frozen
        bottom's one-off upload and the inference traffic are in ``traffic.by_purpose``."""
        return self.traffic.bytes_for("training") / max(self.steps, 1)


class Schedule:
    """Which examples each training step takes: one permutation per epoch from ``seed``, in batches. Fixed up
    front, so a step can be replayed (a rewind after a vendor restart) with exactly its batch."""

    def __init__(self, n_examples: int, *, batch_size: int, epochs: int, seed: int) -> None:
        order = np.random.default_rng(seed)
        self.steps_per_epoch = -(-n_examples // batch_size)
        self.epochs = epochs
        self._batches = [permutation[first:first + batch_size].tolist()
                         for permutation in (order.permutation(n_examples) for _ in range(epochs))
                         for first in range(0, n_examples, batch_size)]

    @property
    def total_steps(self) -> int:
        return len(self._batches)

    def batch(self, step: int) -> list[int]:
        return self._batches[step]

    def ends_epoch(self, step: int) -> bool:
        """Whether ``step`` (counted from 0) is the last of its epoch."""
        return (step + 1) % self.steps_per_epoch == 0


def _accuracy(probabilities: torch.Tensor, labels: torch.Tensor) -> float:
    return float((probabilities.argmax(dim=-1) == labels).float().mean())


class HeldOut:
    """Validation or test texts and their release, refreshed only when the bottom changes."""

    def __init__(self, customer: Customer, texts: Sequence[str], labels: object, n_classes: int) -> None:
        self.customer = customer
        self.tokens = customer.tokenize(texts)
        self.labels = check_labels(labels, n=len(self.tokens), n_classes=n_classes)  # type: ignore[arg-type]
        self.released: list[PrivatizedBatch] | None = None
        self.released_at = -1  # the training step the release was made at

    def accuracy(self) -> float:
        """Released once for a frozen bottom; for a trainable one, once per step it is scored at (a step replayed
        after a rewind reuses its release: the bottom is the same, so nothing new is released or charged)."""
        stale = self.customer.config.trainable_bottom and self.released_at != self.customer.step
        if self.released is None or stale:
            self.released = self.customer.release_for_inference(self.tokens)
            self.released_at = self.customer.step
        return _accuracy(self.customer.predict(self.tokens, released=self.released), self.labels)


class _Run:
    """One call of :func:`fit`: the losses by step, the epochs scored, the customer's states kept (at the best
    epoch so far, to choose it; at the vendor's last checkpoint, to rewind to)."""

    def __init__(self, customer: Customer, train: TokenizedTexts, labels: torch.Tensor, validation: HeldOut,
                 test: HeldOut | None) -> None:
        config = customer.config
        self.customer, self.transport = customer, customer.transport
        self.train, self.labels, self.validation, self.test = train, labels, validation, test
        self.schedule = Schedule(len(train), batch_size=config.batch_size, epochs=config.epochs, seed=config.seed)
        self.first = customer.step  # the schedule's step 0: a customer may be trained again
        self.losses: dict[int, float] = {}  # by step: a replayed step counts once
        self.records: list[EpochRecord] = []
        self.kept: dict[int, tuple[int, CustomerState]] = {}  # the best epoch so far: its last step, the state then
        self.resumable: dict[int, CustomerState] = {}
        self.rewinds = self.stalled = 0  # stalled: rewinds since the loop last got past the furthest step refused
        self.furthest_refused = -1
        self._remember_if_checkpointed()

    @property
    def done(self) -> int:
        return self.customer.step - self.first

    def advance(self, patience: int | None) -> bool:
        """One training step and, at an epoch's end, its scores; whether ``patience`` ran out."""
        step = self.done
        try:
            self.losses[step] = self.customer.train_step(self.train, self.labels, self.schedule.batch(step))
            self._remember_if_checkpointed()
            if not self.schedule.ends_epoch(step):
                return False
            epoch, best = self._end_epoch(), self.best()
        except VendorBehindError as error:
            self._rewind(error, step)
            return False
        return patience is not None and epoch - best.epoch >= patience

    def _end_epoch(self) -> int:
        """Score the epoch just ended; the vendor keeps its state, and the customer its own if it is the best."""
        per_epoch, step = self.schedule.steps_per_epoch, self.done
        epoch = step // per_epoch
        del self.records[epoch - 1:]  # a rewind past an epoch's end scores it again
        self.records.append(EpochRecord(
            epoch=epoch, train_loss=float(np.mean([self.losses[s] for s in range(step - per_epoch, step)])),
            validation_accuracy=self.validation.accuracy(),
            test_accuracy=None if self.test is None else self.test.accuracy()))
        self.transport.keep(self.customer.step)
        state = self.customer.state()
        self._remember_if_checkpointed(state)
        if self.best().epoch == epoch:
            self.kept = {epoch: (self.customer.step, state)}
        return epoch

    def best(self) -> EpochRecord:
        return max(self.records, key=lambda r: (r.validation_accuracy, -r.epoch))

    def _remember_if_checkpointed(self, state: CustomerState | None = None) -> None:
        """The vendor checkpointed at this step: it resumes from there at worst, so older state can go."""
        step = self.customer.step
        if self.transport.checkpoint_step != step:
            return
        self.resumable = {step: state if state is not None else self.customer.state()}
        self.customer.sent_releases = {s: r for s, r in self.customer.sent_releases.items() if s >= step}

    def _rewind(self, error: VendorBehindError, step: int) -> None:
        """The vendor restarted from its last checkpoint: back to the customer's state there, to replay."""
        resumed = self.transport.resumed_at()
        state = self.resumable.get(resumed)
        if state is None:
            raise VendorBehindError(f"the vendor resumed at step {resumed}, but this customer holds its own state "
                                    f"only at step(s) {sorted(self.resumable)}: cannot resume") from error
        self.customer.load_state(state)
        self.rewinds += 1
        self.stalled = self.stalled + 1 if step <= self.furthest_refused else 1
        self.furthest_refused = max(self.furthest_refused, step)
        if self.stalled > MAX_REWINDS_WITHOUT_PROGRESS:
            raise VendorBehindError(f"the vendor sent this customer back {self.stalled} times without it getting past "
                                    f"step {self.furthest_refused} (last: {error}); giving up") from error

    def choose(self) -> EpochRecord:
        """Both parties back to the best epoch's state (the customer's step count goes on)."""
        best = self.best()
        step, state = self.kept[best.epoch]
        self.transport.select(step)
        taken = self.customer.step
        self.customer.load_state(state)
        self.customer.step, self.customer.sent_releases = taken, {}
        return best


def fit(customer: Customer, train_texts: Sequence[str], train_labels: Sequence[int] | np.ndarray,
        validation_texts: Sequence[str], validation_labels: Sequence[int] | np.ndarray, *,
        options: FitOptions | None = None) -> FitResult:
    """Train for ``config.epochs`` epochs (fewer when validation accuracy has not improved for ``options.patience``
    epochs), over the customer's transport; score validation (and ``options``' test set) after each; both parties
    are left in the epoch best on validation (the vendor serves its adapter)."""
    from rich.progress import Progress

    options = options or FitOptions()
    start, config = time.perf_counter(), customer.config
    train = customer.tokenize(train_texts)
    labels = check_labels(train_labels, n=len(train), n_classes=customer.n_classes)
    check_every_class_present(labels, customer.n_classes)
    cti = customer.identify_contributing_tokens(train, labels)
    validation = HeldOut(customer, validation_texts, validation_labels, customer.n_classes)
    test = None if options.test_texts is None else HeldOut(customer, options.test_texts, options.test_labels,
                                                            customer.n_classes)
    if not config.trainable_bottom:
        customer.upload(train)
    run = _Run(customer, train, labels, validation, test)
    with Progress(disable=not options.progress, transient=True) as bar:
        task = bar.add_task("SAP fine-tuning", total=run.schedule.total_steps)
        while run.done < run.schedule.total_steps and not run.advance(options.patience):
            bar.update(task, completed=run.done)
    best = run.choose()
    truncated = {"train": train.truncated, "validation": validation.tokens.truncated}
    if test is not None:
        truncated["test"] = test.tokens.truncated
    traffic = customer.transport.traffic
    return FitResult(epochs=run.records, best_epoch=best.epoch, steps=customer.step, traffic=copy.deepcopy(traffic),
                     wall_seconds=time.perf_counter() - start, vendor_seconds=traffic.vendor_seconds,
                     account=copy.deepcopy(customer.account), cti=cti, truncated=truncated,
                     stopped_early=len(run.records) < config.epochs, rewinds=run.rewinds)


def fine_tune(parties: Parties, train_texts: Sequence[str], train_labels: Sequence[int] | np.ndarray,
              validation_texts: Sequence[str], validation_labels: Sequence[int] | np.ndarray, *,
              options: FitOptions | None = None) -> FitResult:
    """:func:`fit` for parties :func:`connect` made in this process."""
    return fit(parties.customer, train_texts, train_labels, validation_texts, validation_labels, options=options)
