"""Denoiser artefacts: safetensors weights plus a typed card (:mod:`privlm.snd.card`). Nothing is ever unpickled."""

from __future__ import annotations

import warnings
from importlib import resources
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from privlm.models import TokenEmbedder
from privlm.snd.card import CARD_FORMAT, BaseModelFacts, DenoiserCard, read_card, write_card
from privlm.snd.denoiser import Denoiser

WEIGHTS_FILE = "denoiser.safetensors"


def base_model_facts(model: TokenEmbedder) -> BaseModelFacts:
    return BaseModelFacts(name=model.name, fingerprint=model.fingerprint, dim=model.hidden_size,
                          vocab_size=model.vocab_size, max_embedding_norm=model.max_embedding_norm,
                          pooling=getattr(model, "pooling", None), normalize=model.normalize)


def save_denoiser(denoiser: Denoiser, directory: Path, card: DenoiserCard) -> None:
    """Write ``denoiser.safetensors`` and its card ``denoiser.json``."""
    if card.config != denoiser.config:
        raise ValueError("the card's config must be the denoiser's own")
    directory.mkdir(parents=True, exist_ok=True)
    weights = {k: v.detach().cpu().contiguous() for k, v in denoiser.state_dict().items()}
    save_file(weights, str(directory / WEIGHTS_FILE), metadata={"format": CARD_FORMAT})
    write_card(directory, card)


def default_denoiser_dir(model_name: str = "minilm") -> Path:
    """The denoiser shipped inside the package for a packaged model."""
    return Path(str(resources.files("privlm") / "data" / "denoisers" / model_name))


def load_denoiser(directory: str | Path, *, model: TokenEmbedder, device: torch.device | str | None = None
                  ) -> tuple[Denoiser, DenoiserCard]:
    """Load weights and card; refuse a denoiser trained for a different base model."""
    directory = Path(directory)
    card = read_card(directory)
    if card.base_model.fingerprint != model.fingerprint:
        raise ValueError(
            f"denoiser at {directory} was trained for base model {card.base_model.name!r} (fingerprint "
            f"{card.base_model.fingerprint[:12]}...), not for {model.name!r} (fingerprint "
            f"{model.fingerprint[:12]}...); train one with `privlm snd train --model ...`")
    denoiser = Denoiser(card.config)
    denoiser.load_state_dict(load_file(str(directory / WEIGHTS_FILE)))
    return denoiser.to(device or model.device).eval(), card


def warn_if_outside_range(card: DenoiserCard, eta: float) -> None:
    low, high = card.eta_range
    if not low <= eta <= high:
        warnings.warn(f"eta={eta:g} is outside the range [{low:g}, {high:g}] this denoiser was trained for; "
                      "expect weaker denoising", stacklevel=3)
