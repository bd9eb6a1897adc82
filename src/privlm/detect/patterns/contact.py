"""Contact details: emails, URLs, IP addresses (``ipaddress``), social handles and phone numbers (``phonenumbers``)."""

from __future__ import annotations

import functools
import ipaddress
import re
from collections.abc import Iterator, Sequence

import phonenumbers
from phonenumbers import Leniency, PhoneNumberMatcher

from privlm.detect.patterns._common import (
    SCORE_LIKELY,
    SCORE_VALID,
    Scan,
    digit_count,
    make_span,
)
from privlm.detect.spans import Kind, Span

_EMAIL = re.compile(r"\w(?<![\w.%+-]\w)[\w.%+-]*@(?:\w(?:[\w-]*\w)?\.)+[^\W\d_]{2,24}(?![\w-])")
_URL = re.compile(r"(?<![\w@.])(?:https?://|www\.)[^\s<>\"'`]+", re.IGNORECASE)
_BARE_URL = re.compile(r"\w(?<![\w@.:/-]\w)[\w-]*(?:\.\w[\w-]*)*\.[a-z]{2,24}/[^\s<>\"'`]*", re.IGNORECASE)
_URL_TAIL = ".,;:!?'\"*"  # sentence punctuation after a URL is not part of it
_IPV4 = re.compile(r"[0-9](?<![\w.][0-9])[0-9]{0,2}(?:\.[0-9]{1,3}){3}(?!\w|\.[0-9])")
_IPV6 = re.compile(r"(?<![\w:.])(?:[0-9a-f]{0,4}:){2,7}(?:[0-9a-f]{1,4}|(?:[0-9]{1,3}\.){3}[0-9]{1,3})?(?![\w:])",
                   re.IGNORECASE)
_HANDLE = re.compile(r"@(?<![\w@./]@)(?=[\w.]*[A-Za-z])[A-Za-z0-9_](?:[A-Za-z0-9_.]{0,28}[A-Za-z0-9_])?(?![\w@])")
_CLOCK = re.compile(r"[0-9]{1,2}(?:am|pm)", re.IGNORECASE)  # "@10am" is a time, not a handle
_VERSION_WORDS = frozenset({"version", "ver", "release", "build", "v"})  # "version 1.2.3.4" is not an address

# digits with at most one separator between them, an optional "+" or "(" first: what a phone can look like
_PHONE_CANDIDATE = re.compile(r"[+(0-9](?<![\w+.\-/][+(0-9])(?:(?<=\+) ?[0-9]|(?<=\()[0-9]|(?<=[0-9]))"
                              r"(?:(?:[ .\-/]|\) ?| ?\(| - )?[0-9]){6,16}(?![\w]|[.\-/][0-9])")
_PHONE_WORDS = frozenset({"phone", "tel", "telephone", "mobile", "cell", "call", "ring", "text", "whatsapp", "fax",
                          "contact", "number", "no", "nr", "handy", "portable", "téléphone", "telefon", "teléfono",
                          "móvil", "movil", "cellulare", "telefono", "numéro", "nummer", "número", "numero"})
_NOT_PHONE_WORDS = frozenset({"sku", "model", "part", "item", "product", "version", "isbn", "serial", "article",
                              "art", "ref", "lot", "batch"})
PHONE_REGIONS = ("US", "GB", "DE", "FR", "ES", "IT", "IN", "BR", "NL", "AU", "CA", "PL", "NG", "JP", "CN")
# regions whose fiction ranges (US 555-01xx, UK 07700 900xxx) phonenumbers calls possible but not valid
_LENIENT_REGIONS = frozenset({"US", "CA", "GB"})
_MIN_PHONE_DIGITS = 7
# an age or an amount next to digits ("Paulo (11) 91234-5678") does not hide a phone
_PHONE_YIELDS_TO = frozenset({Kind.DATE, Kind.IDENTIFIER, Kind.CONTACT, Kind.ADDRESS})


def find_emails(scan: Scan) -> Iterator[Span]:
    if "@" in scan.text:
        for match in _EMAIL.finditer(scan.text):
            yield make_span(match.start(), match.end(), Kind.CONTACT, SCORE_VALID, "email")


def find_urls(scan: Scan) -> Iterator[Span]:
    text = scan.text
    patterns = []
    if "://" in text or "www." in text or "WWW." in text:
        patterns.append((_URL, SCORE_VALID))
    if "/" in text and "." in text:
        patterns.append((_BARE_URL, SCORE_LIKELY))
    for pattern, score in patterns:
        for match in pattern.finditer(text):
            end = _trim_url(text, match.start(), match.end())
            if end - match.start() > 4:
                yield make_span(match.start(), end, Kind.CONTACT, score, "url")


def _trim_url(text: str, start: int, end: int) -> int:
    while end > start and (text[end - 1] in _URL_TAIL or _unbalanced_close(text[start:end])):
        end -= 1
    return end


def _unbalanced_close(url: str) -> bool:
    closer = url[-1]
    opener = {")": "(", "]": "[", "}": "{"}.get(closer)
    return opener is not None and url.count(closer) > url.count(opener)


def find_ips(scan: Scan) -> Iterator[Span]:
    text = scan.text
    if scan.has_chunk(lambda chunk: chunk.count(".") >= 3):
        for match in _IPV4.finditer(text):
            before = scan.word_before(match.start())
            if _is_ip(match.group(), ipaddress.IPv4Address) and not (before and before[1].lower() in _VERSION_WORDS):
                yield make_span(match.start(), match.end(), Kind.CONTACT, SCORE_VALID, "ip")
    if text.count(":") >= 2:
        for match in _IPV6.finditer(text):
            hex_digits = sum(char not in ":." for char in match.group())
            if hex_digits >= 4 and _is_ip(match.group(), ipaddress.IPv6Address):
                yield make_span(match.start(), match.end(), Kind.CONTACT, SCORE_VALID, "ip")


def _is_ip(value: str, parse: type[ipaddress.IPv4Address] | type[ipaddress.IPv6Address]) -> bool:
    try:
        parse(value)
    except ValueError:
        return False
    return True


def find_handles(scan: Scan) -> Iterator[Span]:
    if "@" in scan.text:
        for match in _HANDLE.finditer(scan.text):
            if not _CLOCK.fullmatch(match.group()[1:]):
                yield make_span(match.start(), match.end(), Kind.CONTACT, SCORE_LIKELY, "handle")


def find_phones(scan: Scan, taken: Sequence[Span]) -> Iterator[Span]:
    """Phone numbers outside the sure spans of ``taken`` (dates, IPs, cards and ids found first): valid in one of
    the regions (1.0), or possible where fiction ranges live or after a phone keyword (0.9). A bare digit run is a
    phone only after a phone keyword; otherwise the bare-number rule has it."""
    if scan.chunk_digits < 6:
        return
    text = scan.text
    sure = [span for span in taken if span.score >= SCORE_LIKELY and span.kind in _PHONE_YIELDS_TO]
    for candidate in _PHONE_CANDIDATE.finditer(text):
        start, end = candidate.span()
        if digit_count(candidate.group()) < _MIN_PHONE_DIGITS or _covered(start, end, sure):
            continue
        words = set(scan.words_before(start))
        keyword = not words.isdisjoint(_PHONE_WORDS)
        if not words.isdisjoint(_NOT_PHONE_WORDS) or (candidate.group().isdigit() and not keyword):
            continue
        for rel_start, rel_end, valid, lenient in _phone_matches(candidate.group()):
            abs_start, abs_end = start + rel_start, start + rel_end
            if digit_count(text[abs_start:abs_end]) < _MIN_PHONE_DIGITS or _overlaps(abs_start, abs_end, sure):
                continue
            if valid or lenient or keyword:
                yield make_span(abs_start, abs_end, Kind.CONTACT, SCORE_VALID if valid else SCORE_LIKELY, "phone")


def _covered(start: int, end: int, taken: Sequence[Span]) -> bool:
    return any(span.start <= start and end <= span.end for span in taken)


def _overlaps(start: int, end: int, taken: Sequence[Span]) -> bool:
    return any(span.start < end and start < span.end for span in taken)


@functools.lru_cache(maxsize=8192)
def _phone_matches(candidate: str) -> tuple[tuple[int, int, bool, bool], ...]:
    """``(start, end, valid, possible where fiction lives)`` of the phone numbers in ``candidate``, overlapping
    matches from several regions reduced to the best (valid first, then longest). Cached: each region's matcher
    costs tens of microseconds, and the same number recurs across a conversation."""
    international = candidate.startswith("+")
    found: dict[tuple[int, int], tuple[bool, bool]] = {}
    for region in PHONE_REGIONS[:1] if international else PHONE_REGIONS:
        for match in PhoneNumberMatcher(candidate, region, leniency=Leniency.POSSIBLE):
            valid = phonenumbers.is_valid_number(match.number)
            lenient = international or region in _LENIENT_REGIONS
            seen_valid, seen_lenient = found.get((match.start, match.end), (False, False))
            found[(match.start, match.end)] = (seen_valid or valid, seen_lenient or lenient)
        if found.get((0, len(candidate)), (False, False))[0]:
            break  # the whole candidate is a valid number: no other region can do better
    return _best_phones(found)


def _best_phones(found: dict[tuple[int, int], tuple[bool, bool]]) -> tuple[tuple[int, int, bool, bool], ...]:
    ranked = sorted(found.items(), key=lambda item: (not item[1][0], -(item[0][1] - item[0][0]), item[0][0]))
    kept: list[tuple[int, int, bool, bool]] = []
    for (start, end), (valid, lenient) in ranked:
        if all(end <= other[0] or other[1] <= start for other in kept):
            kept.append((start, end, valid, lenient))
    return tuple(sorted(kept))
