"""What the pattern finders share: score tiers, the per-text scan, and small look-around helpers.

Speed: a regular expression that starts with a lookbehind or an alternation of words is tried at every position of
the text, which costs tens of microseconds per pattern on a 300-character prompt. So the finders are driven by the
digits: :class:`Scan` finds the digit runs once, and each finder looks just before and after a run with an anchored
``match`` or a ``search`` over a few dozen characters. Patterns that must scan the whole text start with a character
class (``[0-9](?<![\\w.-][0-9])...``: the lookbehind moved after the first character), which ``re`` skips to in C.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from itertools import pairwise

from privlm.detect.spans import Kind, Span

SCORE_VALID = 1.0  # passed a checksum or a library's validity test, or a form that can be nothing else
SCORE_LIKELY = 0.9  # the right shape with a keyword around it, a strict shape without checksum, a possible phone
SCORE_WEAK = 0.8  # shape alone and loose: a bare long digit run, a 5-digit number before a capitalised word

# a number as people write it: 85,000 / 1.250,00 / 1'200 / 3.5 / 300
NUMBER = r"(?:[0-9]{1,3}(?:[,.'\u2019\u00a0\u202f][0-9]{3})+(?:[.,][0-9]{1,2})?|[0-9]+(?:[.,][0-9]+)?)"

_RUN = re.compile(r"[0-9]+")
_WORD = re.compile(r"[^\W\d_]+")
_TAIL_WORD = re.compile(r"([^\W\d_]+)[\s.:,;#=()'\u2019-]{0,4}\Z")
_CHUNK_SEPARATORS = " .-/"


class Scan:
    """One text and what most finders ask of it, computed once: its digit runs, its digit chunks (runs joined by
    single separators: "4111 1111 1111", "22/07/2026"), and the words before a position (cached)."""

    __slots__ = ("_before", "_word_before", "chunk_digits", "chunks", "run_chunk_digits", "runs", "text")

    def __init__(self, text: str) -> None:
        self.text = text
        self.runs: list[tuple[int, int]] = [match.span() for match in _RUN.finditer(text)]
        self.chunks: list[str] = []
        self.run_chunk_digits: list[int] = []  # for each run, the digits of the chunk it belongs to
        self.chunk_digits = 0  # the most digits in one chunk
        self._before: dict[int, list[str]] = {}
        self._word_before: dict[int, tuple[int, str] | None] = {}
        self._join_chunks()

    def _join_chunks(self) -> None:
        text, start, digits, last_end = self.text, -1, 0, -2
        sizes: list[int] = []
        for run_start, run_end in self.runs:
            if run_start - last_end == 1 and text[last_end] in _CHUNK_SEPARATORS:
                digits += run_end - run_start
            else:
                if start >= 0:
                    self.chunks.append(text[start:last_end])
                    self.run_chunk_digits.extend([digits] * len(sizes))
                start, digits, sizes = run_start, run_end - run_start, []
            sizes.append(run_end - run_start)
            last_end = run_end
            self.chunk_digits = max(self.chunk_digits, digits)
        if start >= 0:
            self.chunks.append(text[start:last_end])
            self.run_chunk_digits.extend([digits] * len(sizes))

    def runs_of(self, lengths: range | Sequence[int]) -> Iterator[tuple[int, int]]:
        """The digit runs of one of ``lengths`` that are whole numbers: no letter, digit or decimal point around."""
        text = self.text
        for start, end in self.runs:
            if end - start in lengths and standalone(text, start, end):
                yield start, end

    def has_chunk(self, test: Callable[[str], bool]) -> bool:
        return any(test(chunk) for chunk in self.chunks)

    def words_before(self, pos: int) -> list[str]:
        """The words (lower case) in the 40 characters before ``pos``, in order."""
        words = self._before.get(pos)
        if words is None:
            words = self._before[pos] = words_before(self.text, pos)
        return words

    def word_before(self, pos: int) -> tuple[int, str] | None:
        """The word that ends just before ``pos`` (a few spaces or punctuation marks between), and where it starts."""
        if pos not in self._word_before:
            self._word_before[pos] = word_before(self.text, pos)
        return self._word_before[pos]


def standalone(text: str, start: int, end: int) -> bool:
    """Whether ``text[start:end]`` is not glued to a word or to more digits ("3.5", "1,200", "A12")."""
    if start > 0:
        before = text[start - 1]
        if before.isalnum() or before == "_" or (before in ".," and start > 1 and text[start - 2].isdigit()):
            return False
    if end < len(text):
        after = text[end]
        if after.isalnum() or after == "_" or (after in ".," and end + 1 < len(text) and text[end + 1].isdigit()):
            return False
    return True


def make_span(start: int, end: int, kind: Kind, score: float, what: str) -> Span:
    return Span(start, end, kind, score, f"pattern:{what}")


def digit_count(value: str) -> int:
    return sum(char.isdigit() for char in value)


def looks_like_year(value: str) -> bool:
    return len(value) == 4 and value.isdigit() and 1900 <= int(value) <= 2099


def words_before(text: str, pos: int, window: int = 40) -> list[str]:
    """The words (lower case) in the ``window`` characters before ``pos``, in order."""
    return [word.lower() for word in _WORD.findall(text, max(0, pos - window), pos)]


def word_before(text: str, pos: int) -> tuple[int, str] | None:
    """The word that ends just before ``pos`` (a few spaces or punctuation marks between), and where it starts."""
    match = _TAIL_WORD.search(text, max(0, pos - 24), pos)
    return (match.start(1), match.group(1)) if match else None


def has_keyword(words: Sequence[str], keywords: frozenset[str]) -> bool:
    """Whether one of ``words``, or two of them in a row ("sort code"), is in ``keywords``."""
    return any(word in keywords for word in words) or any(f"{a} {b}" in keywords for a, b in pairwise(words))


def keyword_then_fillers(words: Sequence[str], keywords: frozenset[str], fillers: frozenset[str]) -> bool:
    """Whether ``words`` end with a keyword (or a two-word keyword) followed only by filler words: "account number
    is", "salary of about"."""
    for i in range(len(words) - 1, max(-1, len(words) - 5), -1):
        if words[i] in keywords or (i > 0 and f"{words[i - 1]} {words[i]}" in keywords):
            return True
        if words[i] not in fillers:
            return False
    return False
