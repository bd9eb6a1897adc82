"""Dates: written with a month name (English, German, French, Spanish, Italian, Dutch), numeric (day/month/year in
either order, ISO, compact), month and year, and years 1900-2099 that a word before them makes a person's year."""

from __future__ import annotations

import datetime
import re
from collections.abc import Iterator

from privlm.detect.patterns._common import SCORE_LIKELY, SCORE_VALID, SCORE_WEAK, Scan, make_span
from privlm.detect.spans import Kind, Span

_MONTH_NAMES: dict[int, tuple[str, ...]] = {
    1: ("january", "jan", "januar", "janvier", "enero", "gennaio", "januari", "jänner"),
    2: ("february", "feb", "februar", "février", "fevrier", "febrero", "febbraio", "februari"),
    3: ("march", "mar", "märz", "maerz", "mars", "marzo", "maart"),
    4: ("april", "apr", "avril", "abril", "aprile"),
    5: ("may", "mai", "mayo", "maggio", "mei"),
    6: ("june", "jun", "juni", "juin", "junio", "giugno"),
    7: ("july", "jul", "juli", "juillet", "julio", "luglio"),
    8: ("august", "aug", "août", "aout", "agosto", "augustus"),
    9: ("september", "sep", "sept", "septembre", "septiembre", "setiembre", "settembre"),
    10: ("october", "oct", "oktober", "octobre", "octubre", "ottobre", "okt"),
    11: ("november", "nov", "novembre", "noviembre"),
    12: ("december", "dec", "dezember", "décembre", "decembre", "diciembre", "dicembre", "dez"),
}
_MONTH_NUMBER = {name: number for number, names in _MONTH_NAMES.items() for name in names}
_MONTH = "|".join(sorted(_MONTH_NUMBER, key=len, reverse=True))
_YEAR = r"(?:19|20)[0-9]{2}"
_ORDINAL = r"(?:st|nd|rd|th|er|e|º|°|\.)?"

# anchored at a month name or a day found next to a digit run: never scanned over the whole text
_MONTH_DAY = re.compile(rf"(?P<month>{_MONTH})\.?\s+(?P<day>[0-9]{{1,2}}){_ORDINAL}(?!\w)"
                        rf"(?:,?\s+(?P<year>{_YEAR})(?!\w))?", re.IGNORECASE)
_MONTH_YEAR = re.compile(rf"(?P<month>{_MONTH})\.?,?\s+(?:of\s+|de\s+)?(?P<year>{_YEAR})(?!\w)", re.IGNORECASE)
_DAY_MONTH = re.compile(rf"(?P<day>[0-9]{{1,2}}){_ORDINAL}\s*(?:of\s+|de\s+)?(?P<month>{_MONTH})\.?(?!\w)"
                        rf"(?:,?\s*(?:de\s+)?(?P<year>{_YEAR})(?!\w))?", re.IGNORECASE)
_WORD_AFTER_DAY = re.compile(rf"{_ORDINAL}\s*(?:of\s+|de\s+)?([^\W\d_]+)", re.IGNORECASE)
_NUMERIC = re.compile(r"[0-9](?<![\w./:-][0-9])[0-9]?(?P<sep>[./-])(?P<b>[0-9]{1,2})(?P=sep)"
                      r"(?P<year>[0-9]{4}|[0-9]{2})(?!\w|[./:-][0-9])")
_ISO = re.compile(r"[12](?<![\w./:-][12])[0-9]{3}(?P<sep>[./-])(?P<month>[0-9]{1,2})(?P=sep)(?P<day>[0-9]{1,2})"
                  r"(?:T[0-9]{2}:[0-9]{2}(?::[0-9]{2}(?:\.[0-9]+)?)?(?:Z|[+-][0-9]{2}:?[0-9]{2})?)?(?!\w|[./:-][0-9])")
_RANGE_TAIL = re.compile(rf"\s*(?:-|\u2013|\u2014|to|until|till)\s*(?P<year>{_YEAR})(?!\w|[.,][0-9])", re.IGNORECASE)
# a year after one of these (or after two of them: "class of", "back in") is a person's year
_YEAR_WORDS = frozenset({
    "born", "b", "dob", "birth", "since", "in", "from", "until", "till", "til", "circa", "ca", "c", "around",
    "before", "after", "during", "by", "early", "mid", "late", "summer", "winter", "spring", "autumn", "fall",
    "graduated", "married", "divorced", "died", "retired", "joined", "started", "moved", "year", "geboren", "seit",
    "né", "née", "nacido", "nacida", "nato", "nata", "sinds", "desde", "dal", "depuis",
})
_YEAR_PAIRS = frozenset({"class of", "as of", "summer of", "winter of", "spring of", "autumn of", "fall of",
                         "year of", "back in"})


def _is_date(year: int, month: int, day: int) -> bool:
    try:
        datetime.date(year, month, day)
    except ValueError:
        return False
    return True


def _named(match: re.Match[str]) -> Span | None:
    day, year = match.groupdict().get("day"), match.groupdict().get("year")
    if day and not _is_date(2000, _MONTH_NUMBER[match["month"].lower()], int(day)):
        return None  # 2000 is a leap year: 29 February fits
    score = SCORE_VALID if day and year else SCORE_LIKELY
    end = match.end() - match.group().endswith(".")  # "22nd of July." ends a sentence
    return make_span(match.start(), end, Kind.DATE, score, "date")


def _find_named(scan: Scan) -> Iterator[Span]:
    text = scan.text
    for start, end in scan.runs:
        if end - start not in (1, 2, 4) or (start > 0 and text[start - 1].isalnum()):
            continue  # a day may carry its ordinal ("22nd"), so only the left side is checked here
        if end - start <= 2:
            after = _WORD_AFTER_DAY.match(text, end)
            if after and after.group(1).lower() in _MONTH_NUMBER and (match := _DAY_MONTH.match(text, start)):
                yield from filter(None, [_named(match)])
        before = scan.word_before(start)
        if before and before[1].lower() in _MONTH_NUMBER and (before[0] == 0 or not text[before[0] - 1].isalnum()):
            match = _MONTH_DAY.match(text, before[0]) or _MONTH_YEAR.match(text, before[0])
            if match:
                yield from filter(None, [_named(match)])


def _find_numeric(scan: Scan) -> Iterator[Span]:
    text = scan.text
    if scan.has_chunk(lambda chunk: any(chunk.count(sep) >= 2 for sep in "./-")):
        for match in _NUMERIC.finditer(text):
            first, second, year = int(text[match.start():match.start("sep")]), int(match["b"]), match["year"]
            full_year = int(year) if len(year) == 4 else 2000 + int(year)
            if len(year) == 4 and not 1900 <= full_year <= 2099:
                continue
            if _is_date(full_year, second, first) or _is_date(full_year, first, second):
                yield make_span(match.start(), match.end(), Kind.DATE, SCORE_VALID, "date")
        for match in _ISO.finditer(text):
            year = int(text[match.start():match.start("sep")])
            if 1900 <= year <= 2099 and _is_date(year, int(match["month"]), int(match["day"])):
                yield make_span(match.start(), match.end(), Kind.DATE, SCORE_VALID, "date")
    for start, end in scan.runs_of((8,)):  # "19850322": a date, or an order or build number that looks like one
        value = text[start:end]
        if value[:2] in ("19", "20") and _is_date(int(value[:4]), int(value[4:6]), int(value[6:])):
            yield make_span(start, end, Kind.DATE, SCORE_WEAK, "date")


def _find_years(scan: Scan) -> Iterator[Span]:
    text = scan.text
    for start, end in scan.runs_of((4,)):
        if not 1900 <= int(text[start:end]) <= 2099:
            continue
        range_tail = _RANGE_TAIL.match(text, end)
        if range_tail:  # "2015-2019", "1990 to 1995"
            yield make_span(start, end, Kind.DATE, SCORE_LIKELY, "year")
            yield make_span(range_tail.start("year"), range_tail.end("year"), Kind.DATE, SCORE_LIKELY, "year")
        elif _person_year_word(scan, start):
            yield make_span(start, end, Kind.DATE, SCORE_LIKELY, "year")


def _person_year_word(scan: Scan, start: int) -> bool:
    before = scan.word_before(start)
    if before is None:
        return False
    word = before[1].lower()
    if word in _YEAR_WORDS:
        return True
    previous = scan.word_before(before[0])
    return previous is not None and f"{previous[1].lower()} {word}" in _YEAR_PAIRS


_WEEKDAY_BEFORE = re.compile(
    r"(?:(?:mon|tues|wednes|thurs|fri|satur|sun)day|(?:mon|tue|wed|thu|fri|sat|sun)\.?),?\s+\Z", re.IGNORECASE)


def _with_weekday(scan: Scan, span: Span) -> Span:
    # "Monday 16 June": the weekday dates the event too, and left out it would stay verbatim beside the date
    before = _WEEKDAY_BEFORE.search(scan.text, max(0, span.start - 12), span.start)
    return Span(before.start(), span.end, span.kind, span.score, span.source) if before else span


def find_dates(scan: Scan) -> Iterator[Span]:
    for finder in (_find_named, _find_numeric, _find_years):
        yield from (_with_weekday(scan, span) for span in finder(scan))
