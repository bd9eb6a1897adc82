"""Organizations by the words that end or start their names: a gazetteer of employers would be tiny or mostly
ordinary words, but "Acme Ltd", "St Mary's Hospital" and "University of Leeds" say what they are.

``lexicon-organization-words.txt`` lists the words; one ending in " of" starts a name ("University of" + one to four
capitalised words), the others end one (one to five capitalised words + "Ltd"). Capitalisation is what marks the
name, so the rule is case-sensitive, and a run made only of words any sentence may capitalise ("The", "My") before
the suffix is no name ("The Bank was shut").
"""

from __future__ import annotations

import re
from functools import cached_property

from privlm.detect.gazetteers._sources import read_lexicon
from privlm.detect.spans import Kind, Span

ORGANIZATION_SCORE = 0.8
_WORD = r"(?:(?:St|Mt|Ft)\.|[A-Z][\w'\u2019&-]*|&)"  # a capitalised word ("St." too), or an ampersand
_BEFORE, _AFTER = r"(?<![\w'\u2019])", r"(?![\w'\u2019])"  # word boundaries that keep "St Mary's" whole
_JOINER = r"(?:of|and|de|du|la|le|von|van|der)"
_OPENERS = frozenset({"a", "an", "the", "my", "our", "your", "his", "her", "their", "its", "this", "that", "i",
                      "we", "at", "in", "to", "from", "for", "with", "and", "or", "but", "dear", "hi", "hello"})


class OrganizationRule:
    """Case-sensitive suffix and head rules over the organization words; :meth:`find` is a text's spans."""

    def __init__(self, words: tuple[str, ...] | None = None) -> None:
        self.words = read_lexicon("lexicon-organization-words.txt") if words is None else words

    @cached_property
    def _suffix(self) -> re.Pattern[str]:
        ends = sorted((w for w in self.words if not w.endswith(" of")), key=len, reverse=True)
        alternatives = "|".join(re.escape(word) for word in ends)
        return re.compile(rf"{_BEFORE}((?:{_WORD}[ \t]+(?:{_JOINER}[ \t]+)?){{1,5}})(?:{alternatives}){_AFTER}")

    @cached_property
    def _head(self) -> re.Pattern[str]:
        heads = sorted((w.removesuffix(" of") for w in self.words if w.endswith(" of")), key=len, reverse=True)
        alternatives = "|".join(re.escape(word) for word in heads)
        return re.compile(rf"{_BEFORE}(?:{alternatives}) of (?:the )?{_WORD}(?:[ \t]+{_WORD}){{0,3}}{_AFTER}")

    def find(self, text: str) -> list[Span]:
        spans = []
        for match in self._suffix.finditer(text):
            start = _skip_openers(text, match.start(), match.start(1) + len(match.group(1)))
            if start is not None:
                spans.append(Span(start, match.end(), Kind.ORGANIZATION, ORGANIZATION_SCORE, "gazetteer:organization"))
        spans += [Span(m.start(), m.end(), Kind.ORGANIZATION, ORGANIZATION_SCORE, "gazetteer:organization")
                  for m in self._head.finditer(text)]
        return spans


def _skip_openers(text: str, start: int, words_end: int) -> int | None:
    """Where the name starts once leading words any sentence may capitalise are skipped; None if nothing is left."""
    for word in re.finditer(r"\S+", text[start:words_end]):
        if word.group().lower().strip(",.;:") not in _OPENERS:
            return start + word.start()
    return None


__all__ = ["ORGANIZATION_SCORE", "OrganizationRule"]
