"""Just enough of Debian's WordNet 3.0 (:data:`privlm.data.WORDNET_DIR`) for the gazetteers: hyponym closures,
a synset's lemmas, and how often a word is used as a common (lower-case) word in WordNet's sense-tagged corpus.

A data file's synset offset is its byte offset in that file, so a synset is one slice of the file read as bytes:
a closure of a few thousand synsets parses only those lines, not the 82,000 nouns. The index files and the tag
counts are sorted, so a lemma is a binary search over their lines, not a dictionary of 150,000 parsed rows.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

POS_FILES = ("noun", "verb", "adj", "adv")
_POS_OF_SS_TYPE = {"n": "noun", "v": "verb", "a": "adj", "s": "adj", "r": "adv"}
_POS_OF_SS_DIGIT = {"1": "noun", "2": "verb", "3": "adj", "4": "adv", "5": "adj"}
_ADJ_MARKER = re.compile(r"\([a-z]+\)$")  # "galore(ip)": a syntactic marker on adjectives
# WordNet's morphy detachment rules (suffix, replacement) per part of speech: "banks" -> "bank", "drew" is in verb.exc.
_DETACH = {
    "noun": (("s", ""), ("ses", "s"), ("xes", "x"), ("zes", "z"), ("ches", "ch"), ("shes", "sh"), ("men", "man"),
             ("ies", "y")),
    "verb": (("s", ""), ("ies", "y"), ("es", "e"), ("es", ""), ("ed", "e"), ("ed", ""), ("ing", "e"), ("ing", "")),
    "adj": (("er", ""), ("est", ""), ("er", "e"), ("est", "e")),
    "adv": (),
}


@dataclass(frozen=True, slots=True)
class Synset:
    """One line of a data file: its lemmas as written (underscores kept) with their lex ids, and its pointers."""

    pos: str
    offset: int
    lex_filenum: int
    words: tuple[tuple[str, int], ...]
    pointers: tuple[tuple[str, int, str], ...]  # (symbol, target offset, target pos)
    gloss: str


class WordNet:
    """A lazy reader over the dictionary files in ``root``; every method is a pure function of those files."""

    def __init__(self, root: Path) -> None:
        missing = [f"{kind}.{pos}" for pos in POS_FILES for kind in ("data", "index")
                   if not (root / f"{kind}.{pos}").is_file()]
        if missing or not (root / "cntlist.rev").is_file():
            raise FileNotFoundError(f"WordNet not found at {root} (missing {missing or ['cntlist.rev']}); "
                                    "install it with `apt-get install wordnet-base`")
        self.root = root
        self._data = {pos: (root / f"data.{pos}").read_bytes() for pos in POS_FILES}
        self._index: dict[str, list[str]] = {}
        self._synsets: dict[tuple[str, int], Synset] = {}
        self._tag_lines: list[str] | None = None
        self._tagged: frozenset[str] = frozenset()  # the lemmas with a line in cntlist.rev
        self._lower_uses: dict[str, tuple[tuple[int, int], ...]] = {}
        self._exceptions: dict[str, dict[str, tuple[str, ...]]] = {}

    # ------------------------------------------------------------ synsets

    def synset(self, pos: str, offset: int) -> Synset:
        key = (pos, offset)
        if key not in self._synsets:
            data = self._data[pos]
            line = data[offset : data.index(b"\n", offset)].decode("utf-8")
            self._synsets[key] = _parse_synset(pos, line)
        return self._synsets[key]

    def senses(self, lemma: str, pos: str = "noun") -> tuple[int, ...]:
        """The synset offsets of ``lemma`` (lower case, underscores for spaces), most frequent sense first."""
        line = _find_line(self._index_lines(pos), lemma + " ")
        if line is None:
            return ()
        fields = line.split()  # lemma pos synset_cnt p_cnt [symbol]... sense_cnt tagsense_cnt offset...
        return tuple(int(offset) for offset in fields[6 + int(fields[3]) :])

    def _index_lines(self, pos: str) -> list[str]:
        if pos not in self._index:
            text = (self.root / f"index.{pos}").read_text(encoding="utf-8")
            self._index[pos] = [line for line in text.splitlines() if not line.startswith(" ")]  # licence: indented
        return self._index[pos]

    def hyponyms(self, offset: int, pos: str = "noun", symbols: Iterable[str] = ("~", "~i")) -> set[int]:
        """The synsets under ``offset`` along ``symbols`` pointers, at any depth (``offset`` itself excluded)."""
        wanted, seen, stack = frozenset(symbols), set(), [offset]
        while stack:
            for symbol, target, target_pos in self.synset(pos, stack.pop()).pointers:
                if symbol in wanted and target_pos == pos and target not in seen:
                    seen.add(target)
                    stack.append(target)
        return seen

    # ------------------------------------------------------------ how common a word is

    def tag_counts(self, lemma: str) -> list[tuple[str, int, int]]:
        """(part of speech, sense number as in the index, count) of every sense of ``lemma`` tagged in WordNet's
        semantic concordance (cntlist.rev: ``lemma%ss_type:lex_filenum:lex_id:head:head_id sense_number count``)."""
        lines, prefix = self._tag_list(), lemma + "%"
        if lemma not in self._tagged:
            return []
        out = []
        for at in range(bisect.bisect_left(lines, prefix), len(lines)):
            if not lines[at].startswith(prefix):
                break
            key, number, count = lines[at].split()
            out.append((_POS_OF_SS_DIGIT[key[len(prefix)]], int(number), int(count)))
        return out

    def _tag_list(self) -> list[str]:
        if self._tag_lines is None:
            self._tag_lines = (self.root / "cntlist.rev").read_text(encoding="utf-8").splitlines()
            self._tagged = frozenset(line[: line.index("%")] for line in self._tag_lines)
        return self._tag_lines

    def base_forms(self, word: str) -> dict[str, set[str]]:
        """The lemmas ``word`` may be, each with the parts of speech it may be in (morphy: itself, the exception
        lists, the detachment rules): "drew" may be the verb "draw", "banks" the noun or verb "bank"."""
        forms: dict[str, set[str]] = {}
        for pos in POS_FILES:
            if pos not in self._exceptions:
                self._exceptions[pos] = _parse_exceptions(self.root / f"{pos}.exc")
            candidates = [word, *self._exceptions[pos].get(word, ())]
            candidates += [word[: -len(suffix)] + ending for suffix, ending in _DETACH[pos]
                           if word.endswith(suffix) and len(word) > len(suffix) + 1]
            for form in candidates:
                forms.setdefault(form, set()).add(pos)
        return forms

    def common_uses(self, word: str, domain: frozenset[int] = frozenset()) -> tuple[int, int]:
        """(tagged uses of ``word`` as a lower-case word, those in ``domain`` noun synsets), over every part of
        speech and inflection: "bill" is tagged often in lower case, "john" twice (a toilet), "paris" never."""
        uses = self._lower_uses.get(word)
        if uses is None:
            uses = self._lower_uses[word] = self._tagged_lower_senses(word)
        return sum(count for _, count in uses), sum(count for offset, count in uses if offset in domain)

    def _tagged_lower_senses(self, word: str) -> tuple[tuple[int, int], ...]:
        """(offset, tagged count) of the senses where ``word`` or a lemma it inflects is written in lower case (an
        offset of -1 for a sense outside the nouns)."""
        self._tag_list()
        out = []
        for lemma, parts in self.base_forms(word).items():
            if lemma not in self._tagged:  # most candidate forms ("jame" for "james") are no tagged lemma
                continue
            for pos, number, count in self.tag_counts(lemma):
                offsets = self.senses(lemma, pos)
                if count == 0 or pos not in parts or number > len(offsets):
                    continue
                if self._written_lower(pos, offsets[number - 1], lemma):
                    out.append((offsets[number - 1] if pos == "noun" else -1, count))
        return tuple(out)

    def _written_lower(self, pos: str, offset: int, lemma: str) -> bool:
        return any(word.lower() == lemma and word.islower() for word, _ in self.synset(pos, offset).words)


def _parse_synset(pos: str, line: str) -> Synset:
    head, _, gloss = line.partition(" | ")
    fields = head.split(" ")
    n_words = int(fields[3], 16)
    words = tuple((_ADJ_MARKER.sub("", fields[4 + 2 * i]), int(fields[5 + 2 * i], 16)) for i in range(n_words))
    at = 4 + 2 * n_words
    pointers = tuple((fields[at + 1 + 4 * k], int(fields[at + 2 + 4 * k]), _POS_OF_SS_TYPE[fields[at + 3 + 4 * k]])
                     for k in range(int(fields[at])))
    return Synset(pos, int(fields[0]), int(fields[1]), words, pointers, gloss.strip())


def _find_line(lines: list[str], prefix: str) -> str | None:
    """The line of sorted ``lines`` that starts with ``prefix`` (a lemma and its separator), if any."""
    at = bisect.bisect_left(lines, prefix)
    return lines[at] if at < len(lines) and lines[at].startswith(prefix) else None


def _parse_exceptions(path: Path) -> dict[str, tuple[str, ...]]:
    """pos.exc: ``inflected base...`` ("drew draw")."""
    if not path.is_file():
        return {}
    return {fields[0]: tuple(fields[1:]) for fields in map(str.split, path.read_text(encoding="utf-8").splitlines())
            if len(fields) > 1}


def lemma_text(word: str) -> str:
    """A lemma as a reader writes it: underscores to spaces."""
    return word.replace("_", " ")


__all__ = ["POS_FILES", "Synset", "WordNet", "lemma_text"]
