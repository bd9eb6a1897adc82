import numpy as np
import pytest
import torch

from privlm.baselines import Text2Text, TokEmbPriv
from privlm.mechanisms import make_generator
from privlm.models.batching import map_in_length_order

TEXTS = ["the cat sat on the mat .", "a dog", "the dog sat , the cat sat", "mat"]


def test_length_sorted_batching_keeps_input_order():
    texts = ["ccc", "a", "bb", "dddd", "e"]
    out = map_in_length_order(texts, lambda chunk: np.array([[len(t)] for t in chunk]), batch_size=2)
    assert out[:, 0].tolist() == [3, 1, 2, 4, 1]


def test_text2text_keeps_special_tokens_and_reports_them(tiny_bert):
    released = Text2Text(tiny_bert, eta=1e6, generator=make_generator(0)).privatize(TEXTS)
    assert released.kept_special == 2 * len(TEXTS)  # [CLS] and [SEP] per sentence
    assert torch.equal(released.released_ids, released.batch.input_ids)  # negligible noise: nothing changes
    assert int(released.perturbed.sum()) == int(released.batch.attention_mask.sum()) - 2 * len(TEXTS)


def test_text2text_at_strong_privacy_replaces_most_tokens(tiny_bert):
    released = Text2Text(tiny_bert, eta=0.5, generator=make_generator(1)).privatize(TEXTS * 10)
    same = (released.released_ids == released.batch.input_ids)[released.perturbed].float().mean().item()
    assert same < 0.5
    special = released.batch.attention_mask.bool() & ~released.perturbed
    assert torch.equal(released.released_ids[special], released.batch.input_ids[special])


@pytest.mark.parametrize("method", [TokEmbPriv, Text2Text])
def test_encode_is_a_sentence_transformers_drop_in(method, tiny_bert):
    out = method(tiny_bert, eta=1e6, generator=make_generator(2)).encode(TEXTS, batch_size=3)
    assert isinstance(out, np.ndarray) and out.dtype == np.float32 and out.shape == (4, 32)
    np.testing.assert_allclose(out, tiny_bert.encode_texts(TEXTS).numpy(), atol=1e-3)


def test_tokembpriv_noise_moves_the_embedding(tiny_bert):
    noisy = TokEmbPriv(tiny_bert, eta=1.0, generator=make_generator(3)).encode(TEXTS)
    clean = tiny_bert.encode_texts(TEXTS).numpy()
    assert np.abs(noisy - clean).max() > 0.1


def test_bad_eta_is_rejected(tiny_bert):
    for method in (TokEmbPriv, Text2Text):
        with pytest.raises(ValueError, match="eta"):
            method(tiny_bert, eta=0)
