"""The prompts of ``privlm bench chat-quality`` (issue 24): realistic requests to a chat assistant that carry
personal details, each personal span marked, made offline by a committed generator.

How the set is made. Every prompt fills one of :data:`TEMPLATES` (34 requests on health, work, money, travel
and family, 2 to 5 slots each). The slot fillers come from:
  - places: the WordNet 3.0 instances of ``city`` (sense 1), with those of its hyponyms (national, state and
    provincial capitals: they are cities too), minus those whose gloss calls them ancient;
  - conditions: the WordNet hyponyms, at any depth, of ``illness`` and ``disorder`` (sense 1 of each;
    ``disease`` lies under ``illness``), without plant diseases and animal diseases other than zoonoses, and
    without :data:`CONDITION_DROPS` (names of a category rather than a condition, slang, dated or offensive
    words, WordNet's misspellings); 1 to 3 words, lower case;
  - occupations: the WordNet hyponyms of ``professional`` (sense 1, all of them), and those of ``worker``
    (sense 1) attested in WordNet's sense-tagged corpus (``cntlist.rev``: the rest are mostly rare or odd),
    outside the armed forces, without :data:`OCCUPATION_DROPS`; 1 or 2 words;
  - names: this generator's own lists, of varied origins: 60 first names (:data:`FEMALE_NAMES`,
    :data:`MALE_NAMES`, 30 each, so that "my mother" gets a woman's name) and 60 :data:`SURNAMES`;
  - employers: this generator's own patterns (:data:`EMPLOYER_PATTERNS`) filled from the surnames and places;
  - ages (18 to 90, narrower where the template needs it) and numbers (salaries, sums, account, card, phone
    and record numbers, dates) from ``np.random.default_rng(seed)``, never the global generator. Phone
    numbers are in ranges reserved for fiction (555-01xx in North America, 07700 900xxx in the UK).

WordNet is read from Debian's ``wordnet-base`` (:data:`privlm.data.WORDNET_DIR`); every word list is sorted
before sampling, so the set depends on the seed and the WordNet files only. Prompts are dealt to templates in
turn (each template gets n / 34 prompts, give or take one); a draw whose text is already in the set is drawn
again.

What each split is for. :func:`split_prompts` splits by template: a template's prompts all fall in train or
all in test. Train is for choosing free parameters (cape-public's tau and top_p, say); test is for every
reported figure. A parameter tuned on train has never seen a test template, only the same word lists.

The committed file, :data:`PROMPTS_FILE`, is :func:`write_prompts` with its defaults (400 prompts, seed
:data:`DEFAULT_SEED`, half the templates in test); a test checks it equals a fresh generation.
"""

from __future__ import annotations

import functools
import json
import re
import string
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from privlm_bench.data import WORDNET_DIR, PathLike

DEFAULT_SEED = 20261125
PROMPTS_FILE = Path("benchmarks/chat-quality/prompts.jsonl")  # relative to the repository root
KINDS = ("name", "place", "age", "condition", "employer", "number", "occupation")
SPLITS = ("train", "test")

FEMALE_NAMES: tuple[str, ...] = (
    "Maria", "Priya", "Aisha", "Yuki", "Olga", "Sofia", "Fatima", "Ananya", "Chloe", "Ingrid",
    "Leila", "Grace", "Mei", "Amara", "Zainab", "Elena", "Nadia", "Ines", "Hannah", "Siobhan",
    "Camille", "Anika", "Yasmin", "Beatriz", "Freya", "Lucia", "Astrid", "Keiko", "Marta", "Ewa",
)
MALE_NAMES: tuple[str, ...] = (
    "James", "Mohammed", "Wei", "Kwame", "Liam", "Hiroshi", "Diego", "Oluwaseun", "Mateo", "Dmitri",
    "Arjun", "Tomasz", "Lucas", "Kenji", "Samuel", "Rahul", "Kofi", "Omar", "Thabo", "Javier",
    "Sven", "Minh", "Emeka", "Hamza", "Ravi", "Jamal", "Pedro", "Ayodele", "Tariq", "Andrei",
)
FIRST_NAMES = FEMALE_NAMES + MALE_NAMES
SURNAMES: tuple[str, ...] = (  # none with a gendered form: any first name may precede them
    "Gonzalez", "Smith", "Sharma", "Okafor", "Nguyen", "Mazur", "Tanaka", "Mueller", "Haddad", "Bondarenko",
    "Johansson", "Mensah", "Rossi", "Kim", "Chen", "Patel", "O'Brien", "Dubois", "Silva", "Popescu",
    "Khan", "Hernandez", "Schmidt", "Yamamoto", "Adeyemi", "Novak", "Fernandes", "Lindqvist", "Abdullah", "Murphy",
    "Garcia", "Rahman", "Gill", "Walker", "Nakamura", "Osei", "Moreau", "Jensen", "Papadopoulos", "Cohen",
    "Singh", "Lopez", "Wright", "Baptiste", "Takahashi", "Mahlangu", "Costa", "Eriksson", "Farouk", "Brown",
    "Wang", "Kovacs", "Mendoza", "Achebe", "Horvat", "Bianchi", "Reyes", "Das", "Lee", "Zhou",
)
# {surname} and {place} are filled from the lists above; the whole name is one employer span.
EMPLOYER_PATTERNS: tuple[str, ...] = (
    "{surname} & Sons", "{surname} Logistics", "{place} General Hospital", "{surname} and {surname2} LLP",
    "{place} City Council", "{surname} Dental Care", "{place} Community College", "{surname} Construction",
    "{place} Public Library", "{surname} Bakery", "{surname} Engineering Ltd", "First Bank of {place}",
    "{place} Transit Authority", "{surname} Pharmacy", "{surname}-{surname2} Architects", "{place} Grammar School",
)

# (template id, text). A slot is {type} or {type2}; the type says what fills it (see _SLOT_KINDS).
TEMPLATES: tuple[tuple[str, str], ...] = (
    ("health-01", "I am {name}, {age}, from {place}. My doctor says my {condition} is getting worse. "
                  "What should I ask her at my next appointment?"),
    ("health-02", "My mother, {female_name}, is {old_age} and was diagnosed with {condition} last week. "
                  "Can you explain in plain words what that means for her?"),
    ("health-03", "I've had {condition} since I was {age}. I'm starting a new job as a {occupation} in {place} "
                  "next month. Should I tell my manager about it?"),
    ("health-04", "Can you help me write a short message to Dr. {surname}? My appointment on {date} clashes "
                  "with work, and I need my {condition} prescription renewed before then."),
    ("health-05", "My son {male_first} is {young_age} and his university in {place} says he may have {condition}. "
                  "What tests are usually done first?"),
    ("health-06", "I'm a {age}-year-old {occupation} with {condition}. What kind of exercise is safe for me?"),
    ("health-07", "Please summarise this for my husband {male_first}: the results of my test on {date} show early "
                  "{condition}, and the specialist wants to see me again in {place}."),
    ("health-08", "I'm {name} and my NHS number is {record}. How do I get my notes about my {condition} sent "
                  "to a new GP in {place}?"),
    ("work-01", "Write an email to my manager {name} at {employer} saying I need two weeks off from {date} "
                "for surgery."),
    ("work-02", "I'm a {occupation} at {employer} earning {salary} a year. Is that fair for someone with my "
                "experience in {place}?"),
    ("work-03", "Draft a cover letter for me: {name}, {age}, currently a {occupation} at {employer}, applying "
                "for a similar role in {place}."),
    ("work-04", "My colleague {name} at {employer} keeps making comments about my {condition}. How do I raise "
                "this with HR without making it worse?"),
    ("work-05", "Help me reply to a recruiter. I'm {name}, a {occupation} in {place}, and I won't move for less "
                "than {salary}."),
    ("work-06", "Write a reference letter for {name}, who worked under me as a {occupation} at {employer} "
                "until {date}."),
    ("work-07", "I was let go from {employer} on {date}, a week after telling them about my {condition}. "
                "Do I have a case?"),
    ("work-08", "Can you make this sound more professional? 'Hi {first}, I'm off sick with {condition} till "
                "{date}, call me on {phone} if it's urgent.'"),
    ("money-01", "My bank account number is {account} and someone took {amount} from it on {date}. "
                 "What should I say when I call the bank?"),
    ("money-02", "I'm {age}, I earn {salary} as a {occupation} and I have {amount} in savings. "
                 "How should I start investing?"),
    ("money-03", "Write a letter to my landlord {name} in {place} explaining that my rent of {amount} will be "
                 "late this month because of my {condition}."),
    ("money-04", "My card ending in {card} was charged {amount} twice at a shop in {place} on {date}. "
                 "Help me write a dispute message."),
    ("money-05", "My father {male_name} is {old_age} and has {condition}. How do I set up power of attorney so I can "
                 "manage his money?"),
    ("money-06", "I'm paid {salary} by {employer} and my partner earns {salary2}. How should we split our bills "
                 "fairly?"),
    ("money-07", "The tax office sent a letter to {name} at our address in {place} asking for {amount}. The "
                 "reference on it is {account}. What does this usually mean?"),
    ("travel-01", "I'm flying from {place} to {place2} on {date} with my {young_age}-year-old daughter {female_first}. "
                  "What documents do we need?"),
    ("travel-02", "Plan a three-day trip to {place} for me and my husband {male_first}; he has {condition} and can't "
                  "walk far."),
    ("travel-03", "I'm {name}, {age}, and I'll be working as a {occupation} in {place} for six months. What "
                  "should I know about healthcare there?"),
    ("travel-04", "Our booking is under {name}, phone {phone}. The airline cancelled our flight to {place} and "
                  "offered {amount}. Is that enough?"),
    ("travel-05", "Can you suggest things to do in {place} for a {age}-year-old with {condition}?"),
    ("family-01", "My daughter {female_first} is {young_age} and wants to move to {place} to become a {occupation}. "
                  "How can I support her?"),
    ("family-02", "Write a birthday message for my grandmother {female_name}, who turns {old_age} on {date}."),
    ("family-03", "My brother {male_name} works at {employer} and hasn't spoken to me since our father was "
                  "diagnosed with {condition}. How do I reach out?"),
    ("family-04", "We're moving from {place} to {place2} because my wife got a job as a {occupation} at "
                  "{employer}. How do I help our kids settle in?"),
    ("family-05", "My ex-husband {male_name} lives in {place} and pays {amount} a month towards our son's university "
                  "costs; he is {young_age}. Can I ask for more?"),
    ("family-06", "Help me write a note to my son's tutor, Mr. {surname}: {male_first} has {condition} and might "
                  "miss the session on {date}."),
)

_SLOT_KINDS = {
    "name": "name", "female_name": "name", "male_name": "name", "first": "name", "female_first": "name",
    "male_first": "name", "surname": "name", "place": "place",
    "age": "age", "young_age": "age", "old_age": "age", "condition": "condition",
    "employer": "employer", "occupation": "occupation",
    "salary": "number", "amount": "number", "account": "number", "card": "number",
    "phone": "number", "record": "number", "date": "number",
}

# Words the WordNet walk keeps that are no condition a person would name: categories, slang, dated or
# offensive terms, states that are not medical, WordNet's own misspellings.
CONDITION_DROPS = frozenset({
    "aberration", "ailment", "breakdown", "bulima nervosa", "choking", "clap", "cold", "collapse", "collywobbles",
    "complaint", "complication", "condition", "contagion", "crack-up", "craze", "cretinism", "crud", "disease",
    "disturbance", "dose", "endemic", "epidemic hysertia", "excrescence", "failure", "fantods", "flare", "folie",
    "folie a deux", "frenzy", "fury", "gargoylism", "growth", "herediatry spinal ataxia", "hickey", "ill",
    "incompetence", "indisposition", "infantile amaurotic idiocy", "juvenile amaurotic idiocy", "lichen",
    "love bite", "madness", "maladjustment", "mass hysteria", "mimesis", "neuroticism", "nympholepsy", "peduncle",
    "pest", "pestilence", "phlebotomus", "pock", "poison ivy", "poison oak", "poison sumac", "pox",
    "satanophobia", "schizoid", "strangulation", "syph", "tarantism", "vegetation", "xenophobia", "zit",
})
# Occupations the walk keeps that read as slurs, jokes, ranks or no job at all.
OCCUPATION_DROPS = frozenset({
    "abortionist", "accomplice", "ambulance chaser", "auxiliary", "beadle", "body servant", "career girl",
    "career man", "careerist", "courtier", "crammer", "hand", "hard worker", "help", "helper", "hired man",
    "horse doctor", "instrument", "lackey", "lasher", "lieutenant", "man", "manservant", "mate", "mud digger",
    "official", "ordinary", "peasant", "pencil pusher", "probationer", "puncher", "quack", "section man",
    "servant", "skilled worker", "slave", "squire", "subordinate", "trained worker", "underling", "wingman",
    "working girl", "yuppie",
})

_MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
           "November", "December")
_PLACE = re.compile(r"[A-Z][A-Za-z' .-]*")  # ASCII, no digits
_LOWER_PHRASE = re.compile(r"[a-z][a-z' -]*")


@dataclass(frozen=True)
class Span:
    """A personal detail: ``text == prompt.text[start:end]``, ``kind`` one of :data:`KINDS`."""

    start: int
    end: int
    kind: str
    text: str


@dataclass(frozen=True)
class QualityPrompt:
    """A prompt, its personal spans (sorted, disjoint, exact) and the id of the template it fills."""

    text: str
    spans: tuple[Span, ...]
    template: str

    def __post_init__(self) -> None:
        end = 0
        for span in self.spans:
            if span.kind not in KINDS:
                raise ValueError(f"unknown span kind {span.kind!r}")
            if not end <= span.start < span.end <= len(self.text) or self.text[span.start : span.end] != span.text:
                raise ValueError(f"span {span} is not an exact, disjoint, sorted span of {self.text!r}")
            end = span.end


# ---------------------------------------------------------------- WordNet


@dataclass(frozen=True)
class _Synset:
    words: tuple[tuple[str, int], ...]  # (lemma as written, lex_id)
    lex_filenum: int
    pointers: tuple[tuple[str, str], ...]  # (pointer symbol, target offset), noun targets only
    gloss: str


@functools.lru_cache(maxsize=2)
def _noun_synsets(root: str) -> dict[str, _Synset]:
    """data.noun by offset. A line: offset lex_filenum ss_type w_cnt [word lex_id]... p_cnt
    [symbol offset pos source/target]... | gloss (w_cnt and lex_id are hexadecimal)."""
    synsets: dict[str, _Synset] = {}
    with open(Path(root) / "data.noun", encoding="utf-8") as handle:
        for line in handle:
            if line.startswith("  "):  # the licence header
                continue
            head, _, gloss = line.partition(" | ")
            fields = head.split()
            n_words = int(fields[3], 16)
            words = tuple((fields[4 + 2 * i], int(fields[5 + 2 * i], 16)) for i in range(n_words))
            at = 4 + 2 * n_words
            pointers = tuple((fields[at + 1 + 4 * k], fields[at + 2 + 4 * k]) for k in range(int(fields[at]))
                             if fields[at + 3 + 4 * k] == "n")
            synsets[fields[0]] = _Synset(words, int(fields[1]), pointers, gloss.strip())
    return synsets


@functools.lru_cache(maxsize=2)
def _noun_senses(root: str) -> dict[str, tuple[str, ...]]:
    """index.noun: lemma -> its synset offsets, most frequent sense first. A line: lemma pos synset_cnt p_cnt
    [symbol]... sense_cnt tagsense_cnt offset..."""
    senses: dict[str, tuple[str, ...]] = {}
    with open(Path(root) / "index.noun", encoding="utf-8") as handle:
        for line in handle:
            if not line.startswith("  "):
                fields = line.split()
                senses[fields[0]] = tuple(fields[6 + int(fields[3]) :])
    return senses


@functools.lru_cache(maxsize=2)
def _tag_counts(root: str) -> dict[str, int]:
    """cntlist.rev: sense key -> how often the sense is tagged in WordNet's semantic concordance."""
    counts: dict[str, int] = {}
    with open(Path(root) / "cntlist.rev", encoding="utf-8") as handle:
        for line in handle:
            key, _, count = line.split()
            counts[key] = int(count)
    return counts


def _wordnet_root(root: PathLike | None) -> str:
    path = Path(root) if root is not None else WORDNET_DIR
    missing = [name for name in ("data.noun", "index.noun", "cntlist.rev") if not (path / name).is_file()]
    if missing:
        raise FileNotFoundError(f"WordNet not found at {path} (missing {missing}); "
                                "install it with `apt-get install wordnet-base`")
    return str(path)


def _sense(root: str, lemma: str, number: int = 1) -> str:
    return _noun_senses(root)[lemma][number - 1]


def _hyponyms(root: str, offset: str, symbols: tuple[str, ...] = ("~",)) -> set[str]:
    """The synsets under ``offset`` along ``symbols`` pointers, at any depth (``offset`` itself excluded)."""
    synsets, seen, stack = _noun_synsets(root), set(), [offset]
    while stack:
        for symbol, target in synsets[stack.pop()].pointers:
            if symbol in symbols and target not in seen:
                seen.add(target)
                stack.append(target)
    return seen


def _lemmas(root: str, offsets: Iterable[str], pattern: re.Pattern[str], max_words: int,
            keep: Callable[[_Synset, str, int], bool] = lambda *_: True) -> tuple[str, ...]:
    """The sorted distinct lemmas of ``offsets`` (underscores to spaces) that match ``pattern``, have at most
    ``max_words`` words and pass ``keep(synset, lemma as written, lex_id)``."""
    synsets, out = _noun_synsets(root), set()
    for offset in offsets:
        for word, lex_id in synsets[offset].words:
            text = word.replace("_", " ")
            if pattern.fullmatch(text) and len(text.split()) <= max_words and keep(synsets[offset], word, lex_id):
                out.add(text)
    return tuple(sorted(out))


def _head(synset: _Synset, word: str, lex_id: int) -> bool:
    """Whether ``word`` is its synset's first lemma (its usual name: no variant spelling, alias or slang)."""
    return synset.words[0][0] == word


def wordnet_places(root: PathLike | None = None) -> tuple[str, ...]:
    """Sorted city names: instances of ``city`` (sense 1) or of a hyponym of it, not glossed as ancient."""
    path = _wordnet_root(root)
    synsets, city = _noun_synsets(path), _sense(path, "city")
    kinds = {city} | _hyponyms(path, city)
    offsets = [offset for offset, synset in synsets.items()
               if any(symbol == "@i" and target in kinds for symbol, target in synset.pointers)
               and "ancient" not in synset.gloss.split(";")[0]]
    return _lemmas(path, offsets, _PLACE, max_words=4, keep=_head)


def wordnet_conditions(root: PathLike | None = None) -> tuple[str, ...]:
    """Sorted condition names of 1 to 3 lower-case words (see the module docstring)."""
    path = _wordnet_root(root)
    under = set().union(*(_hyponyms(path, _sense(path, lemma)) for lemma in ("illness", "disease", "disorder")))
    animal = _hyponyms(path, _sense(path, "animal_disease")) - _hyponyms(path, _sense(path, "zoonosis"))
    under -= animal | _hyponyms(path, _sense(path, "plant_disease")) | {_sense(path, "zoonosis")}
    return tuple(c for c in _lemmas(path, under, _LOWER_PHRASE, max_words=3) if c not in CONDITION_DROPS)


def wordnet_occupations(root: PathLike | None = None) -> tuple[str, ...]:
    """Sorted occupation names of 1 or 2 lower-case words (see the module docstring)."""
    path = _wordnet_root(root)
    counts = _tag_counts(path)

    def attested(synset: _Synset, word: str, lex_id: int) -> bool:  # sense key lemma%1:lex_filenum:lex_id::
        return counts.get(f"{word.lower()}%1:{synset.lex_filenum:02d}:{lex_id:02d}::", 0) > 0

    armed = set().union(*({_sense(path, w)} | _hyponyms(path, _sense(path, w)) for w in
                          ("serviceman", "military_officer")))
    professional = _lemmas(path, _hyponyms(path, _sense(path, "professional")), _LOWER_PHRASE, max_words=2,
                           keep=_head)
    worker = _lemmas(path, _hyponyms(path, _sense(path, "worker")) - armed, _LOWER_PHRASE, max_words=2, keep=attested)
    return tuple(sorted((set(professional) | set(worker)) - OCCUPATION_DROPS))


# ---------------------------------------------------------------- generation


def _pick(rng: np.random.Generator, options: Sequence[str]) -> str:
    return options[int(rng.integers(len(options)))]


def _with_article(literal: str, value: str) -> str:
    """``literal`` with a closing " a " turned into " an " before a vowel sound (only the article moves)."""
    if not re.search(r"(^|\s)[aA] $", literal):
        return literal
    word = value.lower()
    if word[0].isdigit():  # ages: an 18-, an 80-year-old
        an = word.startswith("8") or word in ("11", "18")
    else:
        an = word.startswith(("hon", "hour", "heir")) or (
            word[0] in "aeiou" and not word.startswith(("uni", "use", "usu", "uro", "ure", "eu", "one")))
    return literal[:-2] + literal[-2] + "n " if an else literal


class _Fillers:
    def __init__(self, rng: np.random.Generator, places: Sequence[str], conditions: Sequence[str],
                 occupations: Sequence[str]) -> None:
        self.rng, self.places, self.conditions, self.occupations = rng, places, conditions, occupations

    def __call__(self, slot: str) -> str:
        rng = self.rng
        match slot:
            case "name" | "female_name" | "male_name":
                return f"{self({'name': 'first', 'female_name': 'female_first', 'male_name': 'male_first'}[slot])} "\
                       f"{_pick(rng, SURNAMES)}"
            case "first":
                return _pick(rng, FIRST_NAMES)
            case "female_first":
                return _pick(rng, FEMALE_NAMES)
            case "male_first":
                return _pick(rng, MALE_NAMES)
            case "surname":
                return _pick(rng, SURNAMES)
            case "place":
                return _pick(rng, self.places)
            case "age" | "young_age" | "old_age":
                low, high = {"age": (18, 90), "young_age": (18, 30), "old_age": (60, 90)}[slot]
                return str(int(rng.integers(low, high + 1)))
            case "condition":
                return _pick(rng, self.conditions)
            case "occupation":
                return _pick(rng, self.occupations)
            case "employer":
                pattern = _pick(rng, EMPLOYER_PATTERNS)
                surname, surname2 = rng.choice(len(SURNAMES), size=2, replace=False)
                return pattern.format(surname=SURNAMES[surname], surname2=SURNAMES[surname2],
                                      place=_pick(rng, self.places))
            case "salary":
                return self._money(int(rng.integers(18, 180)) * 1000 + int(rng.integers(10)) * 100)
            case "amount":
                return self._money(int(rng.integers(20, 9000)))
            case "account":
                return str(int(rng.integers(10**7, 10**8)))
            case "card":
                return f"{int(rng.integers(10_000)):04d}"
            case "record":  # NHS numbers are written 3-3-4
                digits = f"{int(rng.integers(10**9, 10**10))}"
                return f"{digits[:3]} {digits[3:6]} {digits[6:]}"
            case "phone":
                if rng.integers(2):
                    return f"({int(rng.integers(201, 990))}) 555-01{int(rng.integers(100)):02d}"
                return f"07700 900{int(rng.integers(1000)):03d}"
            case "date":
                month, day = _pick(rng, _MONTHS), int(rng.integers(1, 29))
                return f"{day} {month}" if rng.integers(2) else f"{month} {day}, {int(rng.integers(2024, 2027))}"
        raise ValueError(f"no filler for slot {slot!r}")

    def _money(self, value: int) -> str:
        return _pick(self.rng, ("${:,}", "{:,} euros", "{:,} pounds")).format(value)


def _fill(template_id: str, template: str, fill: Callable[[str], str]) -> QualityPrompt:
    text, spans = "", []
    for literal, field, _, _ in string.Formatter().parse(template):
        if field is None:
            text += literal
            continue
        slot = field.rstrip("0123456789")
        value = fill(slot)
        text = text + _with_article(literal, value)
        spans.append(Span(len(text), len(text) + len(value), _SLOT_KINDS[slot], value))
        text += value
    return QualityPrompt(text, tuple(spans), template_id)


def generate_prompts(n: int = 400, *, seed: int = DEFAULT_SEED, root: PathLike | None = None) -> list[QualityPrompt]:
    """``n`` distinct prompts, template ``i % len(TEMPLATES)`` for the i-th; the same for the same seed."""
    if n < 1:
        raise ValueError(f"n must be at least 1, got {n}")
    rng = np.random.default_rng(seed)
    fill = _Fillers(rng, wordnet_places(root), wordnet_conditions(root), wordnet_occupations(root))
    prompts: list[QualityPrompt] = []
    seen: set[str] = set()
    for i in range(n):
        template_id, template = TEMPLATES[i % len(TEMPLATES)]
        for _ in range(1000):
            prompt = _fill(template_id, template, fill)
            if prompt.text not in seen:
                break
        else:
            raise RuntimeError(f"template {template_id} gives no new text after 1000 draws")
        seen.add(prompt.text)
        prompts.append(prompt)
    return prompts


def split_prompts(prompts: Sequence[QualityPrompt], test_fraction: float = 0.5,
                  seed: int = DEFAULT_SEED) -> tuple[list[QualityPrompt], list[QualityPrompt]]:
    """(train, test) by template: round(test_fraction * templates) of the templates, drawn with ``seed``, give
    test all their prompts; the rest go to train. Each keeps the order of ``prompts``."""
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    templates = sorted({p.template for p in prompts})
    if len(templates) < 2:
        raise ValueError("splitting by template needs prompts of at least two templates")
    n_test = min(max(round(test_fraction * len(templates)), 1), len(templates) - 1)
    order = np.random.default_rng(seed).permutation(len(templates))
    test = {templates[int(i)] for i in order[:n_test]}
    return [p for p in prompts if p.template not in test], [p for p in prompts if p.template in test]


def write_prompts(path: PathLike, train: Sequence[QualityPrompt] | None = None,
                  test: Sequence[QualityPrompt] | None = None) -> None:
    """JSON Lines, one prompt a line with its split; train then test. Without ``train`` and ``test``: the
    default set, ``split_prompts(generate_prompts())``."""
    if (train is None) != (test is None):
        raise ValueError("give both train and test, or neither")
    if train is None or test is None:
        train, test = split_prompts(generate_prompts())
    lines = []
    for split, prompts in zip(SPLITS, (train, test), strict=True):
        for p in prompts:
            spans = [{"start": s.start, "end": s.end, "kind": s.kind, "text": s.text} for s in p.spans]
            lines.append(json.dumps({"split": split, "template": p.template, "text": p.text, "spans": spans},
                                    ensure_ascii=False))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text("".join(line + "\n" for line in lines), encoding="utf-8")


def read_prompts(path: PathLike) -> tuple[list[QualityPrompt], list[QualityPrompt]]:
    """(train, test) from a file :func:`write_prompts` wrote; every span is checked against its text."""
    splits: dict[str, list[QualityPrompt]] = {split: [] for split in SPLITS}
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            row = json.loads(line)
            if row["split"] not in splits:
                raise ValueError(f"{path}:{number}: unknown split {row['split']!r}")
            spans = tuple(Span(int(s["start"]), int(s["end"]), str(s["kind"]), str(s["text"])) for s in row["spans"])
            splits[row["split"]].append(QualityPrompt(str(row["text"]), spans, str(row["template"])))
    return splits["train"], splits["test"]
