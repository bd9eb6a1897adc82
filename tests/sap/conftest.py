"""The SAP vendor's tiny random BERT with MiniLM's tokenizer (``vendor_model``, tests/conftest.py), loaded: the
whole protocol in seconds."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer, BertModel, PreTrainedTokenizerBase

from privlm.models.partition import split_model
from privlm.sap import SapConfig, SplitParts

TEXTS = [
    "the flight was delayed again and nobody helped", "great crew and a smooth landing, thank you",
    "my bag is lost and the desk is closed", "loved the seats and the snacks on board",
    "cancelled without notice, worst airline ever", "friendly staff and an early arrival",
    "two hours on the tarmac with no water", "the upgrade made my day, thanks so much",
]
LABELS = [0, 1, 0, 1, 0, 1, 0, 1]


@pytest.fixture(scope="session")
def tokenizer(vendor_model: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(vendor_model, local_files_only=True)


@pytest.fixture(scope="session")
def vendor_bert(vendor_model: Path) -> BertModel:
    return BertModel.from_pretrained(vendor_model, local_files_only=True).eval()


@pytest.fixture
def make_parts(vendor_bert: BertModel, tokenizer: PreTrainedTokenizerBase):  # type: ignore[no-untyped-def]
    def make(config: SapConfig, n_classes: int = 2) -> SplitParts:
        bottom, top = split_model(vendor_bert, config.blocks, pooling="mean",
                                  n_classes=n_classes if config.head == "vendor" else None, head_seed=config.seed)
        return SplitParts(bottom=bottom, top=top, tokenizer=tokenizer)
    return make
