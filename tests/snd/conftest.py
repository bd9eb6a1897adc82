import pytest

TEXTS = ["the cat sat on the mat .", "a dog", "the dog sat , the cat sat", "mat", "the mat , the cat , a dog ."]


@pytest.fixture(scope="session")
def corpus() -> list[str]:
    words = ["the", "cat", "sat", "on", "mat", "a", "dog", ".", ","]
    return [" ".join(words[(i * k) % len(words)] for k in range(1, 3 + i % 7)) + f" w{i % 80}" for i in range(300)]
