"""The candidate vocabulary, the device language model and the shared report of token-level mechanisms."""

from __future__ import annotations

import pytest
import torch
from transformers import BertTokenizerFast

from privlm.models.perturbation import TokenOutcome, released_text, token_records
from privlm.models.prompts import tokenize_prompt
from privlm.models.vocabulary import CandidateVocabulary, special_token_ids
from tests.models.tiny import WORDS


@pytest.fixture(scope="module")
def tiny_vocabulary() -> CandidateVocabulary:
    tokenizer = BertTokenizerFast(vocab={w: i for i, w in enumerate(WORDS)})
    table = torch.randn(len(WORDS) + 3, 8, generator=torch.Generator().manual_seed(1))  # 3 padding rows
    return CandidateVocabulary.from_tokenizer(tokenizer, table)


def test_candidates_are_every_token_but_the_special_ones_and_the_padding_rows(tiny_vocabulary):
    special = special_token_ids(tiny_vocabulary.tokenizer)
    assert special == {0, 1, 2, 3, 4}  # [PAD] [UNK] [CLS] [SEP] [MASK]
    assert tiny_vocabulary.candidate_ids.tolist() == list(range(5, len(WORDS)))
    assert tiny_vocabulary.size == len(WORDS) - 5
    index = tiny_vocabulary.candidate_index
    assert index[5].item() == 0 and index[0].item() == -1 and index[len(WORDS) + 1].item() == -1


def test_distances_are_euclidean_to_every_candidate(tiny_vocabulary):
    ids = torch.tensor([1, 6, 9])  # [UNK] is no candidate, but it has a row and a distance
    expected = torch.cdist(tiny_vocabulary.rows_of(ids), tiny_vocabulary.candidate_embeddings)
    torch.testing.assert_close(tiny_vocabulary.distances(ids), expected, atol=1e-5, rtol=1e-5)
    assert tiny_vocabulary.distances(ids)[1, 1].item() == pytest.approx(0.0, abs=1e-3)  # id 6 is candidate 1


def test_the_fingerprint_changes_with_the_rows(tiny_vocabulary):
    other = CandidateVocabulary.from_tokenizer(tiny_vocabulary.tokenizer, tiny_vocabulary.embeddings + 1e-3)
    same = CandidateVocabulary.from_tokenizer(tiny_vocabulary.tokenizer, tiny_vocabulary.embeddings.clone())
    assert other.fingerprint != tiny_vocabulary.fingerprint == same.fingerprint


def test_a_table_smaller_than_the_tokenizer_is_refused(tiny_vocabulary):
    with pytest.raises(ValueError, match="embedding table"):
        CandidateVocabulary.from_tokenizer(tiny_vocabulary.tokenizer, torch.zeros(5, 8))


def test_records_give_every_token_its_outcome_and_text(tiny_vocabulary):
    prompt = tokenize_prompt(tiny_vocabulary.tokenizer, "the cat sat")
    released = [prompt.ids[0], 11, prompt.ids[2]]  # "cat" -> "dog"
    outcomes = [TokenOutcome.NON_SENSITIVE, TokenOutcome.PERTURBED, TokenOutcome.PERTURBED]
    records = token_records(prompt, tiny_vocabulary, released, outcomes, epsilon=[None, 2.0, 2.0])
    assert [r.original for r in records] == ["the", "cat", "sat"]
    assert [r.released for r in records] == ["the", "dog", "sat"]
    assert [r.changed for r in records] == [False, True, False]
    assert released_text(tiny_vocabulary, released) == "the dog sat"
    with pytest.raises(ValueError, match="one released id"):
        token_records(prompt, tiny_vocabulary, released[:2], outcomes)
    with pytest.raises(ValueError, match="finite"):
        token_records(prompt, tiny_vocabulary, released, outcomes, epsilon=[None, float("nan"), 1.0])


@pytest.mark.slow
def test_smollm2_as_a_causal_device_model(smollm2_lm):
    lm = smollm2_lm
    assert lm.kind == "causal" and lm.context_length == 8192
    assert lm.vocabulary.size == 49152 - 17  # 17 special tokens (<|endoftext|>, <|im_start|>, ... <empty_output>)
    assert len(lm.weights_fingerprint) == 64


def test_a_masked_device_model_needs_a_mask_token(tmp_path):
    from transformers import BertConfig, BertForMaskedLM

    from privlm.models.language import LanguageModel

    model = BertForMaskedLM(BertConfig(vocab_size=len(WORDS), hidden_size=8, num_hidden_layers=1,
                                       num_attention_heads=2, intermediate_size=8))
    no_mask = BertTokenizerFast(vocab={w: i for i, w in enumerate(WORDS) if w != "[MASK]"} | {"extra": 4},
                                mask_token=None)
    with pytest.raises(ValueError, match="mask token"):
        LanguageModel(model=model, tokenizer=no_mask, kind="masked")
    with_mask = BertTokenizerFast(vocab={w: i for i, w in enumerate(WORDS)})
    lm = LanguageModel(model=model, tokenizer=with_mask, kind="masked")
    assert lm.vocabulary.size == len(WORDS) - 5
    model.save_pretrained(tmp_path)
    with_mask.save_pretrained(tmp_path)
    loaded = LanguageModel.from_pretrained(tmp_path, device="cpu")
    assert loaded.kind == "masked" and loaded.weights_fingerprint == lm.weights_fingerprint
    with pytest.raises(ValueError, match="cannot be loaded as a causal"):
        LanguageModel.from_pretrained(tmp_path, device="cpu", kind="causal")
