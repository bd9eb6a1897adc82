"""Split-and-Privatize (SAP): private LoRA fine-tuning across a customer and a vendor.

The vendor cuts its model (:func:`split_pretrained`), keeps the top and trains LoRA on it; the customer gets only
the bottom, keeps its texts and labels, and sends privatized representations. The protocol (Algorithm 1 of the
paper) runs between :class:`Customer` and :class:`Vendor` through a :class:`Transport`, and :func:`fit` is its one
training loop: :func:`connect` and :func:`fine_tune` run it in one process; :class:`Client` runs the customer
against a remote vendor (``privlm sap vendor``). See docs/sap.md.
"""

from privlm.sap.config import HEAD_PLACEMENTS, FitOptions, HeadPlacement, LoraSettings, SapConfig
from privlm.sap.cti import CtiReport, contributing_tokens, utility_importance
from privlm.sap.customer import Customer, PrivacyAccount, TokenizedTexts
from privlm.sap.messages import (
    CutGradient,
    Forward,
    OutputGradient,
    PrivatizedBatch,
    ProtocolError,
    StepDone,
    TopOutput,
    Upload,
    Uploaded,
    from_bytes,
    to_bytes,
)
from privlm.sap.model import SplitParts, VendorModel, add_lora, split_pretrained
from privlm.sap.privatizer import EmbeddingPrivatizer, HiddenStatePrivatizer, Release
from privlm.sap.service.client import Client, ClientOptions
from privlm.sap.training import EpochRecord, FitResult, Parties, connect, fine_tune, fit
from privlm.sap.transport import InProcessTransport, Traffic, Transport, VendorBehindError
from privlm.sap.vendor import Vendor

__all__ = [
    "HEAD_PLACEMENTS",
    "Client",
    "ClientOptions",
    "CtiReport",
    "Customer",
    "CutGradient",
    "EmbeddingPrivatizer",
    "EpochRecord",
    "FitOptions",
    "FitResult",
    "Forward",
    "HeadPlacement",
    "HiddenStatePrivatizer",
    "InProcessTransport",
    "LoraSettings",
    "OutputGradient",
    "Parties",
    "PrivacyAccount",
    "PrivatizedBatch",
    "ProtocolError",
    "Release",
    "SapConfig",
    "SplitParts",
    "StepDone",
    "TokenizedTexts",
    "TopOutput",
    "Traffic",
    "Transport",
    "Upload",
    "Uploaded",
    "Vendor",
    "VendorBehindError",
    "VendorModel",
    "add_lora",
    "connect",
    "contributing_tokens",
    "fine_tune",
    "fit",
    "from_bytes",
    "split_pretrained",
    "to_bytes",
    "utility_importance",
]
