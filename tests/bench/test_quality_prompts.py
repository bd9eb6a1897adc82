"""The prompts of ``privlm bench chat-quality`` (issue 24): personal spans marked exactly, a split by template,
and the committed file that the generator writes byte for byte."""

from __future__ import annotations

import string
from collections import Counter
from pathlib import Path

import pytest

from privlm_bench.chat.quality_prompts import (
    CONDITION_DROPS,
    KINDS,
    OCCUPATION_DROPS,
    PROMPTS_FILE,
    TEMPLATES,
    QualityPrompt,
    Span,
    generate_prompts,
    read_prompts,
    split_prompts,
    wordnet_conditions,
    wordnet_occupations,
    wordnet_places,
    write_prompts,
)

COMMITTED = Path(__file__).parents[2] / PROMPTS_FILE


@pytest.fixture(scope="module")
def committed() -> tuple[list[QualityPrompt], list[QualityPrompt]]:
    return read_prompts(COMMITTED)


def test_the_set_has_300_distinct_prompts_from_25_templates_of_2_to_5_slots(committed):
    prompts = committed[0] + committed[1]
    assert len(prompts) >= 300
    assert len({p.text for p in prompts}) == len(prompts)
    assert len(TEMPLATES) >= 25 and len(dict(TEMPLATES)) == len(TEMPLATES)
    for _, template in TEMPLATES:
        assert 2 <= sum(field is not None for _, field, _, _ in string.Formatter().parse(template)) <= 5, template
    assert {p.template for p in prompts} == {template_id for template_id, _ in TEMPLATES}


def test_spans_are_exact_disjoint_and_each_kind_marked_at_least_30_times(committed):
    kinds: Counter[str] = Counter()
    for p in committed[0] + committed[1]:
        end = 0
        for span in p.spans:
            assert span.kind in KINDS
            assert p.text[span.start : span.end] == span.text, (p.text, span)
            assert span.text and span.text == span.text.strip()
            assert span.start >= end, f"spans overlap or are out of order in {p.text!r}"
            end = span.end
            kinds[span.kind] += 1
        assert 2 <= len(p.spans) <= 5
    assert set(kinds) == set(KINDS)
    assert min(kinds.values()) >= 30, kinds


def test_the_split_is_by_template_with_at_least_100_prompts_on_each_side(committed):
    train, test = committed
    assert len(train) >= 100 and len(test) >= 100
    assert not {p.template for p in train} & {p.template for p in test}
    # split_prompts gives the committed split back from the prompts alone, and splits by template for any seed.
    assert split_prompts(train + test) == (train, test)
    for seed in range(5):
        a, b = split_prompts(train + test, test_fraction=0.3, seed=seed)
        assert len(a) + len(b) == len(train) + len(test)
        assert a and b and not {p.template for p in a} & {p.template for p in b}
    with pytest.raises(ValueError, match="test_fraction"):
        split_prompts(train, test_fraction=1.0)


def test_read_gives_back_what_write_wrote(committed, tmp_path):
    write_prompts(tmp_path / "prompts.jsonl", *committed)
    assert read_prompts(tmp_path / "prompts.jsonl") == committed
    assert (tmp_path / "prompts.jsonl").read_bytes() == COMMITTED.read_bytes()


def test_a_span_that_does_not_match_its_text_is_refused():
    with pytest.raises(ValueError, match="exact"):
        QualityPrompt("I live in Leeds.", (Span(10, 15, "place", "Leedz"),), "x")
    with pytest.raises(ValueError, match="exact"):  # overlapping
        QualityPrompt("Maria Smith", (Span(0, 11, "name", "Maria Smith"), Span(6, 11, "name", "Smith")), "x")
    with pytest.raises(ValueError, match="kind"):
        QualityPrompt("Maria", (Span(0, 5, "pet", "Maria"),), "x")


def test_the_committed_file_is_what_the_generator_writes(tmp_path):
    write_prompts(tmp_path / "prompts.jsonl")
    assert (tmp_path / "prompts.jsonl").read_bytes() == COMMITTED.read_bytes(), (
        "regenerate it: python -c 'from privlm_bench.chat.quality_prompts import write_prompts, PROMPTS_FILE; "
        "write_prompts(PROMPTS_FILE)'")


def test_generation_is_fixed_by_the_seed():
    once, again, other = generate_prompts(120, seed=7), generate_prompts(120, seed=7), generate_prompts(120, seed=8)
    assert once == again
    assert [p.template for p in once] == [p.template for p in other]  # templates are dealt in turn
    assert len({p.text for p in once} & {p.text for p in other}) < 10


def test_the_word_lists_come_from_the_wordnet_walk():
    places, conditions, occupations = wordnet_places(), wordnet_conditions(), wordnet_occupations()
    assert len(places) > 500 and len(conditions) > 500 and len(occupations) > 150
    assert {"Seattle", "London", "Nairobi"} <= set(places) and "Troy" not in places  # Troy is glossed ancient
    assert {"diabetes", "asthma", "rabies"} <= set(conditions)  # rabies: a zoonosis, kept
    assert not {"chestnut blight", "canine distemper"} & set(conditions)  # plant and animal diseases
    assert {"nurse", "plumber", "cardiologist"} <= set(occupations) and "soldier" not in occupations
    assert not CONDITION_DROPS & set(conditions) and not OCCUPATION_DROPS & set(occupations)
    for words, max_words in ((conditions, 3), (occupations, 2)):
        assert all(w == w.lower() and w.isascii() and len(w.split()) <= max_words for w in words)
        assert not any(c.isdigit() for w in words for c in w)
    assert all(p.isascii() and "_" not in p and not any(c.isdigit() for c in p) for p in places)
