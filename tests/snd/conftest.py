import pytest

from privlm.models import SplitModel
from tests.models.tiny import tiny_bert_folder

TEXTS = ["the cat sat on the mat .", "a dog", "the dog sat , the cat sat", "mat", "the mat , the cat , a dog ."]


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> SplitModel:
    return SplitModel.from_pretrained(tiny_bert_folder(tmp_path_factory.mktemp("tiny-bert")), device="cpu")


@pytest.fixture(scope="session")
def corpus() -> list[str]:
    words = ["the", "cat", "sat", "on", "mat", "a", "dog", ".", ","]
    return [" ".join(words[(i * k) % len(words)] for k in range(1, 3 + i % 7)) + f" w{i % 80}" for i in range(300)]
