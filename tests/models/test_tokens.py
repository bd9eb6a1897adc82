"""One tokenization per request: ``tokens`` then ``pad`` gives exactly the tokenizer's own padded batch."""

import threading

import pytest
import torch

TEXTS = ["the cat sat on the mat .", "a dog", "the dog sat , the cat sat , the mat", "mat"]


def _reference(model, texts, max_length):
    batch = model.tokenizer(list(texts), padding=True, truncation=True, max_length=max_length, return_tensors="pt",
                            padding_side="right")
    return batch["input_ids"], batch["attention_mask"]


@pytest.mark.parametrize("max_length", [None, 5])
def test_pad_equals_the_tokenizers_batch(tiny_bert, max_length):
    limit = max_length or tiny_bert.max_length
    batch = tiny_bert.pad(tiny_bert.tokens(TEXTS), max_length=max_length)
    ids, mask = _reference(tiny_bert, TEXTS, limit)
    assert torch.equal(batch.input_ids, ids) and torch.equal(batch.attention_mask, mask)
    assert batch.truncated == [n > limit for n in tiny_bert.token_counts(TEXTS)]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["minilm", "smollm2"])
def test_pad_equals_the_tokenizers_batch_on_packaged_models(name, request):
    model = request.getfixturevalue(name)
    texts = ["Alice Smith was diagnosed with diabetes in Boston.", "hi", "word " * 300]
    batch = model.pad(model.tokens(texts), max_length=16)
    ids, mask = _reference(model, texts, 16)
    assert torch.equal(batch.input_ids, ids) and torch.equal(batch.attention_mask, mask)


def test_tokens_subset_and_longer_than(tiny_bert):
    tokens = tiny_bert.tokens(TEXTS)
    assert tokens.longer_than(4) == [i for i, n in enumerate(tokens.counts) if n > 4]
    assert tokens.subset([2, 0]).texts == (TEXTS[2], TEXTS[0])


def test_concurrent_tokenization_is_safe(tiny_bert):
    """A fast tokenizer keeps truncation state: calls from several threads must not see each other's."""
    long = ["the cat sat on the mat " * 3] * 4
    errors: list[BaseException] = []

    def work(truncate: bool) -> None:
        try:
            for _ in range(50):
                batch = tiny_bert.tokenize(long, truncation="count", max_length=6) if truncate else None
                counts = tiny_bert.token_counts(long)
                assert counts == [20] * 4, counts
                if batch is not None:
                    assert batch.input_ids.shape == (4, 6)
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=work, args=(i % 2 == 0,)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors[0]
