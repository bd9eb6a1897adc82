"""A saved 3-block random BERT with MiniLM's tokenizer: a vendor's model folder that loads in a second."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.models.tiny import tiny_bert_with_minilm_tokenizer

KEYS = ("key-acme", "key-globex")


@pytest.fixture(scope="session")
def vendor_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_bert_with_minilm_tokenizer(tmp_path_factory.mktemp("sap-vendor-model"), blocks=3)
