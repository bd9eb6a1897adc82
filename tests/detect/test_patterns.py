"""The pattern layer: validated values found, invalid ones not, exact offsets, whole words, every kind's forms, and the
negatives that must stay unmarked."""

from __future__ import annotations

import importlib
import pkgutil

import pytest
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

import privlm.detect.patterns as patterns_package
from privlm.detect import Kind, Span
from privlm.detect.patterns import PatternLayer

LAYER = PatternLayer()


def spans_of(text: str) -> list[Span]:
    return LAYER.detect([text])[0]


def found(text: str, kind: Kind | None = None, what: str | None = None) -> set[str]:
    """The substrings the layer marks in ``text``, of ``kind`` and from ``pattern:<what>`` when given."""
    return {text[span.start:span.end] for span in spans_of(text)
            if (kind is None or span.kind == kind) and (what is None or span.source == f"pattern:{what}")}


def _is_word_char(char: str) -> bool:
    return char.isalnum() or char == "_"


# --- the layer ------------------------------------------------------------------------------------------------------

def test_layer_is_batched_and_named() -> None:
    texts = ["", "nothing personal here", "mail maria.g@example.com"]
    result = LAYER.detect(texts)
    assert LAYER.name == "patterns"
    assert [len(spans) for spans in result] == [0, 0, 1]
    assert result[2][0] == Span(5, 24, Kind.CONTACT, 1.0, "pattern:email")


class _NoRegexAtRunTime:
    def __getattr__(self, name: str) -> object:
        raise AssertionError(f"re.{name} used while detecting: compile patterns once, at import")


def test_every_regex_is_compiled_at_import(monkeypatch: pytest.MonkeyPatch) -> None:
    modules = [importlib.import_module(f"privlm.detect.patterns.{info.name}")
               for info in pkgutil.iter_modules(patterns_package.__path__)]
    assert len(modules) >= 5
    for module in modules:
        monkeypatch.setattr(module, "re", _NoRegexAtRunTime())
    checksums = " ".join(template.format(valid) for _, template, valid, *_ in CHECKSUMS)
    text = " ".join(row[0] for row in FORMS) + " " + checksums
    assert len(spans_of(text)) > 50


# --- checksums: each valid value found under its source, each invalid one not ----------------------------------------

CHECKSUMS = [  # (source, template, valid value, invalid value, the library's own check)
    ("iban", "Pay to IBAN {}, thanks.", "GB82 WEST 1234 5698 7654 32", "GB82 WEST 1234 5698 7654 33", iban.is_valid),
    ("iban", "de: {} please", "DE89370400440532013000", "DE89370400440532013001", iban.is_valid),
    ("card", "the card {} expires", "4111 1111 1111 1111", "4111 1111 1111 1112", luhn.is_valid),
    ("card", "amex {} ok", "378282246310005", "378282246310006", luhn.is_valid),
    ("card", "paid with {}.", "4242-4242-4242-4242", "4242-4242-4242-4243", luhn.is_valid),
    ("ssn", "SSN {} on file", "536-90-4399", "000-12-3456", ssn.is_valid),
    ("ssn", "my social security is {}.", "536904399", "078051120", ssn.is_valid),
    ("nhs", "NHS number {}.", "943 476 5919", "943 476 5918", nhs.is_valid),
    ("sin", "SIN: {}", "130 692 544", "130 692 545", sin.is_valid),
    ("bsn", "mijn BSN is {}.", "123456782", "123456783", bsn.is_valid),
    ("idnr", "Steuer-ID {}", "65929970489", "65929970488", idnr.is_valid),
    ("nir", "NIR {}.", "1 85 05 78 006 084 91", "1 85 05 78 006 084 92", nir.is_valid),
    ("dni", "DNI {} ok", "12345678Z", "12345678A", dni.is_valid),
    ("nie", "NIE {} ok", "X1234567L", "X1234567A", nie.is_valid),
    ("codice-fiscale", "CF {}.", "RSSMRA85T10A562S", "RSSMRA85T10A562T", codicefiscale.is_valid),
    ("aadhaar", "Aadhaar {}.", "2345 6789 0124", "2345 6789 0125", aadhaar.is_valid),
    ("pan", "PAN {}.", "ABCPE1234F", "ABCXE1234F", pan.is_valid),
    ("cpf", "CPF {}.", "111.444.777-35", "111.444.777-36", cpf.is_valid),
]


@pytest.mark.parametrize(("what", "template", "valid", "invalid", "library_check"), CHECKSUMS,
                         ids=[f"{row[0]}-{i}" for i, row in enumerate(CHECKSUMS)])
def test_checksum_valid_found_invalid_not(what: str, template: str, valid: str, invalid: str,
                                          library_check: object) -> None:
    assert callable(library_check)
    digits = {"card": lambda v: v.replace(" ", "").replace("-", "")}.get(what, lambda v: v)
    assert library_check(digits(valid)) and not library_check(digits(invalid))  # the fixtures are what they claim
    valid_text, invalid_text = template.format(valid), template.format(invalid)
    assert valid in found(valid_text, Kind.IDENTIFIER, what)
    assert max(span.score for span in spans_of(valid_text) if span.source == f"pattern:{what}") >= 0.9
    assert found(invalid_text, what=what) == set()


@pytest.mark.parametrize(("text", "value"), [("NI number AB 12 34 56 C.", "AB 12 34 56 C"),
                                             ("nino ab123456c", "ab123456c")])
def test_uk_ni_number_shape(text: str, value: str) -> None:
    assert value in found(text, Kind.IDENTIFIER, "ni")


@pytest.mark.parametrize("text", ["NI number GB 12 34 56 C.", "NI number AB 12 34 56 E.", "NI number AO 12 34 56 C."])
def test_uk_ni_number_bad_shapes(text: str) -> None:
    assert found(text, what="ni") == set()


def test_card_failing_luhn_is_not_a_card_but_still_an_identifier_by_context() -> None:
    text = "My card number is 4111 1111 1111 1112, keep it safe."
    assert found(text, what="card") == set()
    assert found(text, Kind.IDENTIFIER, "id") == {"4111 1111 1111 1112"}


def test_card_with_expiry_after_it_keeps_only_the_card() -> None:
    text = "Visa 4111 1111 1111 1111 12/27 please"
    assert found(text, what="card") == {"4111 1111 1111 1111"}


def test_iban_stops_before_the_next_word() -> None:
    assert found("IBAN GB82 WEST 1234 5698 7654 32 for rent", what="iban") == {"GB82 WEST 1234 5698 7654 32"}


def test_ids_that_are_only_digits_need_their_keyword() -> None:
    assert found("the code 123456782 is printed", what="bsn") == set()
    assert found("the code 9434765919 is printed", what="nhs") == set()
    assert "123456782" in found("BSN 123456782", what="bsn")


# --- offsets: long texts, Unicode before the match, mixed case ----------------------------------------------------

DETAILS = [  # (text with the detail, the detail, its kind)
    ("write to MARIA.G@EXAMPLE.COM today", "MARIA.G@EXAMPLE.COM", Kind.CONTACT),
    ("mrn: 00482913", "00482913", Kind.IDENTIFIER),
    ("Iban gb82 west 1234 5698 7654 32 ok", "gb82 west 1234 5698 7654 32", Kind.IDENTIFIER),
    ("JULY 22, 2026 was the day", "JULY 22, 2026", Kind.DATE),
    ("AGED 70, she moved", "70", Kind.AGE),
    ("she earns £1,200 a week", "£1,200", Kind.AMOUNT),
    ("call +44 20 7946 0958 now", "+44 20 7946 0958", Kind.CONTACT),
    ("at 221B Baker Street", "221B Baker Street", Kind.ADDRESS),
    ("SSN 536-90-4399", "536-90-4399", Kind.IDENTIFIER),
]
PREFIXES = ["", "😀🎉 ", "José Muñoz \u2013 café crème: ", "東京都の住所は ", "Ünïcödé ẞ " * 3]


@pytest.mark.parametrize("prefix", PREFIXES)
@pytest.mark.parametrize(("sentence", "detail", "kind"), DETAILS, ids=[row[1] for row in DETAILS])
def test_offsets_exact_after_unicode(prefix: str, sentence: str, detail: str, kind: Kind) -> None:
    text = prefix + sentence
    start = text.index(detail)
    assert any(span.start == start and span.end == start + len(detail) and span.kind == kind
               for span in spans_of(text))


def test_offsets_exact_in_a_long_text() -> None:
    filler = "The weather was mild and nothing much happened that day, page after page. "
    parts, expected = [], []
    for i, (sentence, detail, kind) in enumerate(DETAILS * 3):
        parts.append(filler * (i % 4 + 1))
        position = sum(len(part) for part in parts) + sentence.index(detail)
        parts.append(sentence + ". ")
        expected.append((position, position + len(detail), kind))
    text = "".join(parts)
    assert len(text) > 5000
    spans = {(span.start, span.end, span.kind) for span in spans_of(text)}
    assert [row for row in expected if row not in spans] == []
    assert all(text[start:end] == DETAILS[i % len(DETAILS)][1] for i, (start, end, _) in enumerate(expected))


# --- every kind's forms ---------------------------------------------------------------------------------------------

FORMS = [  # (text, the substring that must be a span of kind)
    # contact
    ("Email maria.g@example.co.uk.", "maria.g@example.co.uk", Kind.CONTACT),
    ("see https://example.org/p?x=1.", "https://example.org/p?x=1", Kind.CONTACT),
    ("go to www.maria.dev, now", "www.maria.dev", Kind.CONTACT),
    ("my code is on github.com/mariag/repo.", "github.com/mariag/repo", Kind.CONTACT),
    ("(see https://en.wikipedia.org/wiki/Foo_(bar))", "https://en.wikipedia.org/wiki/Foo_(bar)", Kind.CONTACT),
    ("server 192.168.1.10 is down", "192.168.1.10", Kind.CONTACT),
    ("v6 2001:db8::1 works", "2001:db8::1", Kind.CONTACT),
    ("call (206) 555-0143 today", "(206) 555-0143", Kind.CONTACT),
    ("UK 07700 900123 please", "07700 900123", Kind.CONTACT),
    ("Berlin 030 1234567", "030 1234567", Kind.CONTACT),
    ("Paris 06 12 34 56 78", "06 12 34 56 78", Kind.CONTACT),
    ("Mumbai +91 98765 43210", "+91 98765 43210", Kind.CONTACT),
    ("Lagos 0803 123 4567", "0803 123 4567", Kind.CONTACT),
    ("São Paulo (11) 91234-5678", "(11) 91234-5678", Kind.CONTACT),
    ("Tokyo 03-1234-5678", "03-1234-5678", Kind.CONTACT),
    ("Beijing 138 0013 8000", "138 0013 8000", Kind.CONTACT),
    ("Sydney 0412 345 678", "0412 345 678", Kind.CONTACT),
    ("text me on 4155552671", "4155552671", Kind.CONTACT),
    ("ping @maria_g or", "@maria_g", Kind.CONTACT),
    ("insta @maria.gonzalez.", "@maria.gonzalez", Kind.CONTACT),
    # identifier after a keyword
    ("MRN: 00482913", "00482913", Kind.IDENTIFIER),
    ("policy # AB-7734-221.", "AB-7734-221", Kind.IDENTIFIER),
    ("account number 12345678, please", "12345678", Kind.IDENTIFIER),
    ("sort code 20-00-00", "20-00-00", Kind.IDENTIFIER),
    ("passport no. X1234567", "X1234567", Kind.IDENTIFIER),
    ("driver's licence number MORGA657054SM9IJ", "MORGA657054SM9IJ", Kind.IDENTIFIER),
    ("member id 884-221-09", "884-221-09", Kind.IDENTIFIER),
    ("order #A12345 shipped", "A12345", Kind.IDENTIFIER),
    ("claim 55-1234", "55-1234", Kind.IDENTIFIER),
    ("case number is 2024-CV-00123", "2024-CV-00123", Kind.IDENTIFIER),
    ("the card ending in 4242 was charged", "4242", Kind.IDENTIFIER),
    ("last four digits 4242", "4242", Kind.IDENTIFIER),
    ("ref 20240101-77812345", "20240101-77812345", Kind.IDENTIFIER),
    ("it was 88123456 I think", "88123456", Kind.IDENTIFIER),
    # date
    ("on July 22, 2026 we", "July 22, 2026", Kind.DATE),
    ("on 22 July 2026 we", "22 July 2026", Kind.DATE),
    ("on 22/07/2026 we", "22/07/2026", Kind.DATE),
    ("on 07-22-2026 we", "07-22-2026", Kind.DATE),
    ("on 2026-07-22 we", "2026-07-22", Kind.DATE),
    ("at 2026-07-22T10:30:00Z we", "2026-07-22T10:30:00Z", Kind.DATE),
    ("on 22.07.2026 we", "22.07.2026", Kind.DATE),
    ("on Jul 22 we", "Jul 22", Kind.DATE),
    ("on the 22nd of July.", "22nd of July", Kind.DATE),
    ("Sept. 3rd, 1999 it was", "Sept. 3rd, 1999", Kind.DATE),
    ("DOB 3/4/79", "3/4/79", Kind.DATE),
    ("in March 1985 I", "March 1985", Kind.DATE),
    ("am 22. Juli 2026", "22. Juli 2026", Kind.DATE),
    ("le 14 juillet 1989", "14 juillet 1989", Kind.DATE),
    ("el 3 de julio de 2020", "3 de julio de 2020", Kind.DATE),
    ("il 5 maggio 2001", "5 maggio 2001", Kind.DATE),
    ("op 12 maart 1990", "12 maart 1990", Kind.DATE),
    ("born in 1985.", "1985", Kind.DATE),
    ("married since 2019", "2019", Kind.DATE),
    ("class of 2003", "2003", Kind.DATE),
    ("I moved here in 1999", "1999", Kind.DATE),
    ("b. 1962", "1962", Kind.DATE),
    ("back in 2007 I", "2007", Kind.DATE),
    ("worked there 2015-2019", "2015", Kind.DATE),
    ("worked there 2015-2019", "2019", Kind.DATE),
    # age: the span is the number (the whole word when the unit is glued to it)
    ("I am 34 and", "34", Kind.AGE),
    ("I'm 34.", "34", Kind.AGE),
    ("I\u2019m 34, okay", "34", Kind.AGE),
    ("im 19 lol", "19", Kind.AGE),
    ("aged 34, she", "34", Kind.AGE),
    ("age: 34", "34", Kind.AGE),
    ("at the age of 12 I", "12", Kind.AGE),
    ("he is 34 years old", "34", Kind.AGE),
    ("a 34-year-old woman", "34", Kind.AGE),
    ("34 y/o female", "34", Kind.AGE),
    ("pt 34 yo with", "34", Kind.AGE),
    ("grandma, 70yo, fell", "70yo", Kind.AGE),
    ("my son is 5 months old", "5", Kind.AGE),
    ("I just turned 40", "40", Kind.AGE),
    ("I am Maria Gonzalez, 34, from Seattle.", "34", Kind.AGE),
    ("Maria (34) and", "34", Kind.AGE),
    ("67M with chest pain", "67M", Kind.AGE),
    ("pt is a 45F, c/o", "45F", Kind.AGE),
    ("I (34F) and my husband (36M)", "34F", Kind.AGE),
    ("I (34F) and my husband (36M)", "36M", Kind.AGE),
    ("I'm in my forties", "forties", Kind.AGE),
    ("she is in her 30s", "30s", Kind.AGE),
    ("he is in his late twenties", "twenties", Kind.AGE),
    # amount
    ("I make $85,000.", "$85,000", Kind.AMOUNT),
    ("rent £1,200 a month", "£1,200", Kind.AMOUNT),
    ("only €300 left", "€300", Kind.AMOUNT),
    ("Betrag 1.250,00 € bitte", "1.250,00 €", Kind.AMOUNT),
    ("EUR 300 paid", "EUR 300", Kind.AMOUNT),
    ("worth USD 4.5m now", "USD 4.5m", Kind.AMOUNT),
    ("a salary of 85k", "85k", Kind.AMOUNT),
    ("raised $3.5 million", "$3.5 million", Kind.AMOUNT),
    ("about 45,000 dollars", "45,000 dollars", Kind.AMOUNT),
    ("300 quid", "300 quid", Kind.AMOUNT),
    ("₹50,000 saved", "₹50,000", Kind.AMOUNT),
    ("I earn 85k a year", "85k", Kind.AMOUNT),
    ("I make 85000 a year", "85000", Kind.AMOUNT),
    ("earning 62000 now", "62000", Kind.AMOUNT),
    ("my salary is 85000", "85000", Kind.AMOUNT),
    ("the rent is 1200", "1200", Kind.AMOUNT),
    ("I owe 5000", "5000", Kind.AMOUNT),
    ("savings of 12,000", "12,000", Kind.AMOUNT),
    ("a debt of 20k", "20k", Kind.AMOUNT),
    # address
    ("at 221B Baker Street, London", "221B Baker Street, London", Kind.ADDRESS),  # the town on its line joins
    ("Address: Unit 4/27 Kent St, Newtown NSW 2042\nMobile", "Unit 4/27 Kent St, Newtown NSW 2042", Kind.ADDRESS),
    ("House No. 14, Kofi Annan Street, Airport Residential Area, Accra", "House No. 14, Kofi Annan Street, Airport "
     "Residential Area, Accra", Kind.ADDRESS),
    ("Flat 11, Cedar Court\nFerry Road", "Flat 11, Cedar Court", Kind.ADDRESS),  # never across a line break
    ("at 12 High Street, Leeds and I like it", "12 High Street", Kind.ADDRESS),  # no stop after the town: no tail
    ("the 1600 Pennsylvania Ave NW office", "1600 Pennsylvania Ave NW", Kind.ADDRESS),
    ("Flat 3, 12 High St, Leeds", "Flat 3, 12 High St, Leeds", Kind.ADDRESS),
    ("lives at 12 high street now", "12 high street", Kind.ADDRESS),
    ("Hauptstraße 5, Berlin", "Hauptstraße 5", Kind.ADDRESS),
    ("in der Berliner Straße 12a wohnen", "Berliner Straße 12a", Kind.ADDRESS),
    ("Keizersgracht 123, Amsterdam", "Keizersgracht 123", Kind.ADDRESS),
    ("au 12 rue de la Paix, Paris", "12 rue de la Paix", Kind.ADDRESS),
    ("en Calle Mayor 10, Madrid", "Calle Mayor 10", Kind.ADDRESS),
    ("in Via Garibaldi, 5 a Roma", "Via Garibaldi, 5", Kind.ADDRESS),
    ("London SW1A 1AA", "SW1A 1AA", Kind.ADDRESS),
    ("Manchester M1 1AE.", "M1 1AE", Kind.ADDRESS),
    ("Seattle, WA 98101", "98101", Kind.ADDRESS),
    ("zip code: 10001-1234", "10001-1234", Kind.ADDRESS),
    ("Ottawa ON K1A 0B1", "K1A 0B1", Kind.ADDRESS),
    ("1012 AB Amsterdam", "1012 AB", Kind.ADDRESS),
    ("D-10115 Berlin", "D-10115", Kind.ADDRESS),
    ("10115 Berlin", "10115", Kind.ADDRESS),
]


@pytest.mark.parametrize(("text", "detail", "kind"), FORMS, ids=[f"{row[2]}-{row[1]}" for row in FORMS])
def test_each_kind_form(text: str, detail: str, kind: Kind) -> None:
    assert detail in found(text, kind)


def test_fiction_phone_possible_but_not_valid_scores_lower() -> None:
    assert [(span.score, span.source) for span in spans_of("+44 7700 900123")] == [(0.9, "pattern:phone")]
    assert [(span.score, span.source) for span in spans_of("+1 202 555 0143")] == [(1.0, "pattern:phone")]


def test_overlapping_phone_matches_are_deduplicated() -> None:
    text = "Call +44 20 7946 0958 or (206) 555-0143."
    assert sorted(text[span.start:span.end] for span in spans_of(text)) == ["(206) 555-0143", "+44 20 7946 0958"]


def test_a_date_is_not_also_a_phone() -> None:
    for text in ("on 22.07.2026", "on 07-22-2026", "on 2026/07/22"):
        assert {span.kind for span in spans_of(text)} == {Kind.DATE}


def test_scores_follow_validation() -> None:
    scores = {span.source: span.score for span in spans_of("SSN 536-90-4399, MRN: 00482913, then 88123456 alone")}
    assert scores == {"pattern:ssn": 1.0, "pattern:id": 0.9, "pattern:number": 0.8}


# --- negatives ------------------------------------------------------------------------------------------------------

NEGATIVES = [
    "Python 3.11.7 is out", "The meeting is at 10:30.", "See page 12 for details.", "Our top 10 list.",
    "Part SKU 4412-889-01 is in stock.", "the model 555-0143-22 ships", "rated 4.5/5 by users", "add 3/4 cup of milk",
    "I'm 100% sure", "24/7 support", "COVID-19 cases", "Windows 10 and iPhone 15", "I'm 6 feet tall",
    "I am 5 minutes away", "I'm 2 hours late", "I have worked here 34 years", "around 1500 BC", "top 2000 songs",
    "2048 bytes", "the 1990 model", "I scored 85 out of 100", "Chapter 3, 12, 15", "Figure (3) shows", "a 5k run",
    "10k steps a day", "meet @10am", "1,234,567 views", "version 1.2.3.4", "ISBN 978-3-16-148410-0", "room 12",
    "I have 3 kids", "it took 45 minutes", "at 5pm", "step 2 of 3", "v2.0.1 release", "x = 3.14159",
]


@pytest.mark.parametrize("text", NEGATIVES)
def test_negatives_stay_unmarked(text: str) -> None:
    assert [text[span.start:span.end] for span in spans_of(text)] == []


# --- whole words ----------------------------------------------------------------------------------------------------

GLUED = ["call555-0143now", "x4111111111111111y", "id:00482913", "70yo", "I am34", "maria@example.comx",
         "$85kpa", "born1985", "at221B Baker Street", "TheIBAN GB82 WEST 1234 5698 7654 32", "emoji😀34yo",
         "Maria,34,", "(34F)", "67Mx", "SW1A1AA", "1012AB", "café 12 Rue de la Paix", "tel:+442079460958"]


@pytest.mark.parametrize("text", [row[0] for row in FORMS + DETAILS] + GLUED + NEGATIVES)
def test_a_span_never_starts_or_ends_inside_a_word(text: str) -> None:
    for span in spans_of(text):
        assert not (span.start > 0 and _is_word_char(text[span.start - 1]) and _is_word_char(text[span.start]))
        assert not (span.end < len(text) and _is_word_char(text[span.end - 1]) and _is_word_char(text[span.end]))
        assert text[span.start:span.end] == text[span.start:span.end].strip()


@pytest.mark.parametrize(("text", "expected"), [
    ("Can we move it to Monday 16 June?", ("Monday 16 June", Kind.DATE)),
    ("see you Tue, 3 March 2026 then", ("Tue, 3 March 2026", Kind.DATE)),
    ("The rent is GH₵ 6,400 a month.", ("GH₵ 6,400", Kind.AMOUNT)),
])
def test_a_weekday_before_a_date_and_a_cedi_sign_belong_to_the_span(text: str, expected: tuple[str, Kind]) -> None:
    spans = PatternLayer().detect([text])[0]
    assert expected in [(text[s.start:s.end], s.kind) for s in spans]
