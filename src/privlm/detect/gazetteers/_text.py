"""Folding text for the automaton, with a map back to the original offsets.

Each character folds on its own: case folded, accents dropped (NFKD without combining marks, and "ł", "ø", "æ" and
the like spelled in Latin letters), anything that is not a word character turned into a space. "ß" becomes "ss"
and "İ" becomes "i" (casefold gives "i" plus a combining dot), so the folded text can be longer or shorter than the
original; :class:`Folded` keeps, for every folded character,
the index of the character it came from. Scripts written without spaces between words (CJK, kana, Thai, ...) fold
to spaces, so a Latin name right after them still starts a word.

Keys and texts fold the same way and are padded with a space on each side, so the automaton only ever reports
whole words: " ana " is not in " banana ".
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass

_ASCII_FOLD = str.maketrans({chr(i): (chr(i).lower() if chr(i).isalnum() or chr(i) == "_" else " ")
                             for i in range(128)})
# Scripts written without spaces between words: Thai, Lao, Tibetan, Myanmar, Khmer, kana, CJK, Yi, Hangul.
UNSPACED = re.compile("[\u0e00-\u0fff\u1000-\u109f\u1780-\u17ff\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff"
                      "\ua000-\ua4cf\uac00-\ud7af\uf900-\ufaff\U00020000-\U0003134f]")


class _FoldMap(dict[int, str]):
    """Code point -> folded form, filled on first sight: ``str.translate`` with it folds a text at C speed."""

    def __missing__(self, code: int) -> str:
        folded = self[code] = _fold_char(chr(code))
        if len(folded) != 1:
            _UNEVEN.add(chr(code))
        return folded


_FOLDS = _FoldMap()
_UNEVEN: set[str] = set()  # characters seen so far that fold to other than one character (ß, İ, ﬁ, marks)
# Letters that Unicode does not decompose into a base letter and a mark, spelled as English writes them ("Łódź" is
# "Lodz", "Søren" "Soren", "Tórshavn" "Torshavn").
_UNDECOMPOSED = str.maketrans({"ł": "l", "ø": "o", "đ": "d", "ħ": "h", "\u0131": "i", "æ": "ae", "œ": "oe", "þ": "th",
                               "ð": "d", "ŀ": "l", "ŧ": "t", "ƒ": "f"})
_SPACES = re.compile(r" +")
_PUNCTUATION = re.compile(r"[^\w\s]")


def fold_char(char: str) -> str:
    """The folded form of one character: "" for a combining mark, " " for a non-word character."""
    return _FOLDS[ord(char)]


def _fold_char(char: str) -> str:
    if char.isascii():
        return char.translate(_ASCII_FOLD)
    if unicodedata.category(char).startswith("M"):
        return ""
    if UNSPACED.match(char):
        return " "
    decomposed = unicodedata.normalize("NFKD", char.casefold()).translate(_UNDECOMPOSED)
    out = []
    for part in decomposed:
        if unicodedata.category(part).startswith("M"):
            continue
        out.append(part if part.isalnum() or part == "_" else " ")
    return "".join(out)


def fold(text: str) -> str:
    """``text`` folded character by character (see the module docstring)."""
    return text.translate(_ASCII_FOLD if text.isascii() else _FOLDS)


@dataclass(frozen=True, slots=True)
class Folded:
    """A text folded for matching: ``padded`` is " " + fold(text) + " "; ``origin[k]`` is the index in the original
    text of folded character ``k`` (None when folding kept every character in place, as for ASCII)."""

    text: str
    padded: str
    origin: list[int] | None
    dropped: frozenset[int]  # original indices that folded to nothing (combining marks)

    @classmethod
    def of(cls, text: str) -> Folded:
        folded = fold(text)  # fills _UNEVEN with any new character that folds unevenly
        if text.isascii() or _UNEVEN.isdisjoint(text):
            return cls(text, f" {folded} ", None, frozenset())
        pieces = [fold_char(char) for char in text]
        origin = [i for i, piece in enumerate(pieces) for _ in piece]
        dropped = frozenset(i for i, piece in enumerate(pieces) if not piece)
        return cls(text, " " + "".join(pieces) + " ", origin, dropped)

    def span(self, key_end: int, key_length: int) -> tuple[int, int]:
        """The original ``[start, end)`` of a padded key (" word ") whose last space is at ``key_end`` in
        ``padded``: the word's folded characters are ``[key_end - key_length + 1, key_end - 1)`` of the unpadded
        fold. An ending combining mark ("e" + U+0301) belongs to the word."""
        start, end = key_end - key_length + 1, key_end - 1
        if self.origin is None:
            return start, end
        start, end = self.origin[start], self.origin[end - 1] + 1
        while end in self.dropped:
            end += 1
        return start, end


def key_forms(entry: str) -> tuple[str, ...]:
    """The folded keys an entry is matched by: as written ("st  louis" for "St. Louis", punctuation a space each),
    with its punctuation dropped ("st louis", "obrien", "covid19"), and, for a possessive, without it ("alzheimer
    disease" beside "alzheimers disease")."""
    if entry.isascii() and entry.isalpha():
        return (entry.lower(),)
    if entry.replace(" ", "").isalnum():  # no punctuation: one key
        return (" ".join(fold(entry).split()),)
    forms = [_SPACES.sub(" ", entry.strip())]
    if "'s" in entry or "\u2019s" in entry:
        forms.append(re.sub("['\u2019]s\\b", "", forms[0]))
    if _PUNCTUATION.search(entry):
        forms += [_SPACES.sub(" ", _PUNCTUATION.sub("", form)).strip() for form in forms]
    keys = (fold(form).strip() for form in forms)
    return tuple(dict.fromkeys(key for key in keys if key))


def is_word_char(char: str) -> bool:
    return char.isalnum() or char == "_"


__all__ = ["Folded", "fold", "fold_char", "is_word_char", "key_forms"]
