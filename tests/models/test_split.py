import pytest
import torch
from transformers import AutoModel

from privlm.models import SplitModel
from tests.models.tiny import tiny_bert_folder, tiny_model

ATOL = 1e-5


def _padded_ids(generator: torch.Generator, vocab: int = 99) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(5, vocab, (4, 11), generator=generator)
    mask = torch.ones_like(ids)
    for row, length in enumerate((11, 7, 3, 9)):  # right padding of different lengths
        mask[row, length:] = 0
        ids[row, length:] = 0
    return ids, mask


def _reference_pooled(model, ids, mask, pooling):
    """The unsplit HF model on token ids, pooled by hand."""
    hidden = model.base_model(input_ids=ids, attention_mask=mask).last_hidden_state
    if pooling == "cls":
        return hidden[:, 0]
    if pooling == "last":
        return hidden[torch.arange(len(ids)), mask.sum(dim=1) - 1]
    weights = mask.unsqueeze(-1).float()
    return (hidden * weights).sum(1) / weights.sum(1)


@pytest.mark.parametrize(("family", "pooling"), [("bert", "cls"), ("roberta", "cls"), ("distilbert", "cls"),
                                                  ("gpt2", "last"), ("llama", "last"), ("t5", "mean")])
def test_split_path_equals_unsplit_model(family, pooling, generator):
    model = tiny_model(family)
    split = SplitModel(model, device="cpu")
    assert split.pooling == pooling  # the family's own pooling is the default
    ids, mask = _padded_ids(generator)
    with torch.no_grad():
        x = split.embed_tokens(ids)
        torch.testing.assert_close(x, model.get_input_embeddings().weight[ids])  # word rows only
        pooled = split.encode(x, mask)
        reference = _reference_pooled(model, ids, mask, pooling)
    assert pooled.shape == (4, 32)
    torch.testing.assert_close(pooled, reference, atol=ATOL, rtol=0)


@pytest.mark.parametrize("pooling", ["mean", "cls", "last"])
def test_every_pooling_works_on_every_path(pooling, generator):
    model = tiny_model("bert")
    split = SplitModel(model, pooling=pooling, device="cpu")
    ids, mask = _padded_ids(generator)
    with torch.no_grad():
        torch.testing.assert_close(split.encode(split.embed_tokens(ids), mask),
                                   _reference_pooled(model, ids, mask, pooling), atol=ATOL, rtol=0)


def test_vocabulary_matrix_and_max_norm():
    model = tiny_model("gpt2")
    split = SplitModel(model, device="cpu")
    matrix = model.get_input_embeddings().weight
    assert split.embedding_matrix.shape == (99, 32)
    assert not split.embedding_matrix.requires_grad
    assert split.max_embedding_norm == pytest.approx(matrix.norm(dim=-1).max().item())


def test_fingerprint_identifies_the_weights():
    a, b = SplitModel(tiny_model("bert"), device="cpu"), SplitModel(tiny_model("bert"), device="cpu")
    assert a.fingerprint == b.fingerprint and len(a.fingerprint) == 64
    other = tiny_model("bert")
    with torch.no_grad():
        other.get_input_embeddings().weight[3, 0] += 1e-3
    assert SplitModel(other, device="cpu").fingerprint != a.fingerprint


def test_encode_rejects_malformed_tensors():
    split = SplitModel(tiny_model("bert"), device="cpu")
    good = torch.zeros(2, 5, 32)
    mask = torch.ones(2, 5, dtype=torch.long)
    with pytest.raises(ValueError, match="dimension"):
        split.encode(torch.zeros(2, 5, 31), mask)
    with pytest.raises(ValueError, match="token_embeddings"):
        split.encode(torch.zeros(5, 32), mask)
    with pytest.raises(ValueError, match="NaN or inf"):
        split.encode(torch.full((2, 5, 32), float("nan")), mask)
    with pytest.raises(ValueError, match="attention_mask"):
        split.encode(good, torch.ones(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="input_ids"):
        split.embed_tokens(torch.tensor([[0, 99]]))


def test_loads_a_local_folder_and_tokenizes(tmp_path):
    split = SplitModel.from_pretrained(tiny_bert_folder(tmp_path), device="cpu")
    batch = split.tokenize(["the cat sat on the mat .", "a dog"])
    assert batch.input_ids.shape == batch.attention_mask.shape
    assert batch.attention_mask[1].sum() == 4  # [CLS] a dog [SEP], right-padded
    assert batch.n_truncated == 0
    assert split.encode_texts(["the cat", "a dog", "the mat"], batch_size=2).shape == (3, 32)


def test_bad_text_gets_a_clear_error(tmp_path):
    split = SplitModel.from_pretrained(tiny_bert_folder(tmp_path), device="cpu")
    for bad in ([], "a plain string", ["the cat", ""], ["   "], [None]):
        with pytest.raises(ValueError, match="texts"):
            split.tokenize(bad)


def test_over_long_text_is_counted_and_warned_or_refused(tmp_path):
    split = SplitModel.from_pretrained(tiny_bert_folder(tmp_path), device="cpu")
    long_text = " ".join(["cat"] * 100)
    with pytest.warns(UserWarning, match="1 of 2 texts exceed max_length=64"):
        batch = split.tokenize([long_text, "a dog"])
    assert batch.truncated == [True, False]
    assert batch.input_ids.shape[1] == 64
    with pytest.raises(ValueError, match="exceed max_length"):
        split.tokenize([long_text], truncation="error")


def test_unknown_model_names_fail_clearly():
    with pytest.raises(ValueError, match="never downloads"):
        SplitModel.from_pretrained("no-such-org/no-such-model", device="cpu")
    with pytest.raises(ValueError, match="does not exist"):
        SplitModel.from_pretrained("./no/such/folder", device="cpu")


def test_unsupported_family_fails_clearly():
    from transformers import ViTConfig, ViTModel

    with pytest.raises(ValueError, match="not supported"):
        SplitModel(ViTModel(ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                      intermediate_size=37)), device="cpu")


@pytest.mark.slow
def test_minilm_split_equals_unsplit_and_sentence_transformers(minilm):
    from sentence_transformers import SentenceTransformer

    texts = ["privlm keeps your text on your machine.", "The cat sat on the mat.",
             "Differential privacy bounds what any single token can reveal about the input."]
    assert (minilm.family, minilm.pooling, minilm.normalize) == ("encoder", "mean", True)
    assert (minilm.hidden_size, minilm.vocab_size, minilm.max_length) == (384, 30522, 256)
    batch = minilm.tokenize(texts)
    with torch.no_grad():
        split = minilm.encode(minilm.embed_tokens(batch.input_ids), batch.attention_mask)
        unsplit = minilm.forward_ids(batch.input_ids, batch.attention_mask)
        plain = AutoModel.from_pretrained(str(minilm.model.config._name_or_path))
        hidden = plain(input_ids=batch.input_ids, attention_mask=batch.attention_mask).last_hidden_state
    torch.testing.assert_close(split, unsplit, atol=ATOL, rtol=0)
    weights = batch.attention_mask.unsqueeze(-1).float()
    manual = torch.nn.functional.normalize((hidden * weights).sum(1) / weights.sum(1), dim=-1)
    torch.testing.assert_close(split, manual, atol=ATOL, rtol=0)
    st = SentenceTransformer(str(minilm.model.config._name_or_path), device="cpu")
    torch.testing.assert_close(split, torch.from_numpy(st.encode(texts)), atol=ATOL, rtol=0)


@pytest.mark.slow
def test_smollm2_is_a_tied_causal_lm_and_splits_exactly(smollm2):
    assert (smollm2.family, smollm2.pooling, smollm2.vocab_size, smollm2.hidden_size) == ("decoder", "last",
                                                                                          49152, 576)
    assert smollm2.model.config.tie_word_embeddings
    assert torch.equal(smollm2.model.get_output_embeddings().weight, smollm2.embedding_matrix)
    batch = smollm2.tokenize(["Hello, how are you?", "Private prompts stay private."])
    with torch.no_grad():
        split = smollm2.encode(smollm2.embed_tokens(batch.input_ids), batch.attention_mask)
        unsplit = smollm2.forward_ids(batch.input_ids, batch.attention_mask)
    torch.testing.assert_close(split, unsplit, atol=ATOL, rtol=0)
