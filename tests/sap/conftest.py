"""A tiny random BERT with MiniLM's tokenizer: the whole protocol in seconds."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer, BertConfig, BertModel, PreTrainedTokenizerBase

from privlm.models.partition import split_model
from privlm.models.sources import minilm_source
from privlm.sap import SapConfig, SplitParts

TEXTS = [
    "the flight was delayed again and nobody helped", "great crew and a smooth landing, thank you",
    "my bag is lost and the desk is closed", "loved the seats and the snacks on board",
    "cancelled without notice, worst airline ever", "friendly staff and an early arrival",
    "two hours on the tarmac with no water", "the upgrade made my day, thanks so much",
]
LABELS = [0, 1, 0, 1, 0, 1, 0, 1]


@pytest.fixture(scope="session")
def tokenizer() -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(minilm_source().path, local_files_only=True)


@pytest.fixture(scope="session")
def tiny_bert(tokenizer: PreTrainedTokenizerBase) -> BertModel:
    config = BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=3, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=64)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return BertModel(config).eval()


@pytest.fixture
def make_parts(tiny_bert: BertModel, tokenizer: PreTrainedTokenizerBase):  # type: ignore[no-untyped-def]
    def make(config: SapConfig, n_classes: int = 2) -> SplitParts:
        bottom, top = split_model(tiny_bert, config.blocks, pooling="mean",
                                  n_classes=n_classes if config.head == "vendor" else None, head_seed=config.seed)
        return SplitParts(bottom=bottom, top=top, tokenizer=tokenizer)
    return make
