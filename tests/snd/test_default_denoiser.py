"""The denoiser shipped for MiniLM: loads offline, describes itself, and actually denoises."""

import numpy as np
import pytest

from privlm.data import load_tweets
from privlm.mechanisms import make_generator
from privlm.snd import SnDEncoder, default_denoiser_dir, read_card

pytestmark = pytest.mark.slow


def test_card_describes_how_it_was_made(minilm):
    card = read_card(default_denoiser_dir("minilm"))  # a version-1 card: still loads
    assert card.base_model.fingerprint == minilm.fingerprint
    assert card.provenance["command"].startswith("privlm snd train")
    assert card.training.wall_seconds < 45 * 60
    assert card.training_data.sources == ["wordnet"]  # evaluation tasks (tweets, fortunes) unseen
    assert card.eta_range == (15.0, 150.0) and card.validation.cosine > card.validation.noisy_cosine
    assert (default_denoiser_dir("minilm") / "denoiser.safetensors").stat().st_size < 25 * 2**20


def test_denoising_beats_the_raw_server_embedding_on_unseen_text(minilm):
    texts = list(load_tweets(labels=("negative", "positive"), min_confidence=0.5).texts[:200])  # unseen in training
    clean = minilm.encode_texts(texts).numpy()
    denoised = SnDEncoder(minilm, eta=50.0, generator=make_generator(0)).encode(texts)
    raw = SnDEncoder(minilm, eta=50.0, denoiser=None, generator=make_generator(0)).encode(texts)

    def cosine(a: np.ndarray) -> float:
        return float((a * clean).sum(1).mean() / 1.0)  # all rows are unit-norm

    assert cosine(denoised) > cosine(raw) + 0.1
