"""Driving a whole SAP fine-tuning run: set both parties up, train for some epochs, pick the epoch on validation.

The customer's held-out validation texts choose the epoch; test texts, when given, are only scored (at every
epoch, so the chosen epoch's test accuracy can be read off without selecting anything on them). Validation and
test texts are privatized once per bottom state: once for a frozen bottom (a reused release costs nothing),
once per epoch for a trainable one.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from privlm.accounting import Ledger
from privlm.sap.config import SapConfig
from privlm.sap.cti import CtiReport
from privlm.sap.customer import Customer, PrivacyAccount, check_every_class_present, check_labels
from privlm.sap.messages import PrivatizedBatch
from privlm.sap.model import SplitParts
from privlm.sap.transport import InProcessTransport, Observer, Traffic
from privlm.sap.vendor import Vendor


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
    epochs: list[EpochRecord]
    best_epoch: int  # 1-based, chosen on validation accuracy (first of ties)
    steps: int
    traffic: Traffic
    wall_seconds: float
    vendor_seconds: float
    account: PrivacyAccount
    cti: CtiReport | None
    truncated: dict[str, int] = field(default_factory=dict)
    adapter_state: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def best(self) -> EpochRecord:
        return self.epochs[self.best_epoch - 1]

    @property
    def customer_seconds(self) -> float:
        """Wall time not spent in the vendor: the customer's compute and the (in-process) transport."""
        return self.wall_seconds - self.vendor_seconds

    def to_dict(self) -> dict[str, Any]:
        return {"epochs": [vars(e) for e in self.epochs], "best_epoch": self.best_epoch, "steps": self.steps,
                "validation_accuracy": self.best.validation_accuracy, "test_accuracy": self.best.test_accuracy,
                "traffic": self.traffic.to_dict(), "bytes_per_step": self.bytes_per_step(),
                "wall_seconds": self.wall_seconds, "vendor_seconds": self.vendor_seconds,
                "customer_seconds": self.customer_seconds, "privacy": self.account.to_dict(),
                "cti": None if self.cti is None else self.cti.to_dict(), "truncated": self.truncated}

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


@dataclass
class _Snapshot:
    """The trained state at the best epoch so far: vendor adapter, customer head and (trainable) bottom."""

    adapter: dict[str, torch.Tensor]
    head: dict[str, torch.Tensor] | None
    bottom: dict[str, torch.Tensor] | None

    @classmethod
    def take(cls, parties: Parties) -> _Snapshot:
        customer = parties.customer

        def copy(module: torch.nn.Module | None) -> dict[str, torch.Tensor] | None:
            return None if module is None else {k: v.detach().clone() for k, v in module.state_dict().items()}
        return cls(adapter=parties.vendor.adapter_state(), head=copy(customer.head),
                   bottom=copy(customer.bottom) if customer.config.trainable_bottom else None)

    def restore(self, parties: Parties) -> None:
        parties.vendor.load_adapter_state(self.adapter)
        if self.head is not None and parties.customer.head is not None:
            parties.customer.head.load_state_dict(self.head)
        if self.bottom is not None:
            parties.customer.bottom.load_state_dict(self.bottom)


def fine_tune(parties: Parties, train_texts: Sequence[str], train_labels: Sequence[int] | np.ndarray,
              validation_texts: Sequence[str], validation_labels: Sequence[int] | np.ndarray, *,
              test_texts: Sequence[str] | None = None, test_labels: Sequence[int] | np.ndarray | None = None,
              progress: bool = False) -> FitResult:
    """Train for ``config.epochs`` epochs; score validation (and test) after each; keep the epoch best on validation
    (both parties are left in that epoch's state)."""
    from rich.progress import Progress

    customer, config = parties.customer, parties.customer.config
    start = time.perf_counter()
    train = customer.tokenize(train_texts)
    labels = check_labels(train_labels, n=len(train), n_classes=customer.n_classes)
    check_every_class_present(labels, customer.n_classes)
    cti = customer.identify_contributing_tokens(train, labels)
    validation = HeldOut(customer, validation_texts, validation_labels, customer.n_classes)
    test = None if test_texts is None else HeldOut(customer, test_texts, test_labels, customer.n_classes)
    if not config.trainable_bottom:
        customer.upload(train)
    schedule = Schedule(len(train), batch_size=config.batch_size, epochs=config.epochs, seed=config.seed)
    records: list[EpochRecord] = []
    best: _Snapshot | None = None
    losses: list[float] = []
    with Progress(disable=not progress, transient=True) as bar:
        task = bar.add_task("SAP fine-tuning", total=schedule.total_steps)
        for step in range(schedule.total_steps):
            losses.append(customer.train_step(train, labels, schedule.batch(step)))
            bar.advance(task)
            if not schedule.ends_epoch(step):
                continue
            records.append(EpochRecord(epoch=len(records) + 1, train_loss=float(np.mean(losses)),
                                       validation_accuracy=validation.accuracy(),
                                       test_accuracy=None if test is None else test.accuracy()))
            losses = []
            if best is None or records[-1].validation_accuracy > max(r.validation_accuracy for r in records[:-1]):
                best = _Snapshot.take(parties)
    chosen = max(records, key=lambda r: (r.validation_accuracy, -r.epoch)).epoch
    assert best is not None
    best.restore(parties)
    truncated = {"train": train.truncated, "validation": validation.tokens.truncated}
    if test is not None:
        truncated["test"] = test.tokens.truncated
    return FitResult(epochs=records, best_epoch=chosen, steps=customer.step, traffic=parties.transport.traffic,
                     wall_seconds=time.perf_counter() - start, vendor_seconds=parties.transport.traffic.vendor_seconds,
                     account=customer.account, cti=cti, truncated=truncated, adapter_state=best.adapter)
