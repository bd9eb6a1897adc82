"""The span type and the union of layers: whole words, merged overlaps, the kind that covers most."""

from __future__ import annotations

import pytest

from privlm.detect import Detector, Kind, Span, merge_spans, widen_to_words


def test_a_span_needs_a_non_empty_range_and_a_score_in_the_unit_interval() -> None:
    with pytest.raises(ValueError, match="start < end"):
        Span(3, 3, Kind.AGE, 1.0, "x")
    with pytest.raises(ValueError, match="score"):
        Span(0, 2, Kind.AGE, 1.5, "x")


@pytest.mark.parametrize(("start", "end", "expected"), [
    (7, 9, "Gonzalez"),  # inside a word: grown to the word
    (5, 9, "a Gonzalez"),  # from a word's last letter
    (4, 10, "a Gonzalez"),  # leading space trimmed
    (6, 16, "Gonzalez"),  # a space and the word: trimmed to the word
])
def test_a_span_is_widened_to_whole_words(start: int, end: int, expected: str) -> None:
    text = "Mari a Gonzalez, 34"
    a, b = widen_to_words(text, start, end)
    assert text[a:b] == expected


def test_overlapping_spans_merge_into_the_kind_that_covers_most_of_them() -> None:
    text = "She works at Seattle General Hospital."
    spans = [Span(13, 20, Kind.LOCATION, 1.0, "gazetteer:location"),
             Span(13, 37, Kind.ORGANIZATION, 0.6, "tagger")]
    (merged,) = merge_spans(text, spans)
    assert (text[merged.start:merged.end], merged.kind) == ("Seattle General Hospital", Kind.ORGANIZATION)
    assert merged.source == "gazetteer:location+tagger" and merged.score == 1.0


def test_same_kind_neighbours_split_by_spaces_are_one_span_and_others_stay_apart() -> None:
    text = "Maria Gonzalez, 34, Seattle"
    spans = [Span(0, 5, Kind.PERSON, 0.9, "a"), Span(6, 14, Kind.PERSON, 0.8, "b"), Span(16, 18, Kind.AGE, 1, "c"),
             Span(20, 27, Kind.LOCATION, 1.0, "d")]
    merged = merge_spans(text, spans)
    assert [(text[s.start:s.end], s.kind) for s in merged] == [
        ("Maria Gonzalez", Kind.PERSON), ("34", Kind.AGE), ("Seattle", Kind.LOCATION)]


def test_thresholds_drop_spans_below_their_kinds_level() -> None:
    text = "I take lithium with Grace"
    spans = [Span(7, 14, Kind.MEDICATION, 0.4, "t"), Span(20, 25, Kind.PERSON, 0.4, "t")]
    kept = merge_spans(text, spans, {Kind.MEDICATION: 0.3, Kind.PERSON: 0.5})
    assert [s.kind for s in kept] == [Kind.MEDICATION]


class _Fixed:
    name = "fixed"

    def __init__(self, spans: list[list[Span]]) -> None:
        self.spans = spans

    def detect(self, texts: list[str]) -> list[list[Span]]:
        return self.spans[:len(texts)]


def test_the_detector_is_the_union_of_its_layers_per_text() -> None:
    texts = ["Call Ana at home", "nothing here"]
    first = _Fixed([[Span(5, 8, Kind.PERSON, 1.0, "a")], []])
    second = _Fixed([[Span(12, 16, Kind.LOCATION, 0.2, "b")], [Span(0, 7, Kind.HEALTH, 0.9, "b")]])
    found = Detector([first, second], {Kind.LOCATION: 0.5}).detect(texts)
    assert [[(t[s.start:s.end], s.kind) for s in spans] for t, spans in zip(texts, found, strict=True)] == [
        [("Ana", Kind.PERSON)], [("nothing", Kind.HEALTH)]]
    with pytest.raises(ValueError, match="at least one layer"):
        Detector([])


def test_hyphenated_words_are_one_word_but_not_by_a_digit() -> None:
    text = "a long-haul driver, 34-year-old, 2015-2019"
    assert text[slice(*widen_to_words(text, 7, 11))] == "long-haul"  # from "haul"
    assert text[slice(*widen_to_words(text, 6, 11))] == "long-haul"  # from "-haul"
    assert text[slice(*widen_to_words(text, 20, 22))] == "34"
    assert text[slice(*widen_to_words(text, 33, 37))] == "2015"


def test_phrase_kinds_join_across_one_or_two_short_words_and_names_do_not() -> None:
    text = "Department for Work and Pensions; numbness in my left foot; Maria and Juan; Leeds and York"
    at = {word: (text.index(word), text.index(word) + len(word)) for word in (
        "Department", "Work", "Pensions", "numbness", "left foot", "Maria", "Juan", "Leeds", "York")}
    kinds = {"Department": Kind.ORGANIZATION, "Work": Kind.ORGANIZATION, "Pensions": Kind.ORGANIZATION,
             "numbness": Kind.HEALTH, "left foot": Kind.HEALTH, "Maria": Kind.PERSON, "Juan": Kind.PERSON,
             "Leeds": Kind.LOCATION, "York": Kind.LOCATION}
    spans = merge_spans(text, [Span(*at[w], kinds[w], 0.9, "test") for w in at])
    assert [text[s.start:s.end] for s in spans] == [
        "Department for Work and Pensions", "numbness in my left foot", "Maria", "Juan", "Leeds", "York"]
    far = "knee pain and then much later some back pain"  # more than two words, or a longer one, apart: two details
    back = far.index("back")
    assert len(merge_spans(far, [Span(0, 9, Kind.HEALTH, 0.9, "t"), Span(back, len(far), Kind.HEALTH, 0.9, "t")])) == 2
