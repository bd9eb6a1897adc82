"""Ages ("I am 34", "34-year-old", "aged 34", "70yo", "Maria, 34,", "67M", "in my forties") and amounts of money
("$85,000", "1.250,00 €", "EUR 300", "85k a year", "300 quid", "earning 85000"), both found from the digit runs."""

from __future__ import annotations

import re
from collections.abc import Iterator

from privlm.detect.patterns._common import (
    NUMBER,
    SCORE_LIKELY,
    SCORE_VALID,
    Scan,
    digit_count,
    keyword_then_fillers,
    looks_like_year,
    make_span,
    standalone,
)
from privlm.detect.spans import Kind, Span

# --- ages -----------------------------------------------------------------------------------------------------------
_AGE_SUFFIX = re.compile(r"\s*-?\s*(?:(?:years?|yrs?|yr|months?|mos?|weeks?)\s*-?\s*(?:old|of\s+age)|y\.\s?o\.?|y/o|yo)"
                         r"(?!\w)", re.IGNORECASE)
# what a number after "I am" measures when it is not an age
_MEASURE = re.compile(r"[0-9]|[.,][0-9]|\s*-?\s*(?:%|percent|ft|feet|foot|inch|inches|cm|mm|m|km|kg|kgs|g|lb|lbs|"
                      r"pounds?|stone|st|oz|mins?|minutes?|hours?|hrs?|h|days?|weeks?|wks?|months?|mos?|miles?|mi|metres?|"
                      r"meters?|degrees?|times|x|am|pm|o'clock|dollars?|euros?|k|th|nd|rd|of|out|people|points?|steps?|"
                      r"blocks?|°|'|\u2019|\"|:|/)(?!\w)", re.IGNORECASE)
_AGE_WORDS = frozenset({"aged", "age", "ages", "agee", "âgé", "âgée", "alter", "edad", "età"})
_TURN_WORDS = frozenset({"turned", "turning", "turns", "turn"})
_AGE_FILLERS = frozenset({"now", "only", "just", "almost", "nearly", "about", "turning", "of", "the", "at", "is"})
_NAME_COMMA = re.compile(r"([A-ZÀ-Ý][a-zà-ÿ'\u2019-]+),\s+\Z")  # "Maria, " before the number
_NAME_PAREN = re.compile(r"([A-ZÀ-Ý][a-zà-ÿ'\u2019-]+)\s*\(\Z")  # "Maria (" before the number
_AFTER_NAME_AGE = re.compile(r"\s*[,;)]|\s+(?:from|who|and|is|was|lives|living|works|working|born|has|had|with)\b")
_NOT_NAMES = frozenset({"page", "chapter", "section", "step", "table", "figure", "fig", "room", "flat", "apt", "suite",
                        "unit", "no", "vol", "part", "item", "line", "version", "level", "grade", "year", "yes",
                        "total", "question", "exercise", "appendix", "article", "paragraph", "note", "box", "rule"})
_NOT_CLINICAL = re.compile(r"\s+(?:dollars|users|views|downloads|parameters|params|tokens|rows|revenue|subscribers|"
                           r"followers|people)\b", re.IGNORECASE)
_DECADE = re.compile(r"\bin\s+(?:my|his|her|their|your|our)\s+(?:(?:early|mid|late)[\s-]*)?(?P<decade>twenties|"
                     r"thirties|forties|fifties|sixties|seventies|eighties|nineties|teens|[1-9]0'?s)\b", re.IGNORECASE)


_DECADE_HINTS = ("0s", "0's", "twenties", "thirties", "forties", "fifties", "sixties", "seventies", "eighties",
                 "nineties", "teens", "Twenties", "Thirties", "Forties", "Fifties", "Sixties", "Seventies", "Eighties",
                 "Nineties", "Teens")


def _age_score(scan: Scan, start: int, end: int) -> float | None:
    """How sure the number ``text[start:end]`` is an age, from the words around it; None if it is not one."""
    text = scan.text
    if start > 0 and (text[start - 1] in "$£€¥₹.," or text[start - 1].isalnum()):
        return None
    if _AGE_SUFFIX.match(text, end):
        return SCORE_VALID  # "34 years old", "34-year-old", "34 y/o", "70yo"
    after = text[end:end + 2]
    if after[:1] in ("M", "F") and not after[1:].isalnum() and not _NOT_CLINICAL.match(text, end + 1):
        return SCORE_LIKELY  # "67M", "45F"
    if text[start - 1:start] == "(" and after[:2].lower() in ("f)", "m)"):
        return SCORE_LIKELY  # "(34f)"
    if not standalone(text, start, end) or _MEASURE.match(text, end):
        return None
    return _age_score_from_words(scan, start, end)


def _age_score_from_words(scan: Scan, start: int, end: int) -> float | None:
    text, words = scan.text, scan.words_before(start)
    if keyword_then_fillers(words, _AGE_WORDS, _AGE_FILLERS):
        return SCORE_VALID  # "aged 34", "age: 34", "at the age of 34"
    stripped = [word for word in words[-4:] if word not in _AGE_FILLERS]
    last, last_two = stripped[-1:], stripped[-2:]
    if (last and last[0] in _TURN_WORDS) or last == ["im"] or last_two in (["i", "am"], ["i", "m"]):
        return SCORE_LIKELY  # "I am 34", "I'm 34", "turned 40"
    before = text[max(0, start - 2):start]
    if "," in before:
        name = _NAME_COMMA.search(text, max(0, start - 30), start)
        if name and name.group(1).lower() not in _NOT_NAMES and _AFTER_NAME_AGE.match(text, end):
            return SCORE_LIKELY  # "Maria, 34,"
    if before[-1:] == "(" and text[end:end + 1] == ")" and not text[end + 1:end + 3].strip()[:1].isdigit():
        name = _NAME_PAREN.search(text, max(0, start - 30), start)
        if (name and name.group(1).lower() not in _NOT_NAMES) or before.lower() in ("(f", "(m"):
            return SCORE_LIKELY  # "Maria (34)", "(F34)"
    return None


def find_ages(scan: Scan) -> Iterator[Span]:
    text = scan.text
    for start, end in scan.runs:
        if end - start <= 3 and 1 <= int(text[start:end]) <= 120:
            score = _age_score(scan, start, end)
            if score is not None:
                yield make_span(start, end, Kind.AGE, score, "age")


def find_decades(scan: Scan) -> Iterator[Span]:
    text = scan.text
    if any(word in text for word in _DECADE_HINTS):
        for match in _DECADE.finditer(text):
            yield make_span(match.start("decade"), match.end("decade"), Kind.AGE, SCORE_LIKELY, "age")


# --- amounts --------------------------------------------------------------------------------------------------------
_SYMBOL = r"(?:US\$|AU?\$|CA?\$|NZ\$|HK\$|S\$|R\$|Mex\$|GH₵|[$£€¥₹₩₽₺₪₦฿₱₫₴₲₡₵]|Rs\.?|Fr\.)"
_CODE = (r"(?:USD|EUR|GBP|JPY|CHF|CAD|AUD|NZD|INR|BRL|CNY|RMB|MXN|PLN|SEK|NOK|DKK|ZAR|NGN|KES|SGD|HKD|KRW|RUB|TRY|"
         r"AED|SAR|ILS|CZK|HUF|RON)")
_NUMBER = re.compile(NUMBER)
_PREFIX = re.compile(rf"{_SYMBOL}\s?\Z|(?<![A-Za-z]){_CODE}\s?\Z")
_MULTIPLIER = re.compile(r"\s?(?:k|K|m|M|mn|bn|b|million|billion|thousand|grand|lakhs?|crores?|mil)(?!\w)")
_CURRENCY_WORD = (r"(?:dollars?|bucks|euros?|pounds?(?:\s+sterling)?|quid|rupees?|yen|yuan|renminbi|pesos?|reais|"
                  r"reals?|francs?|z[łl]oty|zlotys?|kronor|kroner|krona|krone|naira|rand|rubles?|roubles?|liras?|"
                  r"dirhams?|cents?|pence)")
_SUFFIX = re.compile(rf"\s?(?:{_SYMBOL}|{_CODE}|zł|kr|Kč)(?!\w)|\s+(?i:{_CURRENCY_WORD})(?!\w)")
_NOT_MONEY_K = re.compile(r"\s*(?:runs?|races?|steps|followers|subscribers|views|miles|km|words|tokens|resolution|"
                          r"monitor|tv|video|context)\b", re.IGNORECASE)
_PER_PERIOD = re.compile(r"\s+(?:a|an|per|/)\s*(?:year|yr|annum|month|mo|week|wk|hour|hr|day)\b", re.IGNORECASE)
_MONEY_WORDS = frozenset({
    "earn", "earns", "earned", "earning", "salary", "salaries", "paid", "pay", "pays", "paying", "income", "wage",
    "wages", "rent", "mortgage", "owe", "owes", "owed", "owing", "savings", "saved", "debt", "debts", "loan", "loans",
    "bonus", "pension", "budget", "worth", "inheritance", "alimony", "allowance", "balance", "spent", "spend",
    "spending", "cost", "costs", "price", "fee", "fees", "bill", "bills", "gehalt", "salaire", "sueldo", "salario",
    "stipendio", "miete", "loyer", "alquiler", "affitto",
})
_MONEY_FILLERS = frozenset({
    "of", "is", "was", "are", "were", "about", "around", "roughly", "approximately", "approx", "over", "under",
    "nearly", "almost", "only", "just", "me", "him", "her", "them", "us", "you", "a", "an", "total", "totaling",
    "totalling", "at", "to", "up", "my", "our", "his", "their", "your", "the", "annual", "monthly", "yearly", "gross",
    "net", "base",
})


def find_amounts(scan: Scan) -> Iterator[Span]:
    text, covered_to = scan.text, -1
    for run_start, _ in scan.runs:
        if run_start < covered_to or not _starts_number(text, run_start):
            continue
        number = _NUMBER.match(text, run_start)
        if number is None:
            continue
        covered_to = number.end()
        span = _amount_at(scan, number)
        if span is not None:
            covered_to = max(covered_to, span.end)
            yield span


def _starts_number(text: str, start: int) -> bool:
    if start == 0:
        return True
    before = text[start - 1]
    return not (before.isalnum() or before == "_" or (before in ".," and start > 1 and text[start - 2].isdigit()))


def _amount_at(scan: Scan, number: re.Match[str]) -> Span | None:
    text, (start, end) = scan.text, number.span()
    multiplier = _MULTIPLIER.match(text, end)
    after = multiplier.end() if multiplier else end
    prefix = _PREFIX.search(text, max(0, start - 5), start)
    suffix = _SUFFIX.match(text, after)
    if prefix or suffix:  # "$85,000", "EUR 300", "1.250,00 €", "45,000 dollars"
        first, last = prefix.start() if prefix else start, suffix.end() if suffix else after
        return make_span(first, last, Kind.AMOUNT, SCORE_VALID, "amount")
    if after < len(text) and (text[after].isalnum() or text[after] == "_"):
        return None
    if multiplier and multiplier.group().strip() in "kK" and not _NOT_MONEY_K.match(text, after):
        return make_span(start, after, Kind.AMOUNT, SCORE_VALID, "amount")  # "85k"
    value = number.group()
    if (digit_count(value) < 3 and not multiplier) or looks_like_year(value):
        return None
    if _PER_PERIOD.match(text, after) or keyword_then_fillers(scan.words_before(start), _MONEY_WORDS, _MONEY_FILLERS):
        return make_span(start, after, Kind.AMOUNT, SCORE_LIKELY, "amount")  # "85000 a year", "salary of 85000"
    return None
