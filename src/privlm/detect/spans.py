"""Typed spans of personal details: what every detection layer returns, and how layers combine.

A span is a half-open character range ``[start, end)`` of the *original* text, a kind, a score in [0, 1] and the
layer that found it (``source``: ``"pattern:phone"``, ``"gazetteer:health"``, ``"tagger"``). Offsets always refer
to the text the caller passed, whatever chunking or normalisation a layer did inside.

Combining layers is a union, recall first: every span at or above its kind's threshold is kept, widened to whole
words (a span never ends or starts inside a word), and spans that share a character are merged into one. The
merged span's kind is the one that covers the most of it, weighted by score (:func:`merge_spans`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol


class Kind(StrEnum):
    """What a span is. The special categories of GDPR's Article 9 beyond health each have their own kind, so that
    a mechanism can draw a replacement from that kind's own vocabulary."""

    PERSON = "person"  # a person's name, whole or in part
    ORGANIZATION = "organization"  # employers, schools, hospitals, banks, shops
    LOCATION = "location"  # cities, regions, countries, named places
    ADDRESS = "address"  # street addresses and postcodes
    AGE = "age"  # "34", "34-year-old", "aged 34", "70yo"
    DATE = "date"  # dates, birth dates, years
    AMOUNT = "amount"  # money, salaries and other amounts
    CONTACT = "contact"  # email addresses, phone numbers, URLs, social handles, IP addresses
    IDENTIFIER = "identifier"  # account, card, IBAN, national id, record and policy numbers
    HEALTH = "health"  # conditions, symptoms, procedures
    MEDICATION = "medication"
    OCCUPATION = "occupation"
    RELIGION = "religion"
    ETHNICITY = "ethnicity"
    SEXUALITY = "sexuality"  # sexual orientation
    UNION = "union"  # trade union membership


KINDS: tuple[Kind, ...] = tuple(Kind)


@dataclass(frozen=True, slots=True)
class Span:
    """A detected personal detail: ``text[start:end]`` is of ``kind``."""

    start: int
    end: int
    kind: Kind
    score: float
    source: str

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.end:
            raise ValueError(f"a span needs 0 <= start < end, got [{self.start}, {self.end})")
        if not 0.0 <= self.score <= 1.0:
            raise ValueError(f"a span's score lies in [0, 1], got {self.score}")

    def as_dict(self, text: str | None = None) -> dict[str, object]:
        row: dict[str, object] = {"start": self.start, "end": self.end, "kind": self.kind.value,
                                  "score": round(self.score, 4), "source": self.source}
        if text is not None:
            row["text"] = text[self.start:self.end]
        return row


class Layer(Protocol):
    """One way of finding spans (patterns, gazetteers, a tagger, a plugin's backend), batched."""

    name: str

    def detect(self, texts: Sequence[str]) -> list[list[Span]]: ...


def _is_word_char(char: str) -> bool:
    return char.isalnum() or char == "_"


def _in_word(text: str, i: int) -> bool:
    """Whether ``text[i]`` belongs to a word: a word character, or a hyphen between two letters ("long-haul",
    "Okafor-Lind"). Not a hyphen by a digit ("34-year-old": the age is "34"; "2015-2019": two years), nor an
    apostrophe ("Maria's": a name and a possessive)."""
    if _is_word_char(text[i]):
        return True
    return text[i] == "-" and 0 < i < len(text) - 1 and text[i - 1].isalpha() and text[i + 1].isalpha()


def widen_to_words(text: str, start: int, end: int) -> tuple[int, int]:
    """``[start, end)`` grown so that it neither starts nor ends inside a word (hyphenated words are one), then
    trimmed of surrounding space and of trailing clause punctuation (",;:!?"; a final "." may end an abbreviation,
    so it stays)."""
    while start > 0 and _in_word(text, start - 1) and _in_word(text, start):
        start -= 1
    while end < len(text) and _in_word(text, end - 1) and _in_word(text, end):
        end += 1
    while start < end and text[start].isspace():
        start += 1
    while end > start and (text[end - 1].isspace() or text[end - 1] in ",;:!?"):
        end -= 1
    return start, end


def merge_spans(text: str, spans: Iterable[Span], thresholds: Mapping[Kind, float] | None = None) -> list[Span]:
    """The union of ``spans``, in order: each at or above its kind's threshold (default 0), widened to whole words,
    with a letter or digit in it, overlapping ones merged. A merged span takes the kind with the most score-weighted
    characters (ties: the kind listed first in :class:`Kind`), its best member's score, and every member's source,
    sorted and joined by "+"."""
    kept = []
    for span in spans:
        if span.score < (thresholds or {}).get(span.kind, 0.0):
            continue
        start, end = widen_to_words(text, span.start, span.end)
        if any(char.isalnum() for char in text[start:end]):  # a lone "." or "-" reveals nothing
            kept.append(Span(start, end, span.kind, span.score, span.source))
    kept.sort(key=lambda s: (s.start, s.end))
    merged: list[Span] = []
    group: list[Span] = []
    for span in kept:
        if group and span.start >= max(s.end for s in group):
            merged.append(_merge_group(group))
            group = []
        group.append(span)
    if group:
        merged.append(_merge_group(group))
    return _join_words(text, merged)


# Kinds whose details are phrases with short words inside ("Department for Work and Pensions", "pain in my chest",
# "head of sales"): same-kind neighbours one or two such words apart are one detail. Names, places and the rest
# are not joined across words ("Maria and Juan" are two people).
PHRASE_KINDS = frozenset({Kind.ORGANIZATION, Kind.HEALTH, Kind.OCCUPATION, Kind.ADDRESS})
_PHRASE_GAP = re.compile(r"[ \t]+(?:[a-z]{1,4}[ \t]+){1,2}")


def _join_words(text: str, spans: list[Span]) -> list[Span]:
    # "Maria" and "Gonzalez" found apart are one name: same-kind neighbours with only spaces between become one
    # (or, for PHRASE_KINDS, one or two short lower-case words).
    joined: list[Span] = []
    for span in spans:
        last = joined[-1] if joined else None
        gap = text[last.end:span.start] if last is not None else ""
        if last is not None and last.kind == span.kind and (
                gap.strip(" \t") == "" or (span.kind in PHRASE_KINDS and _PHRASE_GAP.fullmatch(gap))):
            sources = "+".join(sorted(set(last.source.split("+")) | set(span.source.split("+"))))
            joined[-1] = Span(last.start, span.end, span.kind, max(last.score, span.score), sources)
        else:
            joined.append(span)
    return joined


def _merge_group(group: Sequence[Span]) -> Span:
    if len(group) == 1:
        return group[0]
    weight = {kind: 0.0 for kind in KINDS}
    for span in group:
        weight[span.kind] += span.score * (span.end - span.start)
    kind = max(KINDS, key=lambda k: (weight[k], -KINDS.index(k)))
    sources = "+".join(sorted({part for span in group for part in span.source.split("+")}))
    return Span(min(s.start for s in group), max(s.end for s in group), kind, max(s.score for s in group), sources)


__all__ = ["KINDS", "Kind", "Layer", "Span", "merge_spans", "widen_to_words"]
