"""The gazetteer layer: every source contributes, whole words only, exact offsets whatever the Unicode, the
ambiguity rule, the longest match within a kind, a deterministic build."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from privlm.detect import Kind, Layer
from privlm.detect.gazetteers import LEXICONS, Entry, Gazetteer, GazetteerLayer, default_gazetteer, read_lexicon
from privlm.detect.gazetteers import _gazetteer as rules
from privlm.detect.gazetteers import _sources as sources
from privlm.detect.gazetteers._organizations import OrganizationRule
from privlm.detect.gazetteers._text import fold

DATA = Path(sources.__file__).parents[1] / "data"


@pytest.fixture(scope="module")
def gazetteer() -> Gazetteer:
    return default_gazetteer()


@pytest.fixture(scope="module")
def entries(gazetteer: Gazetteer) -> set[Entry]:
    return set(gazetteer.entries)


def found(gazetteer: Gazetteer, text: str, kind: Kind | None = None) -> list[tuple[str, Kind, float]]:
    return [(text[s.start:s.end], s.kind, s.score) for s in gazetteer.find(text) if kind in (None, s.kind)]


def surfaces(gazetteer: Gazetteer, text: str, kind: Kind) -> list[str]:
    return [surface for surface, _, _ in found(gazetteer, text, kind)]


# ---------------------------------------------------------------- sources


@pytest.mark.parametrize(("kind", "text", "source"), [
    (Kind.PERSON, "Priya", "faker"), (Kind.PERSON, "Gonzalez", "faker"), (Kind.PERSON, "Wei", "faker"),
    (Kind.LOCATION, "Seattle", "geonames:cities"), (Kind.LOCATION, "München", "geonames:cities"),
    (Kind.LOCATION, "Gießen", "geonames:towns"), (Kind.LOCATION, "Kenya", "geonames:countries"),
    (Kind.LOCATION, "Ohio", "geonames:us-states"), (Kind.LOCATION, "Orange County", "geonames:us-counties"),
    (Kind.LOCATION, "Bavaria", "lexicon:location"),
    (Kind.HEALTH, "cholera", "icd10cm"), (Kind.HEALTH, "catalepsy", "wordnet"),
    (Kind.HEALTH, "sugar diabetes", "lexicon:health-lay"),
    (Kind.MEDICATION, "tolazoline", "wordnet"), (Kind.MEDICATION, "metformin", "lexicon:medication"),
    (Kind.OCCUPATION, "dermatologist", "wordnet"), (Kind.OCCUPATION, "barista", "lexicon:occupation"),
    (Kind.RELIGION, "Sikh", "lexicon:religion"), (Kind.ETHNICITY, "Latina", "lexicon:ethnicity"),
    (Kind.ETHNICITY, "Nigerian", "lexicon:nationality"), (Kind.SEXUALITY, "bisexual", "lexicon:sexuality"),
    (Kind.UNION, "shop steward", "lexicon:union"),
])
def test_each_source_contributes_an_entry_that_is_found(gazetteer: Gazetteer, entries: set[Entry], kind: Kind,
                                                        text: str, source: str) -> None:
    assert Entry(kind, text, source) in entries
    sentence = f"Yesterday {text} came up twice: {text}."
    assert surfaces(gazetteer, sentence, kind) == [text, text]


def test_every_source_and_lexicon_has_entries(gazetteer: Gazetteer) -> None:
    counts = gazetteer.counts()
    lexicon_sources = {f"lexicon:{name.removeprefix('lexicon-').removesuffix('.txt')}" for name in LEXICONS}
    for source in {"faker", "icd10cm", "wordnet", "geonames:cities", "geonames:towns", "geonames:countries",
                   "geonames:us-states", "geonames:us-counties"} | lexicon_sources:
        assert sum(n for (_, s), n in counts.items() if s == source) > 0, source


def test_the_organization_rule_reads_its_words_and_needs_a_name_before_them() -> None:
    rule = OrganizationRule()
    text = "I work for Acme Ltd and study at the University of Leeds. The Bank was shut."
    assert [text[s.start:s.end] for s in rule.find(text)] == ["Acme Ltd", "University of Leeds"]
    assert {s.kind for s in rule.find(text)} == {Kind.ORGANIZATION}


def test_icd_titles_are_shortened_to_what_people_type() -> None:
    titles = ["Asthma, unspecified", "Essential (primary) hypertension", "Fracture of left wrist, initial encounter",
              "Type 2 diabetes mellitus without complications", "Other specified disorders of bone",
              "Cholera due to Vibrio cholerae 01, biovar eltor"]
    assert sources.shorten_icd(titles) == {"asthma", "essential hypertension", "fracture of wrist",
                                           "type 2 diabetes mellitus"}


def test_without_wordnet_the_other_sources_still_load(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(sources, "WORDNET_DIR", tmp_path)
    with caplog.at_level(logging.WARNING):
        assert sources.wordnet() is None
    assert "without WordNet" in caplog.text


@pytest.mark.parametrize("name", [*LEXICONS, "lexicon-organization-words.txt"])
def test_lexicons_are_sorted_distinct_trimmed_lines(name: str) -> None:
    lines = [line for line in (DATA / name).read_text(encoding="utf-8").splitlines() if not line.startswith("#")]
    assert all(line == line.strip() and line for line in lines), name
    assert lines == sorted(set(lines), key=lambda line: (line.casefold(), line)), name
    assert read_lexicon(name) == tuple(lines)


def test_the_build_is_deterministic(gazetteer: Gazetteer) -> None:
    net = sources.wordnet()
    domains = sources.kind_synsets(net) if net is not None else {}
    assert sources.all_entries(net, domains) == list(gazetteer.entries)


# ---------------------------------------------------------------- matching


def test_matches_are_whole_words(gazetteer: Gazetteer) -> None:
    assert surfaces(gazetteer, "Banana bread, Anastasia and Ana_x or Ana2", Kind.PERSON) == ["Anastasia"]
    assert surfaces(gazetteer, "Ana's sister and (Ana) said \"Ana\"", Kind.PERSON) == ["Ana", "Ana", "Ana"]
    assert surfaces(gazetteer, "She moved from Kenya-based work.", Kind.LOCATION) == ["Kenya"]


@pytest.mark.parametrize(("text", "kind", "expected"), [
    ("👍🏽 Greetings from Gießen, says Maria.", Kind.LOCATION, ["Gießen"]),  # ß folds to ss: one character, two
    ("👍🏽 Greetings from Gießen, says Maria.", Kind.PERSON, ["Maria"]),
    ("Grüße aus GIESSEN", Kind.LOCATION, ["GIESSEN"]),
    ("İstanbul'da Ayşe", Kind.LOCATION, ["İstanbul"]),  # İ casefolds to two characters
    ("東京のMaria と Ayşe", Kind.PERSON, ["Maria", "Ayşe"]),  # no space after the CJK: still a word start
    ("Jose\u0301 Garci\u0301a", Kind.PERSON, ["Jose\u0301", "Garci\u0301a"]),  # combining marks belong to the word
    ("ﬁona mArIa gonZALEZ", Kind.PERSON, ["ﬁona", "mArIa", "gonZALEZ"]),  # a ligature folds to two letters
    ("I live in Łódź, or Lodz.", Kind.LOCATION, ["Łódź", "Lodz"]),
])
def test_offsets_are_exact_with_unicode_and_mixed_case(gazetteer: Gazetteer, text: str, kind: Kind,
                                                       expected: list[str]) -> None:
    assert surfaces(gazetteer, text, kind) == expected


def test_offsets_are_exact_in_a_long_text(gazetteer: Gazetteer) -> None:
    chunk = "ẞtraße № 5 🏠 — Maria Gonzalez (İzmir) has asthma; "
    text = chunk * 400
    spans = gazetteer.find(text)
    people = [s.start for s in spans if s.kind == Kind.PERSON and text[s.start:s.end] == "Maria"]
    assert people == [i * len(chunk) + chunk.index("Maria") for i in range(400)]
    assert {text[s.start:s.end] for s in spans} >= {"Maria", "Gonzalez", "İzmir", "asthma"}
    assert all(fold(text[s.start:s.end]).strip() == fold(text[s.start:s.end]) != "" for s in spans)


def test_folding_spells_out_letters_and_drops_marks() -> None:
    assert fold("Straße İstanbul Łódź Søren ﬁsh") == "strasse istanbul lodz soren fish"


def test_the_longest_match_wins_within_a_kind_and_kinds_may_overlap(gazetteer: Gazetteer) -> None:
    text = "We moved from New York City to Mexico City. I'm Christian."
    assert surfaces(gazetteer, text, Kind.LOCATION) == ["New York City", "Mexico City"]
    kinds = {kind for surface, kind, _ in found(gazetteer, text) if surface == "Christian"}
    assert kinds == {Kind.PERSON, Kind.RELIGION}


# ---------------------------------------------------------------- the ambiguity rule


def scores(gazetteer: Gazetteer, text: str, word: str, kind: Kind) -> list[float]:
    return [score for surface, k, score in found(gazetteer, text, kind) if surface == word and k == kind]


def test_a_common_name_matches_only_capitalised_and_scores_less_at_a_sentence_start(gazetteer: Gazetteer) -> None:
    assert scores(gazetteer, "I met Rose there.", "Rose", Kind.PERSON) == [rules.CAPITALISED]
    assert scores(gazetteer, "Rose met me there.", "Rose", Kind.PERSON) == [rules.SENTENCE_START]
    assert scores(gazetteer, "I met Dr. Rose there.", "Rose", Kind.PERSON) == [rules.CAPITALISED]
    assert scores(gazetteer, "The rose is red. A Rose.", "rose", Kind.PERSON) == []
    assert scores(gazetteer, "i met rose there", "rose", Kind.PERSON) == [rules.ONE_CASE_TEXT]
    assert scores(gazetteer, "I live in Reading now.", "Reading", Kind.LOCATION) == [rules.CAPITALISED]
    assert scores(gazetteer, "I like reading books.", "reading", Kind.LOCATION) == []


def test_a_rare_name_matches_in_any_case_at_full_score(gazetteer: Gazetteer) -> None:
    assert scores(gazetteer, "i met priya in seattle", "priya", Kind.PERSON) == [1.0]
    assert scores(gazetteer, "I met PRIYA.", "PRIYA", Kind.PERSON) == [1.0]


def test_function_words_need_a_capital_within_a_sentence_and_the_commonest_never_match(gazetteer: Gazetteer) -> None:
    assert scores(gazetteer, "I told Will about it.", "Will", Kind.PERSON) == [rules.FUNCTION_CAPITALISED]
    assert scores(gazetteer, "Will you help? I will.", "Will", Kind.PERSON) == []
    assert scores(gazetteer, "will you help me", "will", Kind.PERSON) == []
    assert found(gazetteer, "I think The Who and I", Kind.PERSON) == []


def test_an_acronym_that_is_a_word_in_lower_case_matches_only_in_capitals(gazetteer: Gazetteer) -> None:
    assert surfaces(gazetteer, "My son has ADD. Please add sugar.", Kind.HEALTH) == ["ADD"]


def test_a_lower_case_kind_matches_in_any_case_and_yields_to_a_capitalised_name(gazetteer: Gazetteer) -> None:
    assert scores(gazetteer, "I have had depression for years.", "depression", Kind.HEALTH) == [
        rules.LOWER_KIND_COMMON]
    assert scores(gazetteer, "I have asthma.", "asthma", Kind.HEALTH) == [1.0]
    assert scores(gazetteer, "My friend is a baker.", "baker", Kind.OCCUPATION) == [1.0]
    assert scores(gazetteer, "I met Mr Baker.", "Baker", Kind.OCCUPATION) == [rules.LOWER_KIND_AS_NAME]
    assert scores(gazetteer, "My friend is a baker.", "baker", Kind.PERSON) == []


def test_weak_sources_give_no_ordinary_words(gazetteer: Gazetteer) -> None:
    text = "He took a hit of snow, then hurt his hand; death and taxes in Union."
    assert [s for s in gazetteer.find(text) if s.kind in (Kind.MEDICATION, Kind.HEALTH, Kind.LOCATION)] == []


def test_nationalities_score_less_than_other_ethnicities(gazetteer: Gazetteer) -> None:
    nigerian, latina = (scores(gazetteer, "My Nigerian husband and my Latina wife.", word, Kind.ETHNICITY)
                        for word in ("Nigerian", "Latina"))
    assert nigerian == [rules.SOURCE_BASE_SCORE["lexicon:nationality"]] and latina == [1.0]


# ---------------------------------------------------------------- the layer


def test_the_layer_detects_a_batch_with_its_source_name(gazetteer: Gazetteer) -> None:
    layer: Layer = GazetteerLayer(gazetteer)
    assert layer.name == "gazetteer"
    texts = ["I am Maria Gonzalez from Seattle and I take metformin.", "", "nothing here 123"]
    spans = layer.detect(texts)
    assert len(spans) == 3 and spans[1] == [] and spans[2] == []
    assert {(texts[0][s.start:s.end], s.source) for s in spans[0]} >= {
        ("Maria", "gazetteer:person"), ("Seattle", "gazetteer:location"), ("metformin", "gazetteer:medication")}
    assert "metformin" in GazetteerLayer(gazetteer).entries(Kind.MEDICATION)
