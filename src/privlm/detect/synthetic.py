"""Synthetic training data for the tagger: realistic requests with every personal detail marked, made offline.

An example fills one to three templates (two to six form lines; :mod:`privlm.detect.templates`) inside a frame (a
chat message, an email, a form, a list) with values drawn for their slots, so the marks are exact by construction.
Public text with no detail (tweets, fortunes, WordNet glosses: :func:`privlm.data.public_corpus`) comes in as filler
sentences and as whole negative examples.

Splits. Templates go to train, validation or test by a stable hash of their id, and every value by a stable hash
of its text (:func:`split_of`; a name by each of its parts), so the test split holds shapes *and* values that
training never saw: a name, a city or a condition drawn in test was rejected in train. Numbers drawn at random
(ages, amounts, cards) follow the same rule. ``held_out`` values (and, for names, parts) are never drawn at all:
``privlm detect train --hold-out`` keeps the evaluation sets' values out of every split.

Reproducible: the same seed, vocabularies and package versions give the same examples (Faker is seeded per
example; the random generator is ``np.random.default_rng``, never the global one).
"""

from __future__ import annotations

import functools
import hashlib
import re
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from datetime import date, timedelta

import numpy as np
from faker import Faker

from privlm.detect.spans import Kind, Layer
from privlm.detect.templates import GROUPS, template_ids

SPLITS = ("train", "validation", "test")
SPLIT_BUCKETS = {"train": range(0, 14), "validation": range(14, 17), "test": range(17, 20)}  # of 20
LOCALES = ("en_US", "en_GB", "en_IN", "en_NG", "de_DE", "fr_FR", "es_ES", "es_MX", "it_IT", "pt_BR", "nl_NL",
           "pl_PL", "tr_TR", "vi_VN", "sv_SE", "cs_CZ", "yo_NG", "fil_PH", "id_ID", "hu_HU")
ADDRESS_LOCALES = ("en_US", "en_GB", "de_DE", "fr_FR", "es_ES", "it_IT", "nl_NL", "pt_BR", "pl_PL", "en_IN")
PHONE_LOCALES = ("en_US", "en_GB", "de_DE", "fr_FR", "es_ES", "it_IT", "en_IN", "nl_NL", "pt_BR")
FRAMES = ("chat", "chat", "chat", "email", "form", "list", "negative")
FILLERS = ("Thanks in advance.", "Any advice?", "What should I do?", "Please keep it short.", "Be honest.",
           "I don't know where to start.", "Can you help?", "It's urgent.", "Sorry for the long message.")
SLOT = re.compile(r"\{(\w+)(?::(\w+))?\}")
NAME_PART = re.compile(r"[^\W\d_]+(?:['\u2019-][^\W\d_]+)*")
VOCABULARY_KINDS = (Kind.LOCATION, Kind.HEALTH, Kind.MEDICATION, Kind.OCCUPATION, Kind.RELIGION, Kind.ETHNICITY,
                    Kind.SEXUALITY, Kind.UNION)
COUNTRY = "country"  # the vocabulary key of countries, beside Kind.LOCATION's cities


@dataclass(frozen=True)
class Example:
    """A text with its marked details: ``spans`` are ``(start, end, kind)``, sorted."""

    text: str
    spans: tuple[tuple[int, int, Kind], ...]
    frame: str
    templates: tuple[str, ...]


def split_of(key: str) -> str:
    """The split a template id or a value belongs to: a stable hash, 70% train, 15% validation, 15% test."""
    bucket = int.from_bytes(hashlib.blake2b(key.casefold().encode(), digest_size=8).digest(), "big") % 20
    return next(name for name, buckets in SPLIT_BUCKETS.items() if bucket in buckets)


def templates_of(split: str) -> dict[str, list[str]]:
    """The template ids of ``split``, by group."""
    ids = template_ids()
    return {group: [tid for tid in ids if tid.startswith(group + "-") and split_of(tid) == split] for group in GROUPS}


class ValueDrawer:
    """Draws slot values of one split: a value whose hash falls in another split is drawn again."""

    def __init__(self, split: str, vocabularies: Mapping[str, Sequence[str]], rng: np.random.Generator,
                 held_out: Collection[str] = ()) -> None:
        self.split, self.rng = split, rng
        self.held_out = {value.casefold() for value in held_out}
        self.vocabularies = {key: [v for v in values if split_of(v) == split and v.casefold() not in self.held_out]
                             for key, values in vocabularies.items()}
        empty = [key for key, values in self.vocabularies.items() if not values]
        if empty:
            raise ValueError(f"no {split} values for {empty}: give larger vocabularies")
        self.fakers = {locale: Faker(locale) for locale in LOCALES}

    def draw(self, kind: str, form: str | None) -> str:
        for _ in range(1000):
            value = self._draw_once(kind, form).strip()
            if self._fits(kind, value):
                return value
        raise RuntimeError(f"could not draw a {self.split} value for {kind}:{form}")

    def _fits(self, kind: str, value: str) -> bool:
        # A name's parts are split one by one: "Maria" in test must not come back in train as "Maria Silva".
        keys = [part for part in NAME_PART.findall(value) if len(part) > 1] if kind == Kind.PERSON else [value]
        return all(split_of(key) == self.split and key.casefold() not in self.held_out for key in keys)

    def _faker(self, locales: Sequence[str] = LOCALES) -> Faker:
        fake = self.fakers[locales[int(self.rng.integers(len(locales)))]]
        fake.seed_instance(int(self.rng.integers(2**32)))
        return fake

    def _pick(self, key: str) -> str:
        values = self.vocabularies[key]
        return values[int(self.rng.integers(len(values)))]

    def _draw_once(self, kind: str, form: str | None) -> str:
        draw = _DRAWS.get(f"{kind}:{form}" if form else kind) or _DRAWS[kind]
        return draw(self)


def _person(d: ValueDrawer) -> str:
    fake = d._faker()
    roll = d.rng.random()
    if roll < 0.15:
        return f"{fake.first_name()} {fake.first_name()[0]}. {fake.last_name()}"
    return f"{fake.first_name()} {fake.last_name()}"


# Words that brands, banks, insurers and public bodies are made of ("Capital One", "Irish Life", "Direct Line").
BRAND_WORDS = (
    "Capital", "Direct", "Irish", "Royal", "National", "First", "United", "Green", "Blue", "Star", "Bright", "Open",
    "Prime", "Summit", "Harbour", "Oak", "Cedar", "Meadow", "Pioneer", "Liberty", "Heritage", "Crown", "Lion",
    "Phoenix", "Eagle", "Atlas", "Horizon", "Anchor", "Beacon", "Coastal", "Northern", "Southern", "Western",
    "Eastern", "Central", "Metro", "Community", "Family", "Life", "Line", "Mutual", "Trust", "Care", "Home",
    "Shield", "Vista", "Nova", "Apex", "Pulse", "Echo", "Swift", "Smart", "Simple", "True", "Clear", "Fresh",
    "Golden", "Silver", "Red", "Kind", "Wise", "Lucky", "Sunny", "River", "Bay", "Hill", "Valley", "Forest",
    "Stone", "Bridge", "Castle", "Tower", "Gate", "Park", "Market", "Corner", "Village", "Pacific", "Atlantic",
    "Alpine", "Urban", "Global", "Secure", "Active", "Vital", "Pure", "Core", "Orchard", "Willow", "Maple", "Pine",
    "Harvest", "Compass", "Keystone", "Sterling", "Monarch", "Sovereign", "Legal", "General", "Standard", "Union",
)
BRAND_ENDINGS = ("Bank", "Energy", "Insurance", "Mobile", "Health", "Homes", "Lettings", "Motors", "Foods",
                 "Pharmacy", "Building Society", "Housing", "Care", "Academy", "College", "Clinic", "Dental",
                 "Logistics", "Telecom", "Broadband", "Water", "Money", "Pay", "Finance", "Airlines", "Rail")
APP_ENDINGS = ("ly", "ify", "io", "zo", "go", "hub", "ster", "wise", "flow", "nest")
HEALTH_QUALIFIERS = ("severe {}", "mild {}", "chronic {}", "acute {}", "suspected {}", "recurrent {}", "early {}",
                     "stage 2 {}", "bad {}", "really bad {}", "{} flare-ups", "{} symptoms", "bilateral {}",
                     "left-sided {}", "a bit of {}", "post-op {}", "probable {}", "worsening {}")


def _one_of(d: ValueDrawer, words: Sequence[str]) -> str:
    return words[int(d.rng.integers(len(words)))]


def _brand(d: ValueDrawer) -> str:
    return _one_of(d, BRAND_WORDS)


def _organization(d: ValueDrawer) -> str:
    fake = d._faker()
    shapes = (lambda: fake.company(), lambda: f"{d._pick(Kind.LOCATION)} General Hospital",
              lambda: f"University of {d._pick(Kind.LOCATION)}", lambda: f"{fake.last_name()} Dental Care",
              lambda: f"First Bank of {d._pick(Kind.LOCATION)}", lambda: f"{fake.last_name()} & Sons",
              lambda: f"{d._pick(Kind.LOCATION)} City Council", lambda: f"St {fake.first_name()}'s School",
              lambda: f"{fake.last_name()} Logistics Ltd", lambda: f"{fake.last_name()} Pharmacy",
              lambda: f"{d._pick(Kind.LOCATION)} {d._pick(Kind.HEALTH).title()} Service",
              lambda: f"Department of {fake.last_name()} Affairs", lambda: f"{fake.last_name()} Insurance",
              lambda: f"{d._pick(Kind.LOCATION)} Credit Union", lambda: f"{fake.last_name()} Primary School",
              lambda: f"{fake.last_name()} {fake.last_name()} Solicitors", lambda: f"{fake.company()} Group",
              # brands, banks, apps and public bodies as users name them
              lambda: f"{_brand(d)} {_brand(d)}", lambda: f"{_brand(d)} {_one_of(d, BRAND_ENDINGS)}",
              lambda: f"{fake.last_name()} {_one_of(d, BRAND_ENDINGS)}",
              lambda: fake.last_name() + _one_of(d, APP_ENDINGS),
              lambda: f"Department for {_brand(d)} and {_brand(d)}", lambda: f"Ministry of {_brand(d)} Affairs",
              lambda: f"{d._pick(Kind.LOCATION)} NHS Foundation Trust", lambda: f"{fake.first_name()} Ward",
              lambda: f"{fake.last_name()} Surgery", lambda: f"{d._pick(Kind.LOCATION)} Medical Centre",
              lambda: f"{fake.last_name()} House Care Home", lambda: f"{d._pick(Kind.LOCATION)} Housing Association",
              lambda: f"{d._pick(Kind.LOCATION)} FC", lambda: f"{_brand(d)} {fake.last_name()} Partners",
              lambda: "".join(w[0] for w in fake.company().split() if w[:1].isalpha()).upper()[:4] or "AB")
    return shapes[int(d.rng.integers(len(shapes)))]()


def _health(d: ValueDrawer) -> str:
    condition = d._pick(Kind.HEALTH)
    if d.rng.random() < 0.25:
        return _one_of(d, HEALTH_QUALIFIERS).format(condition)
    return condition


def _date(d: ValueDrawer) -> str:
    day = date(1940, 1, 1) + timedelta(days=int(d.rng.integers(0, 31_000)))
    formats = ("%B %d, %Y", "%d %B %Y", "%d/%m/%Y", "%m/%d/%Y", "%Y-%m-%d", "%d.%m.%Y", "%b %d", "%d %b %Y",
               "%-d %B", "%B %-d")
    return day.strftime(formats[int(d.rng.integers(len(formats)))])


def _amount(d: ValueDrawer, low: float = 1.0, high: float = 6.0) -> str:
    value = 10 ** d.rng.uniform(low, high)
    symbol, code = [("$", "USD"), ("£", "GBP"), ("€", "EUR"), ("₹", "INR"), ("", "CHF")][int(d.rng.integers(5))]
    shape = int(d.rng.integers(5))
    if shape == 0 and symbol:
        return f"{symbol}{value:,.0f}"
    if shape == 1 and symbol:
        return f"{symbol}{value:,.2f}"
    if shape == 2 and value > 1000:
        return f"{symbol}{value / 1000:.0f}k"
    if shape == 3:
        return f"{value:,.0f} {code}"
    return f"{value:,.0f}".replace(",", ".") + (f" {symbol}" if symbol else f" {code}")


def _card(d: ValueDrawer) -> str:
    number = d._faker(("en_US",)).credit_card_number()
    if d.rng.random() < 0.5 and len(number) == 16:
        number = " ".join(number[i:i + 4] for i in range(0, 16, 4))
    return str(number)


def _iban(d: ValueDrawer) -> str:
    iban = str(d._faker(("de_DE", "fr_FR", "en_GB", "nl_NL", "es_ES", "it_IT")).iban())
    return " ".join(iban[i:i + 4] for i in range(0, len(iban), 4)) if d.rng.random() < 0.5 else iban


def _record(d: ValueDrawer) -> str:
    digits = "".join(str(int(x)) for x in d.rng.integers(0, 10, size=int(d.rng.integers(6, 11))))
    letters = "".join(chr(65 + int(x)) for x in d.rng.integers(0, 26, size=2))
    shapes = (digits, f"{letters}-{digits[:4]}-{digits[4:]}", f"{letters}{digits}", f"{digits[:3]}-{digits[3:]}")
    return shapes[int(d.rng.integers(len(shapes)))]


def _phone(d: ValueDrawer) -> str:
    return str(d._faker(PHONE_LOCALES).phone_number())


_DRAWS: dict[str, Callable[[ValueDrawer], str]] = {
    "person": _person,
    "person:first": lambda d: str(d._faker().first_name()),
    "person:last": lambda d: str(d._faker().last_name()),
    "organization": _organization,
    "health": _health,
    "location": lambda d: d._pick(COUNTRY if d.rng.random() < 0.3 else Kind.LOCATION),
    "location:country": lambda d: d._pick(COUNTRY),
    "address": lambda d: str(d._faker(ADDRESS_LOCALES).street_address()).replace("\n", ", "),
    "age": lambda d: str(int(d.rng.integers(1, 100))),
    "date": _date,
    "date:year": lambda d: str(int(d.rng.integers(1935, 2027))),
    "amount": _amount,
    "amount:salary": lambda d: _amount(d, 4.2, 5.5),
    "contact": _phone,
    "contact:email": lambda d: str(d._faker().email()),
    "contact:phone": _phone,
    "contact:url": lambda d: str(d._faker(("en_US", "en_GB", "de_DE")).url()) + d._faker().user_name(),
    "contact:handle": lambda d: "@" + str(d._faker().user_name()),
    "identifier": _record,
    "identifier:card": _card,
    "identifier:iban": _iban,
    "identifier:ssn": lambda d: str(d._faker(("en_US",)).ssn()),
    "identifier:record": _record,
    **{kind.value: functools.partial(ValueDrawer._pick, key=kind.value)
       for kind in VOCABULARY_KINDS if kind not in (Kind.LOCATION, Kind.HEALTH)},
}


def fill(template: str, drawer: ValueDrawer) -> tuple[str, list[tuple[int, int, Kind]]]:
    """``template`` with each slot filled, and the filled spans."""
    parts: list[str] = []
    spans: list[tuple[int, int, Kind]] = []
    length, last = 0, 0
    for match in SLOT.finditer(template):
        literal = template[last:match.start()]
        parts.append(literal)
        length += len(literal)
        value = drawer.draw(match.group(1), match.group(2))
        parts.append(value)
        spans.append((length, length + len(value), Kind(match.group(1))))
        length += len(value)
        last = match.end()
    parts.append(template[last:])
    return "".join(parts), spans


class Generator:
    """Examples of one split, reproducible from ``seed``."""

    def __init__(self, split: str, vocabularies: Mapping[str, Sequence[str]], negatives: Sequence[str],
                 seed: int, held_out: Collection[str] = ()) -> None:
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        self.rng = np.random.default_rng([seed, SPLITS.index(split)])
        self.drawer = ValueDrawer(split, vocabularies, self.rng, held_out)
        self.templates = templates_of(split)
        self.negatives = [text for text in negatives if split_of(text) == split]
        self.ids = template_ids()

    def examples(self, n: int) -> list[Example]:
        return [self.example() for _ in range(n)]

    def example(self) -> Example:
        frame = FRAMES[int(self.rng.integers(len(FRAMES)))]
        if frame == "negative":
            return Example(self._negative(), (), frame, ())
        pieces = self._pieces(frame)
        sep = {"chat": " ", "email": "\n", "form": "\n", "list": "\n- "}[frame]
        text, spans, used = "- " if frame == "list" else "", [], []
        for i, (tid, piece) in enumerate(pieces):
            if i:
                text += sep
            filled, found = fill(piece, self.drawer) if tid else (piece, [])
            spans += [(start + len(text), end + len(text), kind) for start, end, kind in found]
            text += filled
            used += [tid] if tid else []
        return self._noisy(Example(text, tuple(spans), frame, tuple(used)))

    def _pieces(self, frame: str) -> list[tuple[str | None, str]]:
        groups = {"chat": ("first", "third", "request", "neutral"), "email": ("first", "third", "request", "neutral"),
                  "form": ("field", "field", "neutral"), "list": ("first", "third", "field", "neutral")}[frame]
        count = int(self.rng.integers(2, 7)) if frame == "form" else int(self.rng.integers(1, 4))
        pieces: list[tuple[str | None, str]] = []
        for _ in range(count):
            group = groups[int(self.rng.integers(len(groups)))]
            tid = self.templates[group][int(self.rng.integers(len(self.templates[group])))]
            pieces.append((tid, self.ids[tid]))
            if frame in ("chat", "email") and self.rng.random() < 0.3:
                pieces.append((None, self._filler()))
        if frame == "email":
            pieces.insert(0, self._signature())
            pieces.append(self._signature())
        return pieces

    def _signature(self) -> tuple[str | None, str]:
        tid = self.templates["signature"][int(self.rng.integers(len(self.templates["signature"])))]
        return tid, self.ids[tid]

    def _filler(self) -> str:
        roll = self.rng.random()
        if self.negatives and roll < 0.5:
            return self._negative()
        if roll < 0.8:
            return self.ids[self._neutral()]
        return FILLERS[int(self.rng.integers(len(FILLERS)))]

    def _neutral(self) -> str:
        return self.templates["neutral"][int(self.rng.integers(len(self.templates["neutral"])))]

    def _negative(self) -> str:
        pool = self.negatives or FILLERS
        return pool[int(self.rng.integers(len(pool)))]

    def _noisy(self, example: Example) -> Example:
        # Users type in lower case, and so must the tagger read it.
        if self.rng.random() < 0.15:
            return Example(example.text.lower(), example.spans, example.frame, example.templates)
        return example


def plain_public_texts(texts: Sequence[str], layers: Sequence[Layer] = ()) -> list[str]:
    """Public texts fit to be negatives: no @ and no link, and nothing that ``layers`` (the patterns and the
    gazetteers, say) would mark at score 0.9 or more, for a text in which they mark something probably names
    someone or something (a tweet's "Tom Brady", a fortune's author). Digits and capitalised words may stay: a
    tagger that never saw them unmarked would mark every one."""
    candidates = [text for text in texts if text.split() and "@" not in text and "http" not in text]
    marked = [[] for _ in candidates] if not layers else [
        [span for layer in layers for span in layer.detect([text])[0] if span.score >= 0.9] for text in candidates]
    return [text for text, spans in zip(candidates, marked, strict=True) if not spans]


__all__ = ["SPLITS", "Example", "Generator", "ValueDrawer", "fill", "plain_public_texts", "split_of",
           "templates_of"]
