"""Settings of one SAP fine-tuning run, validated in one place."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from peft import LoraConfig

from privlm.settings.sap import HEAD_PLACEMENTS, HeadPlacement
from privlm.validation import check_choice, check_in_interval, check_positive_finite, check_positive_int


def _check_optional_eta(name: str, value: object) -> float | None:
    return None if value is None else check_positive_finite(name, value)


def _check_non_negative_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    return value


@dataclass(frozen=True, kw_only=True)
class LoraSettings:
    """LoRA on the vendor's top model (through ``peft``). BERT's default targets are ``query`` and ``value``.

    ``dropout`` acts on LoRA's input during training steps only, with masks drawn from the vendor's seed and the
    step number (a retried step draws the same masks); the frozen layers' own dropout stays off.
    """

    rank: int = 8
    alpha: int = 16
    dropout: float = 0.0
    target_modules: tuple[str, ...] = ("query", "value")

    def __post_init__(self) -> None:
        check_positive_int("rank", self.rank)
        check_positive_int("alpha", self.alpha)
        check_in_interval("dropout", self.dropout, 0, 1, high_open=True)
        targets = tuple(self.target_modules)
        if not targets or not all(isinstance(t, str) and t for t in targets):
            raise ValueError(f"target_modules must be non-empty module names, got {self.target_modules!r}")
        object.__setattr__(self, "target_modules", targets)

    def peft_config(self, *, train_head: bool) -> LoraConfig:
        """The peft config; the task head (module ``head``) is trained in full when it sits at the vendor."""
        return LoraConfig(r=self.rank, lora_alpha=self.alpha, lora_dropout=self.dropout,
                          target_modules=list(self.target_modules), modules_to_save=["head"] if train_head else None)


@dataclass(frozen=True, kw_only=True)
class SapConfig:
    """One run of the protocol.

    ``blocks``: transformer blocks in the customer's bottom (0 = the embedding layer only).
    ``eta``: the d_chi level of the privatizer; None sends the bottom's output un-noised (the paper's "None").
    ``head``: ``"vendor"`` (the default, Algorithm 1: logits go to the customer, dL/dlogits comes back and
    reveals every training label to the vendor) or ``"customer"`` (the vendor returns the pooled representation
    h, the customer holds the head and returns dL/dh).
    ``trainable_bottom``: the customer also trains its bottom, privatizes per batch and gets the cut gradient.
    ``cti``: exempt the contributing tokens (embedding bottom only); ``exempt_eta`` None releases them exactly,
    a number gives them that (larger) eta instead. ``cti_share`` caps their share of the training positions.
    ``clip_norm``: a deeper bottom (blocks >= 1) only: clip each hidden state to this L2 norm before the noise,
    so any two positions are at most 2 * clip_norm apart and each release is (2 * clip_norm * eta)-DP per position;
    None (the paper's setting) leaves hidden states unbounded, and the d_chi guarantee is then in their distance.
    ``seed``: initialisation and batch order (reproducible training); the privatizer's noise is OS-seeded
    unless ``noise_seed`` is given.
    """

    blocks: int = 0
    eta: float | None = None
    head: HeadPlacement = "vendor"
    trainable_bottom: bool = False
    cti: bool = False
    exempt_eta: float | None = None
    clip_norm: float | None = None
    cti_share: float = 0.01
    cti_alpha: float = 1.0
    lora: LoraSettings = field(default_factory=LoraSettings)
    learning_rate: float = 1e-3
    bottom_learning_rate: float = 1e-4
    epochs: int = 3
    batch_size: int = 32
    max_length: int = 64
    seed: int = 0
    noise_seed: int | None = None

    def __post_init__(self) -> None:
        _check_non_negative_int("blocks", self.blocks)
        _check_optional_eta("eta", self.eta)
        _check_optional_eta("exempt_eta", self.exempt_eta)
        check_choice("head", self.head, HEAD_PLACEMENTS)
        if not isinstance(self.trainable_bottom, bool) or not isinstance(self.cti, bool):
            raise ValueError("trainable_bottom and cti must be booleans")
        check_in_interval("cti_share", self.cti_share, 0, 1, low_open=True, high_open=True)
        check_positive_finite("cti_alpha", self.cti_alpha)
        if self.cti and self.blocks != 0:
            raise ValueError("cti applies to the embedding bottom only (blocks=0): deeper representations mix tokens")
        if self.cti and self.eta is None:
            raise ValueError("cti exempts tokens from noise, so it needs an eta")
        if self.exempt_eta is not None and not self.cti:
            raise ValueError("exempt_eta is the eta of CTI's exempt tokens; it needs cti=True")
        if self.clip_norm is not None:
            check_positive_finite("clip_norm", self.clip_norm)
            if self.blocks == 0:
                raise ValueError("clip_norm applies to hidden states (blocks >= 1); the embedding bottom releases "
                                 "vocabulary rows, bounded already")
        if self.exempt_eta is not None and self.eta is not None and self.exempt_eta < self.eta:
            raise ValueError(f"exempt_eta ({self.exempt_eta}) must be at least eta ({self.eta}): CTI reduces noise")
        if not isinstance(self.lora, LoraSettings):
            raise ValueError(f"lora must be a LoraSettings, got {type(self.lora).__name__}")
        check_positive_finite("learning_rate", self.learning_rate)
        check_positive_finite("bottom_learning_rate", self.bottom_learning_rate)
        for name in ("epochs", "batch_size", "max_length"):
            check_positive_int(name, getattr(self, name))
        _check_non_negative_int("seed", self.seed)
        if self.noise_seed is not None:
            _check_non_negative_int("noise_seed", self.noise_seed)


@dataclass(frozen=True, kw_only=True)
class FitOptions:
    """What a fine-tuning run does besides training and choosing its epoch on validation. ``test_texts`` and
    ``test_labels``: scored at every epoch, never used to choose. ``patience``: stop once validation accuracy has
    not improved for that many epochs (None: train every epoch). ``progress``: show a progress bar."""

    test_texts: Sequence[str] | None = None
    test_labels: Sequence[int] | np.ndarray | None = None
    patience: int | None = None
    progress: bool = False

    def __post_init__(self) -> None:
        if self.patience is not None:
            check_positive_int("patience", self.patience)
