"""How the two parties talk: a transport carries one customer message to the vendor and its answer back, and
asks the vendor to keep (and later to serve) its trained state at an epoch's end.

:class:`InProcessTransport` is the library's (tests, benchmarks): every message goes through its bytes
(``messages.to_bytes``/``from_bytes``, safetensors), so the parties share no tensor and the byte counts are the
real payload sizes. ``privlm.sap.service.client.HttpTransport`` implements the same protocol over HTTP, and
:func:`privlm.sap.training.fit` drives either.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch

from privlm.sap.messages import CustomerMessage, Forward, Upload, VendorMessage, from_bytes, to_bytes
from privlm.sap.vendor import Vendor


class VendorBehindError(RuntimeError):
    """The vendor lost steps (it restarted from its last checkpoint): the customer rewinds to that step and
    replays; raised out of the training loop when it cannot."""


class Transport(Protocol):
    """The vendor as the customer reaches it."""

    traffic: Traffic

    @property
    def checkpoint_step(self) -> int | None:
        """The step of the vendor's last checkpoint, where a restart would take it back to; None for a vendor
        that never loses a step (in this process)."""

    def exchange(self, message: CustomerMessage) -> VendorMessage:
        """One message to the vendor and its answer; :class:`VendorBehindError` when the vendor lost steps."""

    def keep(self, step: int) -> None:
        """Have the vendor keep its trained state at ``step`` (an epoch's end: where it is now), to
        :meth:`select` later; :class:`VendorBehindError` when it is not at ``step``."""

    def select(self, step: int) -> None:
        """Have the vendor go back to, and serve, the state it kept at ``step`` (the chosen epoch's)."""

    def resumed_at(self) -> int:
        """The step the vendor is at (after a restart, its last checkpoint's)."""


Purpose = Literal["upload", "training", "inference"]


def purpose_of(message: CustomerMessage) -> Purpose:
    """What a message is for: a frozen bottom's upload, a training step (its forward pass and its gradient), or
    inference (a validation, test or user prediction)."""
    if isinstance(message, Upload):
        return "upload"
    if isinstance(message, Forward) and not message.train:
        return "inference"
    return "training"


@dataclass
class Traffic:
    """What crossed: messages and payload bytes each way, by purpose, and the time the vendor spent answering."""

    messages: int = 0
    bytes_to_vendor: int = 0
    bytes_to_customer: int = 0
    vendor_seconds: float = 0.0
    by_purpose: dict[str, dict[str, int]] = field(default_factory=dict)

    def count(self, purpose: Purpose, *, to_vendor: int, to_customer: int) -> None:
        """One exchange: ``to_vendor`` bytes out, ``to_customer`` bytes back."""
        self.messages += 1
        self.bytes_to_vendor += to_vendor
        self.bytes_to_customer += to_customer
        tally = self.by_purpose.setdefault(purpose, {"messages": 0, "bytes_to_vendor": 0, "bytes_to_customer": 0})
        tally["messages"] += 1
        tally["bytes_to_vendor"] += to_vendor
        tally["bytes_to_customer"] += to_customer

    def bytes_for(self, purpose: Purpose) -> int:
        """Payload bytes both ways for one purpose."""
        tally = self.by_purpose.get(purpose, {})
        return tally.get("bytes_to_vendor", 0) + tally.get("bytes_to_customer", 0)

    def to_dict(self) -> dict[str, Any]:
        return {"messages": self.messages, "bytes_to_vendor": self.bytes_to_vendor,
                "bytes_to_customer": self.bytes_to_customer, "vendor_seconds": self.vendor_seconds,
                "by_purpose": {k: dict(v) for k, v in sorted(self.by_purpose.items())}}


Observer = Callable[[CustomerMessage], None]


class InProcessTransport:
    """The vendor in this process. ``observer`` sees every message exactly as the vendor receives it (attacks)."""

    checkpoint_step: int | None = None  # the vendor here never loses a step

    def __init__(self, vendor: Vendor, *, observer: Observer | None = None) -> None:
        self.vendor = vendor
        self.observer = observer
        self.traffic = Traffic()
        self.kept: dict[int, dict[str, torch.Tensor]] = {}  # step -> the adapter then

    def exchange(self, message: CustomerMessage) -> VendorMessage:
        outgoing = to_bytes(message)
        received = from_bytes(outgoing)
        if self.observer is not None:
            self.observer(received)  # type: ignore[arg-type]
        before = self.vendor.seconds
        reply = self.vendor.handle(received)  # type: ignore[arg-type]
        self.traffic.vendor_seconds += self.vendor.seconds - before
        answer = to_bytes(reply)
        self.traffic.count(purpose_of(message), to_vendor=len(outgoing), to_customer=len(answer))
        return from_bytes(answer)  # type: ignore[return-value]

    def keep(self, step: int) -> None:
        self.kept[step] = self.vendor.adapter_state()

    def select(self, step: int) -> None:
        self.vendor.load_adapter_state(self.kept[step])

    def resumed_at(self) -> int:
        return self.vendor.steps_done
