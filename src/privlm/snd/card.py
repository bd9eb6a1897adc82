"""Denoiser cards: what a denoiser is, what it was trained for and how, as a typed, versioned model.

Version 2 (written now) drops v1's ``eta_range``, which repeated ``config.eta_min``/``eta_max``.
Version 1 cards (the shipped MiniLM denoiser, the benchmark cards) still load: ``read_card`` checks the
repeated range against the config and drops it. Cards are read and written only here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from privlm.snd.denoiser import DenoiserConfig

CARD_FILE = "denoiser.json"
CARD_FORMAT: Literal["privlm-denoiser/2"] = "privlm-denoiser/2"
V1_FORMAT = "privlm-denoiser/1"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class BaseModelFacts(_Strict):
    """The base model a denoiser was trained for; ``fingerprint`` must match at load time."""

    name: str
    fingerprint: str
    dim: int
    vocab_size: int
    max_embedding_norm: float
    pooling: str | None
    normalize: bool


class TrainingRecord(_Strict):
    etas: list[float] | str  # the discrete training etas, or "log-uniform over eta_range"
    clip: bool
    steps: int
    best_step: int
    epochs: int
    wall_seconds: float
    settings: dict[str, Any]


class TrainingData(_Strict):
    sources: list[str]
    n_train: int
    n_validation: int
    excluded_longer_than_max_tokens: int


class ValidationFigures(_Strict):
    mse: float
    cosine: float
    noisy_mse: float
    noisy_cosine: float


class DenoiserCard(_Strict):
    format: Literal["privlm-denoiser/2"] = CARD_FORMAT
    config: DenoiserConfig
    base_model: BaseModelFacts
    training: TrainingRecord
    training_data: TrainingData
    validation: ValidationFigures
    provenance: dict[str, Any]
    history: list[dict[str, int | float]]  # steps stay integers

    @property
    def eta_range(self) -> tuple[float, float]:
        return self.config.eta_min, self.config.eta_max


def _upgrade_v1(card: dict[str, Any], path: Path) -> dict[str, Any]:
    eta_range = card.pop("eta_range", None)
    config = card.get("config", {})
    if eta_range is not None and list(eta_range) != [config.get("eta_min"), config.get("eta_max")]:
        raise ValueError(f"{path}: eta_range {eta_range} disagrees with the config's eta_min/eta_max")
    return card | {"format": CARD_FORMAT}


def read_card(directory: str | Path) -> DenoiserCard:
    """The card in ``directory``, of any known version; a clear error for anything else."""
    path = Path(directory) / CARD_FILE
    if not path.exists():
        raise ValueError(f"no denoiser card at {path}")
    card = json.loads(path.read_text())
    version = card.get("format") if isinstance(card, dict) else None
    if version == V1_FORMAT:
        card = _upgrade_v1(card, path)
    elif version != CARD_FORMAT:
        raise ValueError(f"{path} is not a privlm denoiser card (format {version!r}; this privlm reads "
                         f"{V1_FORMAT} and {CARD_FORMAT})")
    return DenoiserCard.model_validate(card)


def write_card(directory: Path, card: DenoiserCard) -> Path:
    path = Path(directory) / CARD_FILE
    path.write_text(json.dumps(card.model_dump(mode="json"), indent=2) + "\n")
    return path
