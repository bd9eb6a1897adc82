"""One Aho-Corasick automaton over every gazetteer entry, and the rule that scores what it finds.

How common an entry is (public data only; :class:`_Judge`):
- *rare*: not in wordfreq's small English list (under one use per million words), or in it with fewer than
  :data:`COMMON_TAGGED_USES` uses as a lower-case word in WordNet's sense-tagged concordance (over every part of
  speech and inflection: "Drew" is "draw") -- "Maria", "Seattle", "asthma";
- *common*: an ordinary word by that test ("Rose", "Reading", "Bill"), two letters or fewer, a month or weekday, or
  a name or place that is also an entry of a lower-case kind ("Baker");
- *function*: among the few hundred most frequent words (Zipf >= :data:`FUNCTION_ZIPF`: "May", "Will", "Can"); at
  Zipf >= :data:`NEVER_ZIPF` ("the", "I", "as") no entry at all.

How a match is scored (:func:`_score`): a rare entry scores its base (1.0, or less for a source such as the
nationalities) in any case. A common entry of a kind written with a capital (person, location, religion, ethnicity,
union), or an acronym whose lower case is common ("ADD"), matches only as written: 0.9 capitalised within a
sentence, 0.5 at a sentence's start or in a text written all in one case; a function word 0.6 within a sentence
and never elsewhere. A common entry of a lower-case kind (health, medication, occupation, sexuality) matches in any
case at 0.7, unless most of its tagged uses lie in the kind's own WordNet synsets ("nurse", not "cold"); a word a
name shares scores 0.5 where capitalised within a sentence ("Mr Baker").

Weak sources (:data:`WEAK_SOURCES`: WordNet's walks, ICD-10-CM's titles, towns under 100,000, and accented entries
whose folded form lost its accents) contribute no ordinary word and nothing a name shares with another kind: "hit"
and "Adam" as street drugs, "death" as a condition, "Union" as a town, "Thế" as "the" are dropped; the hand-written
lexicons are where ordinary words come from ("depression", "stroke"). A name or place that is also another kind's
entry ("Christian", "Black") scores :data:`NAME_YIELDS` times less, so that the other kind wins the merge.
"""

from __future__ import annotations

import gc
import itertools
import math
import re
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Final

import ahocorasick

from privlm.detect.gazetteers._organizations import OrganizationRule
from privlm.detect.gazetteers._sources import Entry, all_entries, kind_synsets, wordnet
from privlm.detect.gazetteers._text import Folded, key_forms
from privlm.detect.gazetteers._wordnet import WordNet
from privlm.detect.spans import Kind, Span

CASED_KINDS: Final = frozenset({Kind.PERSON, Kind.LOCATION, Kind.RELIGION, Kind.ETHNICITY, Kind.UNION})
COMMON_TAGGED_USES: Final = 3
FUNCTION_ZIPF: Final = 5.5
NEVER_ZIPF: Final = 6.5  # "the", "and", "I", "in", "as": no kind's entry, whatever a name list says
SOURCE_BASE_SCORE: Final = {"lexicon:nationality": 0.6}  # "Mexican" is as often food as a person's origin
# Sources whose entries are dropped, when no other source of their kind has them, if they are ordinary words or
# another kind's entries: WordNet's walks ("hit" and "Adam" as street drugs), ICD-10-CM's one-word titles ("death",
# "hand") and small towns ("Union", "University", "Douglas"). Ordinary words come from the hand-written lexicons.
WEAK_SOURCES: Final = frozenset({"wordnet", "icd10cm", "geonames:towns"})
# A name or place that is also another kind's entry ("Christian", "Black", "ADD") yields to that kind in a merge.
NAME_YIELDS: Final = 0.8
# Scores of a common entry (times its base score), by where and how it was found.
CAPITALISED, SENTENCE_START, ONE_CASE_TEXT, FUNCTION_CAPITALISED, LOWER_KIND_COMMON, LOWER_KIND_AS_NAME = (
    0.9, 0.5, 0.5, 0.6, 0.7, 0.5)

_RARE, _COMMON, _FUNCTION = 0, 1, 2
# Capitalised in every sentence, so no lower-case use marks them as ordinary words: months and weekdays as names.
_CALENDAR = frozenset({"january", "february", "march", "april", "may", "june", "july", "august", "september",
                       "october", "november", "december", "monday", "tuesday", "wednesday", "thursday", "friday",
                       "saturday", "sunday"})
_ANY_CASE, _CAPITAL, _CAPITALS = 0, 1, 2  # what a common entry's surface must look like
_CASED = frozenset(kind.value for kind in CASED_KINDS)
_NAMES = frozenset({Kind.PERSON.value, Kind.LOCATION.value})
_TITLES = frozenset({"mr", "mrs", "ms", "miss", "dr", "prof", "st", "sr", "jr", "rev", "fr", "mx", "sir", "dame"})
_OPENERS = " \t\"'\u201c\u2018\u00ab([{*\u2022-\u2013\u2014>"


@dataclass(frozen=True, slots=True)
class Sense:
    """What a key means in one kind: how common it is, what its surface must look like, its base score, and whether
    a name or place shares it with a lower-case kind ("Baker")."""

    kind: Kind
    strength: int
    needs: int
    base: float
    shared: bool


@dataclass(frozen=True, slots=True)
class _Context:
    text: str
    one_case: bool  # no lower-case letter, or no capital: case says nothing


class Gazetteer:
    """The automaton over ``entries`` and the scoring rule; :meth:`find` is a text's gazetteer spans."""

    def __init__(self, entries: Sequence[Entry], net: WordNet | None = None,
                 domains: dict[Kind, frozenset[int]] | None = None) -> None:
        self.entries = tuple(entries)
        self._judge = _Judge(net, domains or {})
        senses = _senses(self.entries, self._judge)
        self._automaton = ahocorasick.Automaton(ahocorasick.STORE_ANY, ahocorasick.KEY_STRING)
        for key, meanings in senses.items():
            self._automaton.add_word(f" {key} ", meanings)
        self._automaton.make_automaton()
        self.keys = len(senses)  # keys in the automaton (a few may be judged away on their first match)
        self.organizations = OrganizationRule()
        self.build_seconds = 0.0  # set by whoever times the build (default_gazetteer)

    def counts(self) -> Counter[tuple[str, str]]:
        """Entries per (kind, source)."""
        return Counter((entry.kind.value, entry.source) for entry in self.entries)

    def find(self, text: str) -> list[Span]:
        """The gazetteer spans of ``text``: exact offsets, whole words, the longest match within each kind."""
        if not text:
            return []
        folded = Folded.of(text)
        context = _Context(text, text == text.lower() or text == text.upper())
        found: list[tuple[int, int, Kind, float]] = []
        for key_end, meanings in self._automaton.iter(folded.padded) if len(self._automaton) else ():
            start, end = folded.span(key_end, meanings[0])
            for meaning in meanings[1]:
                sense = meaning.resolve(self._judge) if isinstance(meaning, _Pending) else meaning
                if sense is not None and (score := _score(sense, start, end, context)) is not None:
                    found.append((start, end, sense.kind, score))
        spans = [Span(start, end, kind, score, f"gazetteer:{kind.value}")
                 for start, end, kind, score in _longest_per_kind(found)]
        return spans + self.organizations.find(text)


def _longest_per_kind(found: list[tuple[int, int, Kind, float]]) -> list[tuple[int, int, Kind, float]]:
    """Within a kind, overlapping matches keep the longest (then the leftmost, then the best scored)."""
    kept: list[tuple[int, int, Kind, float]] = []
    taken: dict[Kind, list[tuple[int, int]]] = defaultdict(list)
    for start, end, kind, score in sorted(found, key=lambda m: (m[1] - m[0], -m[0], m[3]), reverse=True):
        if all(end <= s or start >= e for s, e in taken[kind]):
            taken[kind].append((start, end))
            kept.append((start, end, kind, score))
    return sorted(kept, key=lambda m: (m[0], m[1], m[2].value))


# ---------------------------------------------------------------- scoring


def _score(sense: Sense, start: int, end: int, context: _Context) -> float | None:
    """A match's score, or None where the entry's form rules it out (see the module docstring)."""
    if sense.needs == _ANY_CASE:  # a lower-case kind: any case, less where a name shares the word ("Baker")
        surface = context.text[start:end]
        if sense.shared and surface[0].isupper() and not _sentence_start(context.text, start):
            return sense.base * LOWER_KIND_AS_NAME
        return sense.base * (LOWER_KIND_COMMON if sense.strength != _RARE else 1.0)
    if sense.strength == _RARE:
        return sense.base
    surface = context.text[start:end]
    if context.one_case:
        shaped = sense.needs == _CAPITAL or surface.isupper()
        return sense.base * ONE_CASE_TEXT if shaped and sense.strength == _COMMON else None
    if not (surface.isupper() if sense.needs == _CAPITALS else surface[0].isupper()):
        return None
    if _sentence_start(context.text, start):
        return None if sense.strength == _FUNCTION else sense.base * SENTENCE_START
    return sense.base * (FUNCTION_CAPITALISED if sense.strength == _FUNCTION else CAPITALISED)


def _sentence_start(text: str, start: int) -> bool:
    """Whether ``text[start:]`` opens a sentence, a line or a list item (where any word is capitalised); a title
    ("Dr. Rose") opens nothing."""
    at = start
    while at > 0 and text[at - 1] in _OPENERS:
        at -= 1
    if at == 0 or text[at - 1] in "\n\r":
        return True
    if text[at - 1] not in ".!?:;…":
        return False
    word = re.search(r"(\w+)\.$", text[max(0, at - 6) : at])
    return not (text[at - 1] == "." and word is not None and word.group(1).lower() in _TITLES)


# ---------------------------------------------------------------- what each key means


_Slot = tuple[int, float, bool]  # (the most lenient form any entry asks for, the best base score, weak sources only)


class _Pending:
    """A key's sense in a kind that is judged on its first match: looking 6,000 words up in WordNet would add half a
    second to every build, and a text meets a handful. The judgement is a pure function of the data, kept here."""

    __slots__ = ("_arguments", "_done", "_sense")

    def __init__(self, key: str, kind: str, needs: int, base: float, weak: bool, shared: bool) -> None:
        self._arguments = (key, kind, needs, base, weak, shared)
        self._done = False
        self._sense: Sense | None = None

    def resolve(self, judge: _Judge) -> Sense | None:
        if not self._done:
            self._sense, self._done = judge.sense(*self._arguments), True
        return self._sense


_Meaning = Sense | _Pending


def _senses(entries: Iterable[Entry], judge: _Judge) -> dict[str, tuple[int, tuple[_Meaning, ...]]]:
    """folded key -> (its padded length, its senses, judged now or on first match). Kinds are keyed by value and
    keys handled in bulk where they can be: hashing an enum member runs Python code, and there are 110,000 keys."""
    per_kind = _slots(entries)
    seen: set[str] = set()
    repeated: set[str] = set()
    for slots in per_kind.values():
        repeated |= seen & slots.keys()
        seen |= slots.keys()
    kinds_of = {key: [kind for kind, slots in per_kind.items() if key in slots] for key in repeated}
    shared = {key for key, kinds in kinds_of.items() if not (_CASED.issuperset(kinds) or _CASED.isdisjoint(kinds))}
    yielding = {key for key, kinds in kinds_of.items() if not _NAMES.issuperset(kinds)}  # "Christian", "Black"
    out: dict[str, tuple[int, tuple[_Meaning, ...]]] = {}
    for kind, slots in per_kind.items():
        judged = (slots.keys() & judge.frequency.keys()) | repeated | {key for key in slots if len(key) <= 2}
        judged |= _CALENDAR & slots.keys()
        judged -= {key for key in judged if len(key) == 1}  # initials are no names
        slots = {key: slot for key, slot in slots.items() if len(key) > 1}
        for key, slot in slots.items():
            if key in yielding and kind in _NAMES:
                slot = (slot[0], slot[1] * NAME_YIELDS, slot[2])
            if key not in judged:
                sense: _Meaning | None = judge.rare(kind, *slot)
            elif slot[2] and key in yielding:  # a weak source's entry that a name and another kind share ("Adam")
                sense = None
            else:
                sense = _Pending(key, kind, *slot, key in shared)
            if sense is None:
                continue
            if key in out:
                out[key] = (out[key][0], (*out[key][1], sense))
            else:
                out[key] = (len(key) + 2, (sense,))
    return out


def _slots(entries: Iterable[Entry]) -> dict[str, dict[str, _Slot]]:
    """kind -> folded key -> its slot, over every key form of every entry."""
    per_kind: dict[str, dict[str, _Slot]] = {}
    for (kind, source), group in itertools.groupby(entries, key=lambda entry: (entry.kind._value_, entry.source)):
        base, weak = SOURCE_BASE_SCORE.get(source, 1.0), source in WEAK_SOURCES
        by_needs = {needs: (needs, base, weak) for needs in (_ANY_CASE, _CAPITAL, _CAPITALS)}
        fresh: dict[str, _Slot] = {}
        for entry in group:
            slot = by_needs[_needs(entry)]
            keys = key_forms(entry.text)
            if not (weak or entry.text.isascii()) and keys[0].isascii():
                slot = (slot[0], slot[1], True)  # "Thế" folds to "the", "Malé" to "male": weak, like WordNet's walks
            for key in keys:
                old = fresh.get(key)
                fresh[key] = slot if old is None or old == slot else _merge(old, slot)
        slots = per_kind.setdefault(kind, {})
        for key in fresh.keys() & slots.keys():
            fresh[key] = _merge(slots[key], fresh[key])
        slots.update(fresh)
    return per_kind


def _merge(one: _Slot, other: _Slot) -> _Slot:
    return min(one[0], other[0]), max(one[1], other[1]), one[2] and other[2]


def _needs(entry: Entry) -> int:
    """What an entry's surface must look like if it turns out common: its capitals ("ADD"), a capital (a name, a
    brand), or nothing."""
    text = entry.text
    if len(text) >= 2 and text.isupper():
        return _CAPITALS
    return _CAPITAL if entry.kind._value_ in _CASED or text[:1].isupper() else _ANY_CASE


class _Judge:
    """How common a key is, from wordfreq's small English list and WordNet's concordance (zipf alone without it)."""

    def __init__(self, net: WordNet | None, domains: dict[Kind, frozenset[int]]) -> None:
        import wordfreq

        self.frequency = wordfreq.get_frequency_dict("en", "small")
        self.net = net
        self.domains = domains
        # A few dozen distinct senses, shared by 100,000 keys.
        self._interned: dict[tuple[str, int, int, float, bool], Sense] = {}

    def sense(self, key: str, kind: str, needs: int, base: float, weak: bool, shared: bool) -> Sense | None:
        if _zipf(self.frequency.get(key, 0.0)) >= NEVER_ZIPF:
            return None
        strength = self.strength(key, kind, shared)
        cased = kind in _CASED or needs != _ANY_CASE
        if strength != _RARE and (weak or (strength == _FUNCTION and not cased)):
            return None  # "hit" proposed by WordNet as a drug, the town of Union; a lower-case kind never matches "as"
        return self._intern(kind, strength, needs if cased else _ANY_CASE, base, shared)

    def rare(self, kind: str, needs: int, base: float, weak: bool) -> Sense:
        """The sense of a key no ordinary word shares (not in wordfreq's list, three letters or more, one kind)."""
        return self._intern(kind, _RARE, needs if kind in _CASED or needs != _ANY_CASE else _ANY_CASE, base, False)

    def _intern(self, kind: str, strength: int, needs: int, base: float, shared: bool) -> Sense:
        fields = (kind, strength, needs, base, shared)
        sense = self._interned.get(fields)
        if sense is None:
            sense = self._interned[fields] = Sense(Kind(kind), strength, needs, base, shared)
        return sense

    def strength(self, key: str, kind: str, shared: bool) -> int:
        frequency = self.frequency.get(key)
        if frequency is None or " " in key:
            return _COMMON if len(key) <= 2 else _RARE
        if _zipf(frequency) >= FUNCTION_ZIPF:
            return _FUNCTION
        if len(key) <= 2 or key in _CALENDAR or (shared and kind in _CASED):
            return _COMMON
        uses, in_domain = self._uses(key, kind)
        if uses - in_domain >= COMMON_TAGGED_USES and in_domain < (uses + 1) // 2:
            return _COMMON
        return _RARE

    def _uses(self, key: str, kind: str) -> tuple[int, int]:
        if self.net is None:  # without WordNet: a word in wordfreq's top ~3,000 counts as common
            return (COMMON_TAGGED_USES if _zipf(self.frequency[key]) >= 4.5 else 0), 0
        return self.net.common_uses(key, self.domains.get(Kind(kind), frozenset()))


def _zipf(frequency: float) -> float:
    return math.log10(frequency) + 9 if frequency > 0 else 0.0


def build(entries: Sequence[Entry] | None = None) -> Gazetteer:
    """A gazetteer over ``entries`` (default: every source's), judged with WordNet where it is installed. The
    cyclic garbage collector pauses meanwhile: the build allocates some 500,000 objects, none of them garbage, and
    the collector's passes over them took a third of the time."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        net = wordnet()
        domains = kind_synsets(net) if net is not None else {}
        return Gazetteer(all_entries(net, domains) if entries is None else entries, net, domains)
    finally:
        if enabled:
            gc.enable()


__all__ = ["CASED_KINDS", "Gazetteer", "Sense", "build"]
