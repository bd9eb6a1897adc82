"""Shared fixtures. Real packaged models are session-scoped: each loads once per run."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# The strict threshold of the project's statistical tests.
P_THRESHOLD = 1e-6

BAD_POSITIVE_REALS = [0, 0.0, -1, -0.5, float("nan"), float("inf"), float("-inf"), "1", None, True]


def assert_draws_follow(draws: torch.Tensor, probabilities: torch.Tensor) -> None:
    """Chi-square test, at the project's threshold, that sampled ids follow exact probabilities."""
    from scipy import stats

    n, size = draws.numel(), probabilities.numel()
    observed = np.bincount(draws.flatten().numpy(), minlength=size)
    assert stats.chisquare(observed, probabilities.double().numpy() * n).pvalue > P_THRESHOLD


@pytest.fixture
def generator() -> torch.Generator:
    """A seeded generator, so that a statistical failure can be replayed."""
    g = torch.Generator()
    g.manual_seed(20261121)
    return g


@pytest.fixture(scope="session")
def minilm():
    from privlm.models import SplitModel

    return SplitModel.from_pretrained("minilm", device="cpu")


@pytest.fixture(scope="session")
def smollm2():
    from privlm.models import SplitModel

    return SplitModel.from_pretrained("smollm2", device="cpu")


@pytest.fixture(scope="session")
def tiny_masked_lm(tmp_path_factory):
    """A tiny random BertForMaskedLM (64 positions, WordPiece tokenizer) as a device LanguageModel."""
    from privlm.models.language import LanguageModel
    from tests.models.tiny import tiny_masked_lm_folder

    return LanguageModel.from_pretrained(tiny_masked_lm_folder(tmp_path_factory.mktemp("tiny-mlm")), device="cpu")


@pytest.fixture(scope="session")
def tiny_bert(tmp_path_factory):
    """A tiny random BERT with a real WordPiece tokenizer, loaded from a local folder."""
    from privlm.models import SplitModel
    from tests.models.tiny import tiny_bert_folder

    return SplitModel.from_pretrained(tiny_bert_folder(tmp_path_factory.mktemp("tiny-bert")), device="cpu")
