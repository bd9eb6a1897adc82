"""The pattern layer: personal details that have a shape, validated by well-kept libraries where one exists.

``PatternLayer().detect(texts)`` returns typed spans whose ``source`` is ``"pattern:<what>"``: email, url, ip,
handle, phone (``phonenumbers``), iban, card (Luhn), ssn, nhs, ni, sin, bsn, idnr, nir, dni, nie, codice-fiscale,
aadhaar, pan, cpf (``python-stdnum``), id (a value after an id keyword, or a card- or IBAN-shaped value that fails
its check), card-ending, number (a bare digit run), date, year, age, amount, address and postcode. Every regular
expression is compiled once, at import; the finders are driven by the digit runs of the text (``_common``).

Scores. 1.0: the value passed a checksum or a library's validity test (IBAN, card, national ids, a phone number
``phonenumbers`` calls valid in one of 15 regions, an IP ``ipaddress`` parses, a real calendar date), or its form
can be nothing else (an email, a URL with a scheme, "34 years old", "aged 34", "$85,000"). 0.9: the right shape
with a keyword around it ("MRN: 00482913", "I am 34", "salary of 85000"), a strict shape without a checksum (UK NI
number, PAN, postcodes, street addresses), a date without a year, a phone number that is possible but not valid (the
fiction ranges US 555-01xx and UK 07700 900xxx; other regions' merely possible numbers only after a phone keyword).
0.8: a bare run of eight or more digits that nothing else explained, a card-shaped (4-4-4-4) or IBAN-shaped value
that fails its check, a compact date "19850322", a SIN with separators but no keyword (Spain, France and Poland
write phones 3-3-3), a five-digit number before a capitalised word (a German postcode, best effort). Recall comes
first: a missed detail leaks, an extra span costs a little, and the detector's per-kind thresholds decide.

A card-shaped number that fails Luhn is never ``pattern:card``. Ids whose only shape is "N digits" (SSN without
dashes, NHS, SIN, BSN, German IdNr, Aadhaar without spaces) need their keyword in the 40 characters before, since
a check digit alone would pass about one number in ten. A bare digit run is a phone only after a phone keyword.

Years. A year 1900-2099 on its own is not a date ("top 2000", "2048 bytes"). It is one right after a word that
makes it a person's year: born, b., DOB, birth, since, in, from, until, till, circa, around, before, after, during,
by, early/mid/late, summer/winter/spring/autumn/fall (of), class of, as of, back in, year (of), graduated, married,
divorced, died, retired, joined, started, moved (and geboren, seit, né(e), nacido/a, nato/a, sinds, desde, dal,
depuis); and both ends of a range ("2015-2019", "1990 to 1995"). Month and year ("March 1985") and full dates are
dates whatever the words around them. Month names: English (with abbreviations), German, French, Spanish, Italian,
Dutch.

Ages: the span is the number ("34" in "34 years old", "forties" in "in my forties"); where the number is glued to
its unit ("70yo", "67M") the span is the whole word, since a span never ends inside a word.

Known false positives (recall first; the tests pin the negatives that must not match): "in 2000 ways" (a year
after "in"); a four-part version number "1.2.3.4" (a valid IPv4) unless "version" is the word before; "3.11.75"
(a valid date); a long number with separators ("12.345.678", an ISBN without its keyword) that ``phonenumbers``
finds valid somewhere; "raised 67M" (clinical age shorthand); "2 Green Park tickets" (a street address);
"@home" (a handle); "I turned 3 pages" and "I am 5 stories up" (ages: the unit is not on the list). Phones
overlapping a surer date, IP, card, id or postcode are dropped, so "22.07.2026" is a date only, although
``phonenumbers`` calls it a valid German number; ages and amounts never hide a phone.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence

from privlm.detect.patterns._common import Scan
from privlm.detect.patterns.addresses import find_addresses
from privlm.detect.patterns.contact import find_emails, find_handles, find_ips, find_phones, find_urls
from privlm.detect.patterns.dates import find_dates
from privlm.detect.patterns.identifiers import find_bare_numbers, find_identifiers
from privlm.detect.patterns.quantities import find_ages, find_amounts, find_decades
from privlm.detect.spans import Span, widen_to_words

Finder = Callable[[Scan], Iterator[Span]]
# Finders that need no digit in the text; the others are skipped when a text has none.
_WITHOUT_DIGITS: tuple[Finder, ...] = (find_emails, find_urls, find_handles, find_ips, find_decades)
_WITH_DIGITS: tuple[Finder, ...] = (find_identifiers, find_dates, find_ages, find_amounts, find_addresses)


class PatternLayer:
    """Validated patterns: contact details, identifiers, dates, ages, amounts and addresses (module docstring)."""

    name = "patterns"

    def detect(self, texts: Sequence[str]) -> list[list[Span]]:
        return [self.detect_one(text) for text in texts]

    def detect_one(self, text: str) -> list[Span]:
        scan = Scan(text)
        found = [span for finder in _WITHOUT_DIGITS for span in finder(scan)]
        if scan.runs:
            found.extend(span for finder in _WITH_DIGITS for span in finder(scan))
            # phones and bare numbers only where nothing more specific was found: "22.07.2026" is a date
            found.extend(find_phones(scan, found))
            found.extend(find_bare_numbers(scan, found))
        return _tidy(text, found)


def _tidy(text: str, spans: Iterable[Span]) -> list[Span]:
    """Whole words, sorted, without a span that another of its kind, at least as sure, contains: "$85k" and "85k"
    become "$85k"; a validated card inside a longer keyword id stays."""
    widened = []
    for span in spans:
        start, end = widen_to_words(text, span.start, span.end)
        if start < end:
            widened.append(Span(start, end, span.kind, span.score, span.source))
    widened.sort(key=lambda s: (s.start, -(s.end - s.start), -s.score))
    kept: list[Span] = []
    for span in widened:
        if not any(k.kind == span.kind and k.start <= span.start and span.end <= k.end and k.score >= span.score
                   for k in kept):
            kept.append(span)
    return kept


__all__ = ["PatternLayer"]
