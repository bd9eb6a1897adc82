"""The hand-written evaluation set of ``privlm bench detect`` (issue 39): well-formed markup, valid kinds and genres,
spans on word boundaries, and enough spans of each kind for a per-kind recall to mean something."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest

SET_FILE = Path(__file__).parents[2] / "benchmarks" / "detect" / "handwritten.txt"
COMMON_KINDS = (
    "person",
    "organization",
    "location",
    "age",
    "date",
    "amount",
    "contact",
    "identifier",
    "health",
    "medication",
    "occupation",
)
RARE_KINDS = ("religion", "ethnicity", "sexuality", "union", "address")
KINDS = frozenset(COMMON_KINDS + RARE_KINDS)
GENRES = frozenset({"email", "form", "clinical", "chat", "list", "letter", "message", "note", "other"})
HEADER = re.compile(r"^## (\S+) (\S+)$")
SPAN = re.compile(r"\[\[([^\[\]|]*)\|([^\[\]|]*)\]\]")


@dataclass(frozen=True)
class MarkedPrompt:
    prompt_id: str
    genre: str
    markup: str
    text: str
    spans: tuple[tuple[int, int, str], ...]


def unmark(markup: str) -> tuple[str, tuple[tuple[int, int, str], ...]]:
    """The plain text of a marked prompt and its spans as (start, end, kind) in that text."""
    parts: list[str] = []
    spans: list[tuple[int, int, str]] = []
    position, length = 0, 0
    for match in SPAN.finditer(markup):
        parts.append(markup[position : match.start()])
        length += match.start() - position
        spans.append((length, length + len(match.group(1)), match.group(2)))
        parts.append(match.group(1))
        length += len(match.group(1))
        position = match.end()
    parts.append(markup[position:])
    return "".join(parts), tuple(spans)


def parse_set(raw: str) -> list[MarkedPrompt]:
    """Split the file at its `## <id> <genre>` headers; a prompt's trailing blank lines are not part of it."""
    blocks: list[tuple[str, str, list[str]]] = []
    for line in raw.splitlines():
        header = HEADER.match(line)
        if header:
            blocks.append((header.group(1), header.group(2), []))
        elif blocks:
            blocks[-1][2].append(line)
    prompts = []
    for prompt_id, genre, lines in blocks:
        markup = "\n".join(lines).rstrip()
        text, spans = unmark(markup)
        prompts.append(MarkedPrompt(prompt_id, genre, markup, text, spans))
    return prompts


@pytest.fixture(scope="module")
def prompts() -> list[MarkedPrompt]:
    return parse_set(SET_FILE.read_text(encoding="utf-8"))


def inside_word(text: str, index: int) -> bool:
    """Whether a cut at `index` falls between two letters or digits of one word."""
    return 0 < index < len(text) and text[index - 1].isalnum() and text[index].isalnum()


def test_the_set_has_at_least_180_prompts_with_unique_ids_and_known_genres(prompts: list[MarkedPrompt]) -> None:
    assert len(prompts) >= 180
    ids = [p.prompt_id for p in prompts]
    assert len(set(ids)) == len(ids), [i for i, n in Counter(ids).items() if n > 1]
    assert {p.genre for p in prompts} <= GENRES, {p.genre for p in prompts} - GENRES
    assert all(p.text.strip() for p in prompts)


def test_the_markup_is_well_formed_and_every_kind_is_known(prompts: list[MarkedPrompt]) -> None:
    for prompt in prompts:
        leftover = SPAN.sub("", prompt.markup)
        assert "[[" not in leftover and "]]" not in leftover, (prompt.prompt_id, leftover)
        kinds = {kind for _, _, kind in prompt.spans}
        assert kinds <= KINDS, (prompt.prompt_id, kinds - KINDS)


def test_no_span_is_empty_padded_or_cut_inside_a_word(prompts: list[MarkedPrompt]) -> None:
    for prompt in prompts:
        for start, end, kind in prompt.spans:
            surface = prompt.text[start:end]
            assert surface.strip() == surface != "", (prompt.prompt_id, surface, kind)
            assert not inside_word(prompt.text, start), (prompt.prompt_id, surface)
            assert not inside_word(prompt.text, end), (prompt.prompt_id, surface)


def test_every_kind_has_enough_spans_to_measure(prompts: list[MarkedPrompt]) -> None:
    counts = Counter(kind for prompt in prompts for _, _, kind in prompt.spans)
    assert {kind: counts[kind] for kind in COMMON_KINDS if counts[kind] < 20} == {}
    assert {kind: counts[kind] for kind in RARE_KINDS if counts[kind] < 8} == {}


def test_the_set_holds_lower_case_prompts_and_prompts_without_details(prompts: list[MarkedPrompt]) -> None:
    lower = [p for p in prompts if p.text == p.text.lower() and any(c.isalpha() for c in p.text)]
    assert len(lower) >= 20
    without = [p for p in prompts if not p.spans]
    assert 0.10 <= len(without) / len(prompts) <= 0.15


def test_unmark_puts_each_span_over_its_surface_text() -> None:
    text, spans = unmark("Hi [[Zoë|person]], I'm [[34|age]].")
    assert text == "Hi Zoë, I'm 34."
    assert [(text[s:e], k) for s, e, k in spans] == [("Zoë", "person"), ("34", "age")]
    assert inside_word("19F", 2) and not inside_word("34-year", 2)
