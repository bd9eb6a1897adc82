"""Restoring answers: the gateway writes the user's own words back where the upstream's answer quotes a
replacement, locally and at no privacy cost (the answer is post-processed on this machine).

A token-level mechanism reports, for every token, its original and its release. A *replaced span* is a maximal
run of tokens that went through the mechanism and came out changed (" Maria Gonzalez" released as
" Jake Rodriguez"), and, when the run's word breaks agree on both sides, each of its words on its own ("Jake"
for "Maria"), because answers often use part of a name. Surrounding spaces are trimmed on both sides.

Which replacements may be restored, so that the upstream's own words are left alone:
  - the released side holds a letter or digit, is at least :data:`MIN_RESTORED_CHARS` characters, and is not made
    only of stopwords (the mechanisms' non-sensitive list): "the" or "is" in an answer is the upstream's own;
  - it maps to one original only (two names released as the same token: ambiguous, left as it is);
  - it does not also occur in the released texts as an unchanged word (counted, word-bounded): then the
    upstream could be quoting that one.
A replacement is matched in the answer case-sensitively and at word boundaries (never inside a longer word), the
longest first. The answer's word breaks are kept: a replacement that starts or ends with punctuation (" diabetes"
released as "-related") can touch a word of the answer ("and-related"), and its original is then written back
with a space on that side ("and diabetes", not "anddiabetes") if the original had one there (whitespace, or the
text's edge; every time the replacement occurs). A sub-word is not split: "ological" of "immunological" released
as ".com" restores "immun.com" to "immunological".

Streams: a chunk is passed on at once except its tail that could still grow into a replacement; the rest follows
with the next chunk, or at the end of the choice. Never more than the longest replacement's length is held: where
overlapping replacements would hold more, the excess is passed on, and a replacement it cuts is not restored.

The mapping holds original text: it lives in memory for one request and is never logged, stored or sent. Only
its offsets into the original and the released side (:class:`ReplacedSpan`) may be kept, by the conversation
memory, which holds no original text.
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import NamedTuple

from privlm.models.perturbation import PromptReport, TokenOutcome, TokenRecord
from privlm.models.prompts import NonSensitiveTokens

MIN_RESTORED_CHARS = 2
_RELEASED = (TokenOutcome.PERTURBED, TokenOutcome.UNKNOWN)
_WORD = re.compile(r"\w+")


@dataclass(frozen=True)
class ReplacedSpan:
    """``original[start:end]`` (trimmed) went up as ``released`` (trimmed). No original text is held."""

    start: int
    end: int
    released: str

    def original_in(self, text: str) -> str:
        return text[self.start:self.end]

    def replacement_in(self, text: str) -> Replacement:
        """This span of ``text``, the original it was made from, as :meth:`Restorer.of` takes it."""
        return Replacement(self.released, self.original_in(text),
                           (self.start == 0 or text[self.start - 1].isspace(),
                            self.end == len(text) or text[self.end].isspace()))


class Replacement(NamedTuple):
    """``original`` went up as ``released``; ``spaced``: whether the original had whitespace (or the text's edge)
    before it and after it, where a restored word may be given a space (a plain pair: neither)."""

    released: str
    original: str
    spaced: tuple[bool, bool] = (False, False)


def replaced_spans(original: str, report: PromptReport | None) -> tuple[ReplacedSpan, ...]:
    """Every replaced span of one perturbed text (runs of changed tokens, and their words), from its report. A
    report whose tokens cannot be aligned with the text (or none: a blank text, a rewritten prompt) gives none."""
    if report is None:
        return ()
    starts = _token_starts(original, report.tokens)
    if starts is None:
        return ()
    spans: list[ReplacedSpan] = []
    for run in _changed_runs(report.tokens):
        groups = [run]
        words = _word_groups(run)
        if len(words) > 1:
            groups += words
        for group in groups:
            span = _span(original, starts, group)
            if span is not None:
                spans.append(span)
    return tuple(spans)


def _token_starts(text: str, tokens: Sequence[TokenRecord]) -> list[int] | None:
    """Where each token's original text starts in ``text`` (tokens are in order and cover it but for what the
    tokenizer dropped), or None when they cannot be found in order."""
    starts, cursor = [], 0
    for token in tokens:
        at = text.find(token.original, cursor)
        if at < 0 or not token.original:
            return None
        starts.append(at)
        cursor = at + len(token.original)
    return starts


def _changed_runs(tokens: Sequence[TokenRecord]) -> list[list[TokenRecord]]:
    runs: list[list[TokenRecord]] = []
    previous = -2
    for token in tokens:
        if token.outcome in _RELEASED and token.changed:
            if token.position == previous + 1 and runs:
                runs[-1].append(token)
            else:
                runs.append([token])
            previous = token.position
    return runs


def _word_groups(run: list[TokenRecord]) -> list[list[TokenRecord]]:
    """The run split into words where a token starts with a space on both sides; [] when the sides disagree."""
    breaks = [i for i, token in enumerate(run) if i and token.released[:1].isspace()]
    if breaks != [i for i, token in enumerate(run) if i and token.original[:1].isspace()]:
        return []
    edges = [0, *breaks, len(run)]
    return [run[a:b] for a, b in pairwise(edges)]


def _span(text: str, starts: list[int], group: list[TokenRecord]) -> ReplacedSpan | None:
    first, last = group[0], group[-1]
    start, end = starts[first.position], starts[last.position] + len(last.original)
    while start < end and text[start].isspace():
        start += 1
    while end > start and text[end - 1].isspace():
        end -= 1
    released = "".join(token.released for token in group).strip()
    return ReplacedSpan(start, end, released) if start < end and released else None


class Restorer:
    """Restores answers for one request's replacements: ``forward`` released -> original, accepted as the module
    doc says; ``spaced`` released -> whether its original may be given a space before and after (none: neither).
    Nothing of it is cached beyond the object: it holds original text."""

    def __init__(self, forward: dict[str, str], spaced: dict[str, tuple[bool, bool]] | None = None) -> None:
        self.forward = forward
        self.spaced = spaced or {}
        self.forward_pattern = _pattern(forward)

    @classmethod
    def of(cls, pairs: Iterable[tuple[str, str] | Replacement], released_texts: Sequence[str]) -> Restorer:
        """From ``(released, original)`` pairs or :class:`Replacement` triples (one per replaced span, repeats
        included) and every released text of the request (to tell a replacement from a word the upstream also saw
        unchanged)."""
        replacements = [Replacement(*pair) for pair in pairs]
        originals: defaultdict[str, set[str]] = defaultdict(set)
        spaced: dict[str, tuple[bool, bool]] = {}
        replaced = Counter(replacement.released for replacement in replacements)
        for released, original, (before, after) in replacements:
            originals[released].add(original)
            was_before, was_after = spaced.get(released, (True, True))  # a space only where every one had it
            spaced[released] = (was_before and before, was_after and after)
        forward = {}
        for released, found in originals.items():
            unchanged_too = _occurrences(released, released_texts) > replaced[released]
            if len(found) == 1 and _restorable(released) and not unchanged_too:
                forward[released] = next(iter(found))
        return cls(forward, {released: spaced[released] for released in forward})

    @property
    def longest(self) -> int:
        """The most characters a stream may hold back: the longest restorable replacement."""
        return max(map(len, self.forward), default=0)

    def restore(self, text: str) -> tuple[str, int]:
        """``text`` with every replacement restored, and how many were."""
        return _substitute(self, text)

    def stream(self) -> StreamRestorer:
        return StreamRestorer(self)


def _restorable(released: str) -> bool:
    if len(released) < MIN_RESTORED_CHARS or not any(c.isalnum() for c in released):
        return False
    stopwords = NonSensitiveTokens.english().words
    return not all(word.lower() in stopwords for word in _WORD.findall(released))


def _occurrences(key: str, texts: Sequence[str]) -> int:
    pattern = _pattern({key: key})
    return 0 if pattern is None else sum(len(pattern.findall(text)) for text in texts)


def _pattern(mapping: dict[str, str]) -> re.Pattern[str] | None:
    """The keys, longest first, each matched at word boundaries where it starts or ends with a word character."""
    def bounded(key: str) -> str:
        return (r"(?<!\w)" if re.match(r"\w", key) else "") + re.escape(key) + \
            (r"(?!\w)" if re.match(r"\w", key[-1]) else "")
    keys = sorted(mapping, key=lambda k: (-len(k), k))
    return re.compile("|".join(map(bounded, keys))) if keys else None


def _substitute(restorer: Restorer, text: str) -> tuple[str, int]:
    if restorer.forward_pattern is None:
        return text, 0
    return restorer.forward_pattern.subn(lambda match: _written_back(match, restorer), text)


def _written_back(match: re.Match[str], restorer: Restorer) -> str:
    """The original of ``match``, with a space on each side where it would otherwise join a word of the answer
    that only the replacement's punctuation parted it from, and the original had a space there too."""
    original, text = restorer.forward[match.group()], match.string
    space_before, space_after = restorer.spaced.get(match.group(), (False, False))
    before, after = text[max(match.start() - 1, 0):match.start()], text[match.end():match.end() + 1]
    return (" " if space_before and _joins(before, original) else "") + original + \
        (" " if space_after and _joins(original, after) else "")


def _joins(left: str, right: str) -> bool:
    """Whether ``right`` written right after ``left`` would run two words together."""
    return bool(left and right and _WORD.match(left[-1]) and _WORD.match(right[0]))


class StreamRestorer:
    """One choice of a stream, restored as it comes: :meth:`feed` each delta, :meth:`flush` at the end."""

    def __init__(self, restorer: Restorer) -> None:
        self.restorer = restorer
        self.mapping, self.pattern, self.longest = restorer.forward, restorer.forward_pattern, restorer.longest
        self.prefixes = {key[:n] for key in self.mapping for n in range(1, len(key) + 1)}
        self.pending, self.before = "", ""  # text held back; the last character passed on (for word boundaries)
        self.restored = 0
        self.most_held = 0

    def feed(self, delta: str) -> str:
        """What may be passed on now of everything fed so far."""
        self.pending += delta
        if self.pattern is None:
            return self._pass(len(self.pending))
        cut = len(self.pending) - self._hold()
        for match in self.pattern.finditer(self.before + self.pending, len(self.before)):
            start, end = match.start() - len(self.before), match.end() - len(self.before)
            if end > cut:
                cut = min(cut, start)
                break
        cut = max(cut, len(self.pending) - self.longest)  # the bound the header states
        out = self._pass(cut)
        self.most_held = max(self.most_held, len(self.pending))
        return out

    def flush(self) -> str:
        """Everything still held, restored: the choice has ended."""
        return self._pass(len(self.pending))

    def _hold(self) -> int:
        """The longest tail of the pending text that could still grow into a replacement (or end one)."""
        for n in range(min(len(self.pending), max(map(len, self.prefixes), default=0)), 0, -1):
            if self.pending[-n:] in self.prefixes:
                return n
        return 0

    def _pass(self, cut: int) -> str:
        """The pending text up to ``cut``, restored (matches wholly before it; at the end, all of them)."""
        out, at, head = [], 0, self.pending[:cut]
        if self.pattern is not None:
            # A match passed on never ends the pending text unless the answer ends there (feed holds a whole
            # replacement back), so the character after it, which _written_back reads, is the whole answer's.
            for match in self.pattern.finditer(self.before + self.pending, len(self.before)):
                start, end = match.start() - len(self.before), match.end() - len(self.before)
                if end > cut:
                    break
                out += [head[at:start], _written_back(match, self.restorer)]
                at = end
                self.restored += 1
        out.append(head[at:])
        passed = "".join(out)
        if cut:
            self.before = self.pending[cut - 1]
        self.pending = self.pending[cut:]
        return passed
