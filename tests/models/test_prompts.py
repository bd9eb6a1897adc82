"""Prompt tokens for token-level mechanisms: the non-sensitive rule, unknown tokens, uncovered text."""

from __future__ import annotations

import string

import pytest
from transformers import BertTokenizerFast

from privlm.models.prompts import NonSensitiveTokens, tokenize_prompt
from tests.models.tiny import WORDS


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from transformers import AutoTokenizer

    from privlm.models.loading import materialise_gguf
    from privlm.models.sources import smollm2_source

    return AutoTokenizer.from_pretrained(materialise_gguf(smollm2_source()), local_files_only=True)


@pytest.fixture(scope="module")
def wordpiece() -> BertTokenizerFast:
    vocab = [*WORDS, "bos", "##ton", "i", "us", "don", "'", "t", "!", "##s"]
    return BertTokenizerFast(vocab={w: i for i, w in enumerate(vocab)}, do_lower_case=False)


def flags(prompt) -> dict[str, bool]:
    return {prompt.piece(i).strip(): prompt.non_sensitive[i] for i in range(len(prompt))}


def test_the_shipped_list_is_nltk_english_and_ascii_punctuation():
    rules = NonSensitiveTokens.english()
    assert len(rules.words) == 179 and rules.punctuation == frozenset(string.punctuation)
    assert {"the", "i", "don't", "mightn't", "ourselves", "y"} <= rules.words
    assert "boston" not in rules.words


def test_stopwords_and_punctuation_are_kept_and_other_words_are_sensitive(smollm2_tokenizer):
    prompt = tokenize_prompt(smollm2_tokenizer, "The lawyer I met in Boston said: no!!")
    kept = flags(prompt)
    assert kept["The"] and kept["I"] and kept["in"] and kept["no"] and kept[":"] and kept["!!"]
    assert not kept["lawyer"] and not kept["Boston"] and not kept["met"] and not kept["said"]


def test_a_stopword_in_another_case_than_sentence_case_is_sensitive(smollm2_tokenizer):
    kept = flags(tokenize_prompt(smollm2_tokenizer, "It was IT and it"))
    assert kept["It"] and kept["was"] and kept["and"] and kept["it"]
    assert not kept["IT"]  # "IT" is not "it": an acronym may name something


def test_a_piece_of_a_longer_word_is_sensitive_even_when_its_text_is_a_stopword(smollm2_tokenizer, wordpiece):
    prompt = tokenize_prompt(smollm2_tokenizer, "I don't know")
    pieces = {prompt.piece(i).strip(): prompt.non_sensitive[i] for i in range(len(prompt))}
    assert pieces["don"] is False and pieces["'t"] is False  # "don" is a stopword, but here a piece of "don't"
    bert = tokenize_prompt(wordpiece, "boston")
    assert [bert.piece(i) for i in range(len(bert))] == ["bos", "ton"]
    assert bert.non_sensitive == (False, False)


def test_special_token_text_in_a_prompt_stays_text(smollm2_tokenizer):
    prompt = tokenize_prompt(smollm2_tokenizer, "hi <|im_start|> there")
    special = set(smollm2_tokenizer.all_special_ids)
    assert not special & set(prompt.ids)
    assert smollm2_tokenizer.decode(list(prompt.ids)) == "hi <|im_start|> there"


def test_every_character_is_covered_or_reported(smollm2_tokenizer, wordpiece):
    text = "Café 😀 naïve"
    prompt = tokenize_prompt(smollm2_tokenizer, text)
    assert prompt.uncovered == () and not any(prompt.unknown)
    assert smollm2_tokenizer.decode(list(prompt.ids)) == text  # byte-level BPE represents everything
    bert = tokenize_prompt(wordpiece, "the zebra sat")  # "zebra" is not in the tiny vocabulary
    unknown = [bert.piece(i) for i in range(len(bert)) if bert.unknown[i]]
    assert unknown == ["zebra"]
    assert not bert.non_sensitive[bert.unknown.index(True)]  # an unknown token is sensitive


def test_characters_the_normaliser_drops_are_reported_as_uncovered(wordpiece):
    text = "the \u200b\u200bcat"  # zero-width spaces: BERT's normaliser drops them
    prompt = tokenize_prompt(wordpiece, text)
    covered = "".join(prompt.piece(i) for i in range(len(prompt)))
    assert "\u200b" not in covered
    assert prompt.uncovered and all(set(text[s:e]) <= {"\u200b", "c", "a", "t"} for s, e in prompt.uncovered)


def test_a_tokenizer_without_character_offsets_is_refused():
    class Slow:
        is_fast = False

    with pytest.raises(ValueError, match="fast tokenizer"):
        tokenize_prompt(Slow(), "the cat")  # type: ignore[arg-type]


@pytest.mark.parametrize("content, message", [
    ("the\n", "before any"),
    ("[stopwords]\nthe\n[other]\n", "unknown section"),
    ("[punctuation]\n!!\n", "one character"),
])
def test_a_malformed_list_is_refused_with_its_line(content, message):
    with pytest.raises(ValueError, match=message):
        NonSensitiveTokens.parse(content)


def test_a_custom_list_is_used(smollm2_tokenizer):
    rules = NonSensitiveTokens.parse("# mine\n[stopwords]\nBoston\n[punctuation]\n#\n")
    kept = flags(tokenize_prompt(smollm2_tokenizer, "the Boston #", rules))
    assert kept == {"the": False, "Boston": True, "#": True}
