"""Identifiers: IBANs, payment cards and national ids validated by ``python-stdnum``; record, policy, account and
other numbers after a keyword; card endings; long bare digit runs."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from stdnum import iban, luhn
from stdnum.br import cpf
from stdnum.ca import sin
from stdnum.de import idnr
from stdnum.es import dni, nie
from stdnum.fr import nir
from stdnum.gb import nhs
from stdnum.in_ import aadhaar, pan
from stdnum.it import codicefiscale
from stdnum.nl import bsn
from stdnum.us import ssn

from privlm.detect.patterns._common import (
    SCORE_LIKELY,
    SCORE_VALID,
    SCORE_WEAK,
    Scan,
    digit_count,
    has_keyword,
    keyword_then_fillers,
    looks_like_year,
    make_span,
)
from privlm.detect.spans import Kind, Span

# starts at the check digits (a character class re skips to), then looks back for the country code
_IBAN = re.compile(r"[0-9]{2}(?<=[A-Za-z]{2}[0-9]{2})(?<![\w][A-Za-z]{2}[0-9]{2})(?:[ ]?[A-Za-z0-9]){11,30}(?!\w)")
_CARD = re.compile(r"[0-9](?<![\w.,-][0-9])(?:[ -]?[0-9]){12,18}(?!\w|[.,-]?[0-9])")
_GROUP_SEPARATOR = re.compile(r"[ -]")
_CARD_LOOK = re.compile(r"[0-9]{4}([ -])[0-9]{4}\1[0-9]{4}\1[0-9]{4}(?![0-9])")


@dataclass(frozen=True)
class _IdRule:
    what: str
    shape: re.Pattern[str]
    is_valid: Callable[[str], bool]
    min_digits: int  # the rule is tried only on a digit chunk this long
    keywords: frozenset[str] = frozenset()  # when set, one must occur in the 40 characters before the value
    score: float = SCORE_VALID
    offsets: tuple[int, ...] = (0,)  # where the shape may start, from the start of a digit run ("AB 12": -3)


def _shape(first: str, rest: str, flags: int = 0) -> re.Pattern[str]:
    """A whole-token shape that starts with the character class ``first``, which re can skip to quickly."""
    return re.compile(rf"{first}(?<![\w.-]{first}){rest}(?![\w]|[.-][0-9])", flags)


def _ssn_valid(value: str) -> bool:
    return ssn.is_valid(value.replace(" ", "-"))  # stdnum cleans dashes only


_NI_BAD_PREFIXES = frozenset({"BG", "GB", "NK", "KN", "TN", "NT", "ZZ"})
_SIN_WORDS = frozenset({"sin", "nas", "social insurance", "assurance sociale"})
# Ids whose shape is only "N digits" need a keyword: a 1-in-10 check digit alone would flag every tenth number.
_ID_RULES: tuple[_IdRule, ...] = (
    _IdRule("ssn", _shape("[0-9]", r"[0-9]{2}([- ])[0-9]{2}\1[0-9]{4}"), _ssn_valid, 9),
    _IdRule("ssn", _shape("[0-9]", r"[0-9]{8}"), ssn.is_valid, 9, frozenset({"ssn", "social security"})),
    _IdRule("nhs", _shape("[0-9]", r"[0-9]{2}([- ]?)[0-9]{3}\1[0-9]{4}"), nhs.is_valid, 10, frozenset({"nhs"})),
    _IdRule("ni", _shape("[A-CEGHJ-PR-TW-Z]", r"[A-CEGHJ-NPR-TW-Z] ?[0-9]{2} ?[0-9]{2} ?[0-9]{2} ?[A-D]", re.I),
            lambda value: value[:2].upper() not in _NI_BAD_PREFIXES, 6, score=SCORE_LIKELY, offsets=(-3, -2)),
    # 3-3-3 digits is also how Spain, France and Poland write phones: without its keyword a SIN yields to a phone
    _IdRule("sin", _shape("[0-9]", r"[0-9]{2}([- ])[0-9]{3}\1[0-9]{3}"), sin.is_valid, 9, score=SCORE_WEAK),
    _IdRule("sin", _shape("[0-9]", r"[0-9]{2}([- ]?)[0-9]{3}\1[0-9]{3}"), sin.is_valid, 9, _SIN_WORDS),
    _IdRule("bsn", _shape("[0-9]", r"[0-9]{3}\.?[0-9]{2}\.?[0-9]{3}"), bsn.is_valid, 9,
            frozenset({"bsn", "burgerservicenummer", "sofinummer", "sofi"})),
    _IdRule("idnr", _shape("[0-9]", r"[0-9] ?[0-9]{3} ?[0-9]{3} ?[0-9]{3}"), idnr.is_valid, 11,
            frozenset({"idnr", "nr", "steuer", "steuerid", "id", "steueridentifikationsnummer",
                       "identifikationsnummer", "tax id"})),
    _IdRule("nir", _shape("[12]", r" ?[0-9]{2} ?[0-9]{2} ?(?:[0-9]{2}|2[AB]) ?[0-9]{3} ?[0-9]{3} ?[0-9]{2}", re.I),
            nir.is_valid, 8),
    _IdRule("dni", _shape("[0-9]", r"[0-9]{7}-?[A-Z]", re.IGNORECASE), dni.is_valid, 8),
    _IdRule("nie", _shape("[XYZxyz]", r"-?[0-9]{7}-?[A-Z]", re.IGNORECASE), nie.is_valid, 7, offsets=(-2, -1)),
    _IdRule("codice-fiscale", _shape("[A-Z]", r"[A-Z]{5}[0-9LMNPQRSTUV]{2}[ABCDEHLMPRST][0-9LMNPQRSTUV]{2}[A-Z]"
                                     r"[0-9LMNPQRSTUV]{3}[A-Z]", re.IGNORECASE), codicefiscale.is_valid, 2,
            offsets=(-6,)),
    _IdRule("aadhaar", _shape("[2-9]", r"[0-9]{3}([ -])[0-9]{4}\1[0-9]{4}"), aadhaar.is_valid, 12),
    _IdRule("aadhaar", _shape("[2-9]", r"[0-9]{11}"), aadhaar.is_valid, 12,
            frozenset({"aadhaar", "aadhar", "uid", "uidai"})),
    _IdRule("pan", _shape("[A-Z]", r"[A-Z]{2}[ABCFGHLJPT][A-Z][0-9]{4}[A-Z]", re.IGNORECASE), pan.is_valid, 4,
            score=SCORE_LIKELY, offsets=(-5,)),
    _IdRule("cpf", _shape("[0-9]", r"[0-9]{2}\.?[0-9]{3}\.?[0-9]{3}-?[0-9]{2}"), cpf.is_valid, 11),
)

# a value after one of these words (and fillers: "account number is 12345678") is an identifier
_ID_KEYWORDS = frozenset({
    "account", "acct", "iban", "bic", "swift", "routing", "sort code", "policy", "mrn", "medical record", "patient",
    "record", "insurance", "health card", "member", "membership", "customer", "client", "subscriber", "order", "case",
    "claim", "reference", "ref", "invoice", "ticket", "booking", "reservation", "confirmation", "tracking", "employee",
    "staff", "student", "badge", "payroll", "tax", "tin", "vat", "ein", "npi", "nino", "ni number",
    "national insurance", "passport", "licence", "license", "dl", "ssn", "social security", "social insurance", "nhs",
    "bsn", "aadhaar", "aadhar", "pan card", "cpf", "dni", "nie", "nif", "id", "identity card", "card", "registration",
    "plate", "vin", "pin", "permit", "visa", "certificate", "file", "dossier", "kundennummer", "versichertennummer",
})
_ID_FILLERS = frozenset({"number", "num", "no", "nr", "n", "id", "code", "ref", "is", "was", "my", "your", "his",
                         "her", "their", "our", "the", "s", "a", "c"})
_VALUE = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9]|[-/.](?=[A-Za-z0-9])|\s(?=[0-9]{2,}(?!\w)))*(?!\w)")
_ENDING = re.compile(r"(?:\b(?:ending|ends|end)\s+(?:in|with)|\blast\s+(?:four|4)(?:\s+digits)?(?:\s+(?:are|is|were|"
                     r"of\s+\w+(?:\s+\w+)?))?)\s*:?\s*\Z", re.IGNORECASE)


def find_ibans(scan: Scan) -> Iterator[Span]:
    """Valid IBANs; an IBAN-shaped value that fails its check (a typo, a made-up one) is still an identifier."""
    if scan.chunk_digits < 8:
        return
    for match in _IBAN.finditer(scan.text):
        start, value = match.start() - 2, scan.text[match.start() - 2:match.end()]
        end = _longest_valid(value, _iban_valid, 15)
        if end:
            yield make_span(start, start + end, Kind.IDENTIFIER, SCORE_VALID, "iban")
            continue
        end = _without_trailing_words(value)
        if len(value[:end].replace(" ", "")) >= 15:
            yield make_span(start, start + end, Kind.IDENTIFIER, SCORE_WEAK, "id")


def _iban_valid(value: str) -> bool:
    # the ISO 7064 mod-97 check costs a microsecond; stdnum's full check (country lengths, BBAN) tens of them
    compact = value.replace(" ", "").upper()
    rearranged = compact[4:] + compact[:4]
    try:
        remainder = int("".join(str(int(char, 36)) for char in rearranged)) % 97
    except ValueError:
        return False
    return remainder == 1 and iban.is_valid(compact)


def _without_trailing_words(value: str) -> int:
    groups = value.split(" ")
    while len(groups) > 1 and not any(char.isdigit() for char in groups[-1]):
        groups.pop()
    return len(" ".join(groups))


def find_cards(scan: Scan) -> Iterator[Span]:
    if scan.chunk_digits < 13:
        return
    for match in _CARD.finditer(scan.text):
        end = _longest_valid(match.group(), _card_valid, 13)
        if end:
            yield make_span(match.start(), match.start() + end, Kind.IDENTIFIER, SCORE_VALID, "card")
        elif _CARD_LOOK.match(match.group()):  # "4111 1111 1111 1112": no card, still a number to keep private
            yield make_span(match.start(), match.start() + 19, Kind.IDENTIFIER, SCORE_WEAK, "id")


def _card_valid(value: str) -> bool:
    digits = value.replace(" ", "").replace("-", "")
    return 13 <= len(digits) <= 19 and luhn.is_valid(digits)


def _longest_valid(value: str, is_valid: Callable[[str], bool], min_length: int) -> int:
    """The length of the longest prefix of ``value`` that ends at a group boundary and is valid, or 0. A greedy
    shape can run into the next word ("GB82 WEST 1234 5698 7654 32 for") or number ("... 1111 12/27")."""
    ends = [sep.start() for sep in _GROUP_SEPARATOR.finditer(value)] + [len(value)]
    for end in reversed(ends):
        if end >= min_length and is_valid(value[:end]):
            return end
    return 0


def find_national_ids(scan: Scan) -> Iterator[Span]:
    """Each rule's shape tried where it may start around a digit run (an anchored match, not a scan of the text),
    then its keyword and its checksum."""
    text = scan.text
    rules = [rule for rule in _ID_RULES if rule.min_digits <= scan.chunk_digits]
    for (run_start, _), chunk_digits in zip(scan.runs, scan.run_chunk_digits, strict=True):
        starts_token = run_start == 0 or not (text[run_start - 1].isalnum() or text[run_start - 1] in "_.-")
        for rule in rules:
            if rule.min_digits > chunk_digits:
                continue
            for offset in rule.offsets:
                # a digit-first shape starts a token; a letter-first one starts at a letter
                at = run_start + offset
                if at < 0 or (not starts_token if offset == 0 else not text[at].isalpha()):
                    continue
                match = rule.shape.match(text, at)
                if match is None:
                    continue
                if rule.keywords and not has_keyword(scan.words_before(match.start()), rule.keywords):
                    continue
                if rule.is_valid(match.group()):
                    yield make_span(match.start(), match.end(), Kind.IDENTIFIER, rule.score, rule.what)


def find_keyword_ids(scan: Scan) -> Iterator[Span]:
    """A value with at least three digits after an id keyword ("MRN: 00482913", "policy # AB-7734-221"), and the
    four digits of "card ending in 4242"."""
    text, covered_to = scan.text, -1
    for run_start, run_end in scan.runs:
        if run_start < covered_to:
            continue
        start = _token_start(text, run_start)
        match = _VALUE.match(text, start)
        if match is None:
            continue
        covered_to, value = match.end(), match.group()
        if _id_value(value) and keyword_then_fillers(scan.words_before(start), _ID_KEYWORDS, _ID_FILLERS):
            yield make_span(start, match.end(), Kind.IDENTIFIER, SCORE_LIKELY, "id")
        if run_end - run_start == 4 and value.isdigit() and _ending_before(scan, start):
            yield make_span(start, match.end(), Kind.IDENTIFIER, SCORE_LIKELY, "card-ending")


def _id_value(value: str) -> bool:
    return digit_count(value) >= 3 and not looks_like_year(value)


def _ending_before(scan: Scan, start: int) -> bool:
    words = scan.words_before(start)
    if not ("ending" in words or "ends" in words or "end" in words or "last" in words):
        return False
    return _ENDING.search(scan.text, max(0, start - 40), start) is not None


def _token_start(text: str, start: int) -> int:
    """Where the letters-digits-and-dashes token around ``text[start]`` begins ("AB-7734-221" from "7734")."""
    while start > 0:
        before = text[start - 1]
        joined = before in "-/." and start > 1 and _is_ascii_alnum(text[start - 2])
        if not (_is_ascii_alnum(before) or joined):
            break
        start -= 1
    return start


def _is_ascii_alnum(char: str) -> bool:
    return char.isascii() and char.isalnum()


def find_bare_numbers(scan: Scan, taken: Sequence[Span]) -> Iterator[Span]:
    """Runs of 8 or more digits that no other pattern explained: account-like, with no checksum to go on."""
    for start, end in scan.runs_of(range(8, 40)):
        if not any(span.start < end and start < span.end for span in taken):
            yield make_span(start, end, Kind.IDENTIFIER, SCORE_WEAK, "number")


def find_identifiers(scan: Scan) -> Iterator[Span]:
    yield from find_ibans(scan)
    yield from find_cards(scan)
    yield from find_national_ids(scan)
    yield from find_keyword_ids(scan)
