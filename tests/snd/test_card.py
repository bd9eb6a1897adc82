"""Denoiser cards: typed, versioned, read and written in one place; version-1 cards still load."""

import json
import shutil
from pathlib import Path

import pytest

from privlm.snd import DenoiserCard, default_denoiser_dir, read_card, write_card

REPO = Path(__file__).parents[2]
V1_CARDS = [default_denoiser_dir("minilm") / "denoiser.json",
            *sorted((REPO / "benchmarks" / "snd" / "denoiser_cards").glob("*.json"))]


@pytest.mark.parametrize("path", V1_CARDS, ids=lambda p: p.stem if p.parent.name != "minilm" else "shipped")
def test_every_committed_version_1_card_loads(path, tmp_path):
    assert json.loads(path.read_text())["format"] == "privlm-denoiser/1"
    shutil.copy(path, tmp_path / "denoiser.json")
    card = read_card(tmp_path)
    assert isinstance(card, DenoiserCard) and card.eta_range[0] <= card.eta_range[1]
    write_card(tmp_path, card)  # upgraded to version 2 on write, and read back unchanged
    assert json.loads((tmp_path / "denoiser.json").read_text())["format"] == "privlm-denoiser/2"
    assert read_card(tmp_path) == card


def test_bad_cards_get_clear_errors(tmp_path):
    card = json.loads(V1_CARDS[0].read_text())
    (tmp_path / "denoiser.json").write_text(json.dumps(card | {"eta_range": [1.0, 2.0]}))
    with pytest.raises(ValueError, match="disagrees"):
        read_card(tmp_path)
    (tmp_path / "denoiser.json").write_text(json.dumps(card | {"format": "privlm-denoiser/9"}))
    with pytest.raises(ValueError, match="not a privlm denoiser card"):
        read_card(tmp_path)
    (tmp_path / "denoiser.json").write_text(json.dumps(card | {"validation": {"mse": "low"}}))
    with pytest.raises(ValueError, match="validation"):
        read_card(tmp_path)
    with pytest.raises(ValueError, match="no denoiser card"):
        read_card(tmp_path / "missing")
