"""Street addresses (a house number, words and a street-type word in English, German, Dutch, French, Spanish,
Italian and Portuguese order) and postcodes (UK, US ZIP after a state or "zip", Canadian, Dutch, German), found
from the digit runs."""

from __future__ import annotations

import re
from collections.abc import Iterator

from stdnum.nl import postcode as nl_postcode

from privlm.detect.patterns._common import SCORE_LIKELY, SCORE_WEAK, Scan, make_span
from privlm.detect.spans import Kind, Span

_EN_TYPES = (r"street|st|road|rd|avenue|ave|av|boulevard|blvd|lane|ln|drive|dr|court|ct|place|pl|square|sq|terrace|"
             r"terr|way|close|crescent|cres|grove|gardens|gdns|parkway|pkwy|highway|hwy|circle|cir|trail|row|mews|"
             r"walk|parade|broadway|embankment|wharf|quay|hill|green|park|rise|vale|view|alley|plaza|loop|pike|"
             r"turnpike|expressway|freeway|route|rte")
_HOUSE = r"[0-9]{1,5}[A-Za-z]?(?:[-/][0-9]{1,5}[A-Za-z]?)?"
# anchored at a house number: "221B Baker Street", "1600 Pennsylvania Ave NW", "12 High St"
# (one line: an address over several lines is one span per line, as a letter head writes it)
_EN_STREET = re.compile(rf"{_HOUSE},?[ \t]+(?:[A-Z][\w'\u2019.-]*[ \t]+){{1,4}}(?i:{_EN_TYPES})(?!\w)"
                        r"(?:[ \t]+(?:NW|NE|SW|SE|N|S|E|W)(?!\w))?")
# what follows a street on its line up to a stop or the line's end: ", Newtown NSW 2042", ", Airport Area, Accra"
_TAIL_TOKEN = r"(?:[A-ZÀ-Ý][\w'\u2019.-]*|[0-9]{4,5})"
_TOWN_TAIL = re.compile(rf"(?:,?[ \t]+{_TAIL_TOKEN}(?:[ \t]+{_TAIL_TOKEN}){{0,3}}){{1,3}}(?=[ \t]*(?:[,.;:)!?]|$))",
                        re.MULTILINE)
# "12 high street": lower case, at most two words, none of them a word that a distance or a count would use
_EN_STREET_LOWER = re.compile(r"[0-9]{1,5}[a-z]?\s+(?P<words>(?:[a-z][\w'\u2019-]*\s+){1,2})"
                              r"(?:street|st|road|rd|avenue|ave|lane|ln|drive|blvd|boulevard)(?!\w)")
_NOT_STREET_WORDS = frozenset({"the", "a", "an", "my", "our", "your", "his", "her", "their", "this", "that", "down",
                               "up", "on", "in", "at", "to", "from", "of", "by", "across", "along", "off", "minutes",
                               "mins", "min", "blocks", "miles", "km", "houses", "doors", "steps", "yards", "meters",
                               "metres", "feet", "kids", "cars", "people", "times", "more", "other", "new", "old"})
_UNIT = r"(?:Flat|Apt\.?|Apartment|Unit|Suite|Ste\.?|Room|Apto\.?|Wohnung)"
# "Flat 3, 12 High St", or the unit's number as the house's: "Flat 11, Cedar Court", "House No. 14, Kofi Annan St"
_UNIT_BEFORE = re.compile(rf"(?:{_UNIT}[ \t]*[0-9A-Z]{{1,5}},?[ \t]+|(?:{_UNIT}|House[ \t]+No\.?|Block)[ \t]*)\Z",
                          re.IGNORECASE)
# "12 rue de la Paix", "5 avenue des Champs-Élysées"
_FR_PARTICLE = r"(?:de|du|des|la|le|les|l'|l\u2019|d'|d\u2019|et|sur|en|à|aux?)"
_FR_STREET = re.compile(rf"[0-9]{{1,4}}(?:\s?(?:bis|ter|[A-Za-z]))?,?\s+(?i:rue|avenue|av\.|boulevard|bd|place|"
                        rf"chemin|allée|allee|impasse|quai|cours|route|passage|square|villa|cité)\s+"
                        rf"(?:{_FR_PARTICLE}\s*)*[A-ZÀ-Ý][\w'\u2019-]*"
                        rf"(?:\s+(?:{_FR_PARTICLE}\s*)*[A-ZÀ-Ý][\w'\u2019-]*){{0,4}}")
# "Hauptstraße 5", "Berliner Straße 12", "Keizersgracht 123": the street words end just before the number
_DE_NL_BEFORE = re.compile(r"(?:([A-ZÄÖÜ][\wäöüß-]+)\s+)?([A-ZÄÖÜ][\wäöüß.-]*)\s+\Z")
_COMPOUND = ("straße", "strasse", "str.", "weg", "gasse", "platz", "allee", "damm", "ufer", "chaussee", "straat",
             "laan", "gracht", "plein", "kade", "singel", "dijk")
_SEPARATE = frozenset({"Straße", "Strasse", "Str.", "Weg", "Platz", "Allee", "Gasse", "Ring", "Damm", "Ufer",
                       "Chaussee"})
_HOUSE_TAIL = re.compile(r"[0-9]*\s?[a-zA-Z]?(?:\s?-\s?[0-9]{1,4}[a-z]?)?(?!\w)")
# "Calle Mayor 10", "Via Roma 12", "Via Garibaldi, 5", "Rua Augusta 100"
_ROMANCE_TYPES = ("Calle", "C/", "Avenida", "Avda", "Plaza", "Pza", "Paseo", "Camino", "Carrer", "Carretera",
                  "Ronda", "Via", "Viale", "Piazza", "Piazzale", "Corso", "Largo", "Vicolo", "Rua", "Travessa",
                  "Praça")
_ROMANCE_PARTICLE = r"(?:de|del|de la|de los|de las|la|las|los|el|di|della|dei|degli|delle|da|do|dos|das|e|y|i|d')"
_ROMANCE_STREET = re.compile(
    rf"(?<!\w)(?:{'|'.join(re.escape(kind) for kind in _ROMANCE_TYPES)})\.?\s*(?:{_ROMANCE_PARTICLE}\s+)*"
    rf"[A-ZÀ-Ý][\w'\u2019.-]*(?:\s+(?:{_ROMANCE_PARTICLE}\s+)*[A-ZÀ-Ý][\w'\u2019.-]*){{0,3}},?\s*"
    r"(?:n[º°o]\.?\s*)?[0-9]{1,4}[A-Za-z]?(?!\w)")

_UK_POSTCODE = re.compile(r"[A-PR-UWYZ](?<![\w][A-PR-UWYZ])[A-HK-Y]?[0-9][0-9A-HJKPSTUW]? ?[0-9][ABD-HJLNP-UW-Z]{2}"
                          r"(?!\w)")
_CA_POSTCODE = re.compile(r"[ABCEGHJ-NPRSTVXY](?<![\w][ABCEGHJ-NPRSTVXY])[0-9][ABCEGHJ-NPRSTV-Z] ?[0-9]"
                          r"[ABCEGHJ-NPRSTV-Z][0-9](?!\w)")
_CAPITAL_DIGIT = re.compile(r"[A-Z][0-9]")
_US_STATES = frozenset({
    "AL", "AK", "AZ", "AR", "CA", "CO", "CT", "DE", "FL", "GA", "HI", "ID", "IL", "IN", "IA", "KS", "KY", "LA", "ME",
    "MD", "MA", "MI", "MN", "MS", "MO", "MT", "NE", "NV", "NH", "NJ", "NM", "NY", "NC", "ND", "OH", "OK", "OR", "PA",
    "RI", "SC", "SD", "TN", "TX", "UT", "VT", "VA", "WA", "WV", "WI", "WY", "DC", "PR",
})
_ZIP_WORDS = frozenset({"zip", "zipcode", "postcode", "plz"})
_ZIP_TAIL = re.compile(r"-[0-9]{4}(?![\w-])")
_NL_TAIL = re.compile(r" ?([A-Z]{2})(?!\w)")
# two capitals after four digits that are not a Dutch postcode: eras, units, sizes, country codes
_NOT_NL_SUFFIX = frozenset({"AD", "BC", "CE", "AM", "PM", "KM", "KG", "GB", "MB", "TB", "KB", "MG", "ML", "HZ", "KW",
                            "MW", "CC", "HP", "PS", "OK", "US", "UK", "EU", "TV", "PC", "ID", "CV", "BV", "NV", "MP",
                            "FT", "IN", "DB", "GW", "MM", "CM", "LB", "OZ", "ST", "ND", "RD", "TH", "GT", "XL", "IT"})
_CAPITALISED_WORD = re.compile(r"\s+[A-ZÄÖÜ][a-zäöüß]+")


def _find_numbered_streets(scan: Scan) -> Iterator[Span]:
    text, covered_to = scan.text, -1
    for start, _ in scan.runs:
        if start < covered_to or (start > 0 and (text[start - 1].isalnum() or text[start - 1] in "$£€.,/-")):
            continue
        match = _EN_STREET.match(text, start) or _FR_STREET.match(text, start)
        if match is None:
            lower = _EN_STREET_LOWER.match(text, start)
            match = lower if lower and _NOT_STREET_WORDS.isdisjoint(lower.group("words").split()) else None
        if match is not None:
            unit = _UNIT_BEFORE.search(text, max(0, start - 24), start)
            tail = _TOWN_TAIL.match(text, match.end()) if match.re is _EN_STREET else None
            covered_to = tail.end() if tail else match.end()
            yield make_span(unit.start() if unit else start, covered_to, Kind.ADDRESS, SCORE_LIKELY, "address")


def _find_named_streets(scan: Scan) -> Iterator[Span]:
    text = scan.text
    for start, end in scan.runs:
        if end - start > 4 or (start > 0 and not text[start - 1].isspace()) or not _street_word_before(scan, start):
            continue
        before = _DE_NL_BEFORE.search(text, max(0, start - 48), start)
        if before is None:
            continue
        first, street = before.group(1), before.group(2)
        compound = street.lower().endswith(_COMPOUND) and street.lower() not in _COMPOUND
        if compound or (first is not None and street in _SEPARATE):
            tail = _HOUSE_TAIL.match(text, end)
            begin = before.start(2) if compound else before.start(1)
            yield make_span(begin, tail.end() if tail else end, Kind.ADDRESS, SCORE_LIKELY, "address")
    if any(kind in text for kind in _ROMANCE_TYPES):
        for match in _ROMANCE_STREET.finditer(text):
            yield make_span(match.start(), match.end(), Kind.ADDRESS, SCORE_LIKELY, "address")


def _street_word_before(scan: Scan, start: int) -> bool:
    before = scan.word_before(start)
    if before is None or not before[1][:1].isupper():
        return False
    word = scan.text[before[0]:start].rstrip()
    return word.lower().endswith(_COMPOUND) or word in _SEPARATE


def _find_postcodes(scan: Scan) -> Iterator[Span]:
    text = scan.text
    if _CAPITAL_DIGIT.search(text):
        for pattern in (_UK_POSTCODE, _CA_POSTCODE):
            for match in pattern.finditer(text):
                yield make_span(match.start(), match.end(), Kind.ADDRESS, SCORE_LIKELY, "postcode")
    for start, end in scan.runs:
        if end - start not in (4, 5) or (start > 0 and (text[start - 1].isalnum() or text[start - 1] in ".,")):
            continue
        span = _dutch_postcode(text, start, end) if end - start == 4 else _five_digit_postcode(scan, start, end)
        if span is not None:
            yield span


def _dutch_postcode(text: str, start: int, end: int) -> Span | None:
    """"1012 AB": four digits (not after another number: "333 123 4567 IT") and two capitals."""
    tail = _NL_TAIL.match(text, end)
    if tail is None or tail.group(1) in _NOT_NL_SUFFIX or text[max(0, start - 2):start][:1].isdigit():
        return None
    if not nl_postcode.is_valid(text[start:tail.end()]):
        return None
    return make_span(start, tail.end(), Kind.ADDRESS, SCORE_LIKELY, "postcode")


def _five_digit_postcode(scan: Scan, start: int, end: int) -> Span | None:
    """"WA 98101", "zip 10001-1234", "D-10115", and (best effort) "10115 Berlin"."""
    text = scan.text
    plus_four = _ZIP_TAIL.match(text, end)
    last = plus_four.end() if plus_four else end
    if last < len(text) and (text[last].isalnum() or text[last] in "-_"):
        return None
    if text[max(0, start - 2):start] == "D-":
        return make_span(start - 2, last, Kind.ADDRESS, SCORE_LIKELY, "postcode")
    before = scan.word_before(start)
    if before is not None and (before[1] in _US_STATES or _is_zip_word(scan, before)):
        return make_span(start, last, Kind.ADDRESS, SCORE_LIKELY, "postcode")
    if _CAPITALISED_WORD.match(text, end):
        return make_span(start, end, Kind.ADDRESS, SCORE_WEAK, "postcode")
    return None


def _is_zip_word(scan: Scan, before: tuple[int, str]) -> bool:
    word = before[1].lower()
    if word != "code":
        return word in _ZIP_WORDS
    previous = scan.word_before(before[0])
    return previous is not None and previous[1].lower() in ("zip", "postal")


def find_addresses(scan: Scan) -> Iterator[Span]:
    yield from _find_numbered_streets(scan)
    yield from _find_named_streets(scan)
    yield from _find_postcodes(scan)
