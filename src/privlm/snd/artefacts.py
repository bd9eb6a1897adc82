"""Denoiser artefacts: safetensors weights plus a JSON card. Nothing is ever unpickled."""

from __future__ import annotations

import json
import warnings
from importlib import resources
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from privlm.models import TokenEmbedder
from privlm.snd.denoiser import Denoiser, DenoiserConfig

CARD_FORMAT = "privlm-denoiser/1"
WEIGHTS_FILE = "denoiser.safetensors"
CARD_FILE = "denoiser.json"


def base_model_card(model: TokenEmbedder) -> dict[str, object]:
    return {"name": model.name, "fingerprint": model.fingerprint, "dim": model.hidden_size,
            "vocab_size": model.vocab_size, "max_embedding_norm": model.max_embedding_norm,
            "pooling": getattr(model, "pooling", None), "normalize": model.normalize}


def save_denoiser(denoiser: Denoiser, directory: Path, card: dict[str, object]) -> None:
    """Write ``denoiser.safetensors`` and ``denoiser.json`` (the card must name its base model)."""
    directory.mkdir(parents=True, exist_ok=True)
    weights = {k: v.detach().cpu().contiguous() for k, v in denoiser.state_dict().items()}
    save_file(weights, str(directory / WEIGHTS_FILE), metadata={"format": CARD_FORMAT})
    full_card = {"format": CARD_FORMAT, "config": denoiser.config.to_dict(), **card}
    (directory / CARD_FILE).write_text(json.dumps(full_card, indent=2) + "\n")


def read_card(directory: Path) -> dict[str, object]:
    card_path = Path(directory) / CARD_FILE
    if not card_path.exists():
        raise ValueError(f"no denoiser card at {card_path}")
    card = json.loads(card_path.read_text())
    if card.get("format") != CARD_FORMAT:
        raise ValueError(f"{card_path} is not a privlm denoiser card (format {card.get('format')!r})")
    return card


def default_denoiser_dir(model_name: str = "minilm") -> Path:
    """The denoiser shipped inside the package for a packaged model."""
    return Path(str(resources.files("privlm") / "data" / "denoisers" / model_name))


def load_denoiser(directory: str | Path, *, model: TokenEmbedder, device: torch.device | str | None = None
                  ) -> tuple[Denoiser, dict[str, object]]:
    """Load weights and card; refuse a denoiser trained for a different base model."""
    directory = Path(directory)
    card = read_card(directory)
    base = card.get("base_model", {})
    if not isinstance(base, dict) or base.get("fingerprint") != model.fingerprint:
        expected = base.get("name") if isinstance(base, dict) else None
        raise ValueError(
            f"denoiser at {directory} was trained for base model {expected!r} (fingerprint "
            f"{str(base.get('fingerprint', '?'))[:12]}...), not for {model.name!r} (fingerprint "
            f"{model.fingerprint[:12]}...); train one with `privlm snd train --model ...`")
    config = DenoiserConfig(**card["config"])  # type: ignore[arg-type]
    denoiser = Denoiser(config)
    state = load_file(str(directory / WEIGHTS_FILE))
    denoiser.load_state_dict(state)
    return denoiser.to(device or model.device).eval(), card


def warn_if_outside_range(card: dict[str, object], eta: float) -> None:
    low, high = card["config"]["eta_min"], card["config"]["eta_max"]  # type: ignore[index]
    if not low <= eta <= high:
        warnings.warn(f"eta={eta:g} is outside the range [{low:g}, {high:g}] this denoiser was trained for; "
                      "expect weaker denoising", stacklevel=3)
