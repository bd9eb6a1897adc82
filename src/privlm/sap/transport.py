"""How the two parties talk: a transport carries one customer message to the vendor and its answer back.

:class:`InProcessTransport` is the library's (tests, benchmarks): every message goes through its bytes
(``messages.to_bytes``/``from_bytes``, safetensors), so the parties share no tensor and the byte counts are the
real payload sizes. An HTTP transport (issue 14) implements the same ``exchange``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from privlm.sap.messages import CustomerMessage, VendorMessage, from_bytes, to_bytes
from privlm.sap.vendor import Vendor


class Transport(Protocol):
    def exchange(self, message: CustomerMessage) -> VendorMessage: ...


@dataclass
class Traffic:
    """What crossed: messages and payload bytes each way, and the time the vendor spent answering."""

    messages: int = 0
    bytes_to_vendor: int = 0
    bytes_to_customer: int = 0
    vendor_seconds: float = 0.0

    def to_dict(self) -> dict[str, float]:
        return {"messages": self.messages, "bytes_to_vendor": self.bytes_to_vendor,
                "bytes_to_customer": self.bytes_to_customer, "vendor_seconds": self.vendor_seconds}


Observer = Callable[[CustomerMessage], None]


class InProcessTransport:
    """The vendor in this process. ``observer`` sees every message exactly as the vendor receives it (attacks)."""

    def __init__(self, vendor: Vendor, *, observer: Observer | None = None) -> None:
        self.vendor = vendor
        self.observer = observer
        self.traffic = Traffic()

    def exchange(self, message: CustomerMessage) -> VendorMessage:
        outgoing = to_bytes(message)
        received = from_bytes(outgoing)
        self.traffic.messages += 1
        self.traffic.bytes_to_vendor += len(outgoing)
        if self.observer is not None:
            self.observer(received)  # type: ignore[arg-type]
        before = self.vendor.seconds
        reply = self.vendor.handle(received)  # type: ignore[arg-type]
        self.traffic.vendor_seconds += self.vendor.seconds - before
        answer = to_bytes(reply)
        self.traffic.bytes_to_customer += len(answer)
        return from_bytes(answer)  # type: ignore[return-value]
