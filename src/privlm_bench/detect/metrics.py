"""The scores of ``privlm bench detect``, read as a redactor needs them: only letters and digits count (a space or a
comma left out of a detected span leaks nothing).

Per gold span, with the characters the detected spans cover (of any kind: a redactor removes them all):
- caught: every alphanumeric character of the span is covered;
- typed: caught, and the detected span covering most of its alphanumeric characters has the gold kind (ties: the
  one that starts first);
- verbatim: none is covered (the value goes upstream whole); partly: some but not all.
Per detected span, correct: it shares at least one alphanumeric character with some gold span (of any kind).
Per character, char precision: of the alphanumeric characters inside detected spans, the share inside gold spans
(what a span over-redacts beyond a detail counts against it, which span precision does not see).
Per prompt with gold spans, leaking: at least one of them not caught.

Every share comes with its 95% Clopper-Pearson interval (:func:`privlm.attacks.clopper_pearson_lower` and
``_upper`` at 2.5% each side).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from privlm.attacks import clopper_pearson_lower, clopper_pearson_upper
from privlm.detect import Kind, Span
from privlm_bench.detect.data import GoldPrompt, GoldSpan

SIDE = 0.025  # each tail of a two-sided 95% interval
SPAN_MEASURES = ("recall", "typed_recall", "verbatim", "partly")


@dataclass(frozen=True)
class Rate:
    """``hits`` of ``trials``, with its 95% Clopper-Pearson interval (NaN without trials)."""

    hits: int
    trials: int

    @property
    def rate(self) -> float:
        return self.hits / self.trials if self.trials else math.nan

    def interval(self) -> tuple[float, float]:
        if not self.trials:
            return math.nan, math.nan
        return (float(clopper_pearson_lower(self.hits, self.trials, SIDE)),
                float(clopper_pearson_upper(self.hits, self.trials, SIDE)))

    def as_dict(self) -> dict[str, float | int]:
        low, high = self.interval()
        return {"hits": self.hits, "n": self.trials, "rate": self.rate, "low": low, "high": high}


@dataclass(frozen=True)
class SpanOutcome:
    """How one gold span fared: alphanumeric characters covered of those it has, and whether it is typed right."""

    kind: Kind
    covered: int
    alnum: int
    typed: bool

    @property
    def caught(self) -> bool:
        return self.covered == self.alnum

    @property
    def verbatim(self) -> bool:
        return self.covered == 0

    @property
    def partly(self) -> bool:
        return 0 < self.covered < self.alnum


def alnum_positions(text: str, start: int, end: int) -> list[int]:
    return [i for i in range(start, end) if text[i].isalnum()]


def judge_spans(text: str, gold: Sequence[GoldSpan], detected: Sequence[Span]) -> list[SpanOutcome]:
    """Each gold span's outcome against the detected spans of the same text."""
    covered = bytearray(len(text))
    for span in detected:
        covered[span.start:span.end] = b"\x01" * (min(span.end, len(text)) - span.start)
    outcomes = []
    for marked in gold:
        positions = alnum_positions(text, marked.start, marked.end)
        hit = sum(covered[i] for i in positions)
        outcomes.append(SpanOutcome(marked.kind, hit, len(positions),
                                    hit == len(positions) and _main_kind(positions, detected) == marked.kind))
    return outcomes


def _main_kind(positions: Sequence[int], detected: Sequence[Span]) -> Kind | None:
    """The kind of the detected span that covers most of ``positions`` (ties: the first to start)."""
    best, best_overlap = None, 0
    for span in sorted(detected, key=lambda s: (s.start, s.end)):
        overlap = sum(span.start <= i < span.end for i in positions)
        if overlap > best_overlap:
            best, best_overlap = span.kind, overlap
    return best


def detected_characters(text: str, gold: Sequence[GoldSpan], detected: Sequence[Span]) -> tuple[int, int]:
    """The alphanumeric characters inside ``detected`` spans that lie inside ``gold`` spans, and all of them."""
    marked = {i for span in gold for i in alnum_positions(text, span.start, span.end)}
    covered = {i for span in detected for i in alnum_positions(text, span.start, min(span.end, len(text)))}
    return len(covered & marked), len(covered)


def correct_detections(text: str, gold: Sequence[GoldSpan], detected: Sequence[Span]) -> list[bool]:
    """Whether each detected span shares an alphanumeric character with some gold span."""
    marked = {i for span in gold for i in alnum_positions(text, span.start, span.end)}
    return [any(i in marked for i in range(span.start, span.end)) for span in detected]


@dataclass
class _Tally:
    """Counts of one kind (or of all kinds)."""

    spans: int = 0
    caught: int = 0
    typed: int = 0
    verbatim: int = 0
    partly: int = 0
    detected: int = 0
    correct: int = 0

    def add_outcome(self, outcome: SpanOutcome) -> None:
        self.spans += 1
        self.caught += outcome.caught
        self.typed += outcome.typed
        self.verbatim += outcome.verbatim
        self.partly += outcome.partly

    def span_rates(self) -> dict[str, dict[str, float | int]]:
        counts = {"recall": self.caught, "typed_recall": self.typed, "verbatim": self.verbatim, "partly": self.partly}
        return {name: Rate(hits, self.spans).as_dict() for name, hits in counts.items()}

    def precision(self) -> dict[str, float | int]:
        return Rate(self.correct, self.detected).as_dict()


def score(prompts: Sequence[GoldPrompt], detections: Sequence[Sequence[Span]]) -> dict[str, Any]:
    """Every measure, overall and per kind: ``overall`` (the span measures, precision, prompts leaking),
    ``kinds`` (the span measures per gold kind) and ``precision_kinds`` (precision per detected kind)."""
    if len(prompts) != len(detections):
        raise ValueError(f"{len(detections)} detections for {len(prompts)} prompts")
    overall, by_gold, by_detected = _Tally(), {k: _Tally() for k in Kind}, {k: _Tally() for k in Kind}
    leaking, with_gold, gold_characters, detected_chars = 0, 0, 0, 0
    for prompt, found in zip(prompts, detections, strict=True):
        outcomes = judge_spans(prompt.text, prompt.spans, found)
        for outcome in outcomes:
            overall.add_outcome(outcome)
            by_gold[outcome.kind].add_outcome(outcome)
        for span, correct in zip(found, correct_detections(prompt.text, prompt.spans, found), strict=True):
            for tally in (overall, by_detected[span.kind]):
                tally.detected += 1
                tally.correct += correct
        inside, covered = detected_characters(prompt.text, prompt.spans, found)
        gold_characters, detected_chars = gold_characters + inside, detected_chars + covered
        with_gold += bool(outcomes)
        leaking += any(not o.caught for o in outcomes)
    return {"overall": {**overall.span_rates(), "precision": overall.precision(),
                        "char_precision": Rate(gold_characters, detected_chars).as_dict(),
                        "prompts_leaking": Rate(leaking, with_gold).as_dict()},
            "kinds": {k.value: t.span_rates() for k, t in by_gold.items() if t.spans},
            "precision_kinds": {k.value: t.precision() for k, t in by_detected.items() if t.detected}}
