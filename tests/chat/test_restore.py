"""Restoring answers (privlm.chat.restore), without HTTP: which replacements are restored, where, and a
stream restored piece by piece equals the whole answer restored at once."""

from __future__ import annotations

import random

import pytest

from privlm.chat.restore import Restorer, replaced_spans
from tests.support.chat import NamePerturber

PROMPT = "My friend Maria Gonzalez moved from Rotterdam to the city."


def release(text: str) -> tuple[str, Restorer, list[tuple[str, str]]]:
    """``text`` through the test mechanism: the released text, its restorer, and its (released, original) pairs."""
    [perturbed] = NamePerturber(1.0, None, None, "t").perturb_batch([text])  # type: ignore[arg-type]
    pairs = [(s.released, s.original_in(text)) for s in replaced_spans(text, perturbed.report)]
    return perturbed.text, Restorer.of(pairs, [perturbed.text]), pairs


def test_a_run_of_replaced_tokens_and_each_of_its_words_are_replaced_spans():
    released, _, pairs = release(PROMPT)
    assert released == "My friend Jake Rodriguez moved from Denver to the city."
    assert pairs == [("Jake Rodriguez", "Maria Gonzalez"), ("Jake", "Maria"), ("Rodriguez", "Gonzalez"),
                     ("Denver", "Rotterdam")]


def test_spans_hold_offsets_into_the_original_and_no_original_text():
    [perturbed] = NamePerturber(1.0, None, None, "t").perturb_batch([PROMPT])  # type: ignore[arg-type]
    spans = replaced_spans(PROMPT, perturbed.report)
    assert next((s.start, s.end) for s in spans) == (PROMPT.index("Maria"), PROMPT.index(" moved"))
    assert all("Maria" not in s.released and "Rotterdam" not in s.released for s in spans)


def test_an_answer_is_restored_at_word_boundaries_longest_first():
    _, restorer, _ = release(PROMPT)
    answer = "Jake Rodriguez is in Denver. Jake, Rodriguez! Jakeson and DenverX stay; jake is not Jake."
    restored, count = restorer.restore(answer)
    assert restored == ("Maria Gonzalez is in Rotterdam. Maria, Gonzalez! Jakeson and DenverX stay; jake is not "
                        "Maria.")
    assert count == 5


def test_a_replacement_that_is_a_stopword_too_short_or_ambiguous_is_not_restored():
    restorer = Restorer.of([("the", "Boston"), ("J", "Joe"), ("Tom", "Anna"), ("Tom", "Eva"), ("Ann", "Eve")],
                           ["the Tom J Ann"])
    assert restorer.forward == {"Ann": "Eve"}
    assert restorer.restore("the Tom J Ann") == ("the Tom J Eve", 1)


def test_a_replacement_the_upstream_also_saw_unchanged_is_not_restored():
    """"Paris" replaced "Lisbon", but the prompt also says Paris: an answer's "Paris" may be either."""
    released, restorer, _ = release("Lisbon is not Paris.")
    assert released == "Paris is not Paris." and "Paris" not in restorer.forward
    _, restorer, _ = release("Lisbon is lovely.")
    assert restorer.forward == {"Paris": "Lisbon"}


ANSWERS = ["Jake Rodriguez", "Dear Jake Rodriguez, Denver and Jake.", "Jake Rod", "Jake", "JakeJake Jake",
           "nothing here", "Denver, Denver; Den", "Jake Rodriguezz Jake Rodriguez", "é Jake ü Denverß"]


@pytest.mark.parametrize("answer", ANSWERS)
def test_a_stream_restored_piece_by_piece_equals_the_whole_answer_restored(answer):
    _, restorer, _ = release(PROMPT)
    expected, count = restorer.restore(answer)
    rng = random.Random(answer)  # a fixed seed per case: the splits are reproducible
    for _ in range(200):
        stream, out, at = restorer.stream(), [], 0
        while at < len(answer):
            step = rng.randint(1, 6)
            out.append(stream.feed(answer[at:at + step]))
            assert len(stream.pending) <= restorer.longest  # never more held than the longest replacement
            at += step
        out.append(stream.flush())
        assert "".join(out) == expected and stream.restored == count


def test_a_stream_holds_back_only_what_could_still_become_a_replacement():
    _, restorer, _ = release(PROMPT)
    stream = restorer.stream()
    assert stream.feed("Hello Ja") == "Hello "  # "Ja" may grow into "Jake"
    assert stream.feed("ck and ") == "Jack and "
    assert stream.feed("Jake") == ""  # "Jake" may be "Jake Rodriguez", or "Jakeson"
    assert stream.feed(" R") == ""
    assert stream.feed("ose") == "Maria Rose"
    assert stream.flush() == ""
    assert Restorer.of([], []).stream().feed("Jake R") == "Jake R"  # nothing to restore: nothing held


def test_overlapping_replacements_never_hold_more_than_the_longest():
    """"Jake Rodriguez" and "Rodriguez Street" overlap: "Jake Rodriguez Str" could still become either, but the
    stream holds at most 16 characters (the longest), passing the excess on as it is."""
    restorer = Restorer.of([("Jake Rodriguez", "Maria Gonzalez"), ("Rodriguez Street", "Baker Street")], [])
    stream = restorer.stream()
    passed = stream.feed("Jake Rodriguez Str")
    assert len(stream.pending) <= restorer.longest == 16
    assert passed + stream.pending == "Jake Rodriguez Str"
    assert passed + stream.feed("eet") + stream.flush() == "Jake Baker Street"  # the cut replacement stays
