"""Other detectors as layers (privlm.detect.backends): their labels map to our kinds, offsets stay exact, what has
no kind of ours is dropped, and they are found by name through entry points. Stand-ins replace the libraries here;
the real Presidio and spaCy run where the bench extra installed them."""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import pytest

from privlm.detect import Detector, Kind, Span
from privlm.detect.backends import (
    GLINER_LABELS,
    PRESIDIO_KINDS,
    SPACY_KINDS,
    BackendUnavailableError,
    GlinerLayer,
    PresidioLayer,
    SpacyLayer,
    load_backends,
)
from privlm.plugins import detect_backends

TEXT = "Ms Zoë Okafor-Lind (41) banks with Monzo in Cork; 3 cats."


def _at(word: str) -> tuple[int, int]:
    start = TEXT.index(word)
    return start, start + len(word)


class FakeBatchAnalyzer:
    """Presidio's BatchAnalyzerEngine as PresidioLayer calls it."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def analyze_iterator(self, texts: list[str], language: str, batch_size: int, score_threshold: float
                         ) -> list[list[SimpleNamespace]]:
        self.calls.append({"language": language, "batch_size": batch_size, "score_threshold": score_threshold})
        return [[SimpleNamespace(entity_type=entity, start=start, end=end, score=score)
                 for entity, (start, end), score in (("PERSON", _at("Zoë Okafor-Lind"), 0.85),
                                                     ("LOCATION", _at("Cork"), 1.3), ("NEW_ENTITY", _at("cats"), 0.9))]
                if text == TEXT else [] for text in texts]


def test_presidio_entities_become_our_kinds_with_exact_offsets_and_unknown_ones_dropped() -> None:
    analyzer = FakeBatchAnalyzer()
    found = PresidioLayer(analyzer, threshold=0.4).detect([TEXT, "nothing here"])
    assert found[1] == []
    assert [(TEXT[s.start:s.end], s.kind, s.score, s.source) for s in found[0]] == [
        ("Zoë Okafor-Lind", Kind.PERSON, 0.85, "presidio:PERSON"), ("Cork", Kind.LOCATION, 1.0, "presidio:LOCATION")]
    assert analyzer.calls == [{"language": "en", "batch_size": 2, "score_threshold": 0.4}]


def test_spacy_entities_keep_personal_labels_only() -> None:
    class FakeNlp:
        def pipe(self, texts: Sequence[str]) -> list[SimpleNamespace]:
            ents = [("PERSON", "Zoë Okafor-Lind"), ("DATE", "41"), ("ORG", "Monzo"), ("GPE", "Cork"),
                    ("CARDINAL", "3")]
            return [SimpleNamespace(ents=[SimpleNamespace(label_=label, start_char=_at(word)[0],
                                                          end_char=_at(word)[1]) for label, word in ents])
                    for _ in texts]

    (spans,) = SpacyLayer(FakeNlp()).detect([TEXT])
    assert [(TEXT[s.start:s.end], s.kind) for s in spans] == [
        ("Zoë Okafor-Lind", Kind.PERSON), ("41", Kind.DATE), ("Monzo", Kind.ORGANIZATION), ("Cork", Kind.LOCATION)]
    assert {s.source for s in spans} == {"spacy:PERSON", "spacy:DATE", "spacy:ORG", "spacy:GPE"}


def test_gliner_is_asked_for_every_kind_and_its_answers_typed() -> None:
    asked: list[tuple[str, list[str], float]] = []

    class FakeGliner:
        def predict_entities(self, text: str, labels: list[str], threshold: float) -> list[dict[str, Any]]:
            asked.append((text, labels, threshold))
            return [{"start": _at("Monzo")[0], "end": _at("Monzo")[1], "label": "organization", "score": 0.7},
                    {"start": 0, "end": 0, "label": "person", "score": 0.9},  # empty: dropped
                    {"start": _at("cats")[0], "end": _at("cats")[1], "label": "animal", "score": 0.9}]

    (spans,) = GlinerLayer(FakeGliner(), threshold=0.3).detect([TEXT])
    assert [(TEXT[s.start:s.end], s.kind, s.score) for s in spans] == [("Monzo", Kind.ORGANIZATION, 0.7)]
    assert asked == [(TEXT, list(GLINER_LABELS), 0.3)]
    assert set(GLINER_LABELS.values()) == set(Kind)  # every kind is asked for


def test_every_label_table_maps_to_our_kinds() -> None:
    for table in (PRESIDIO_KINDS, SPACY_KINDS, GLINER_LABELS):
        assert all(isinstance(kind, Kind) for kind in table.values())


def test_privlm_registers_its_backends_as_entry_points() -> None:
    assert {"presidio", "spacy", "gliner"} <= set(detect_backends())


def test_backends_load_by_name_once_each_and_join_a_detector_by_union() -> None:
    class Marks:
        name = "marks"

        def detect(self, texts: Sequence[str]) -> list[list[Span]]:
            return [[Span(*_at("Monzo"), Kind.ORGANIZATION, 0.6, "marks")] if t == TEXT else [] for t in texts]

    built: list[str] = []

    def factory(device: str) -> Marks:
        built.append(device)
        return Marks()

    layers = load_backends(["marks", "marks"], "cuda:1", {"marks": lambda: factory})
    assert [layer.name for layer in layers] == ["marks"] and built == ["cuda:1"]  # a name twice is one layer
    (spans,) = Detector(layers).detect([TEXT])
    assert [(TEXT[s.start:s.end], s.kind) for s in spans] == [("Monzo", Kind.ORGANIZATION)]
    with pytest.raises(ValueError, match="no detection backend named 'nope'; installed: marks"):
        load_backends(["nope"], "cpu", {"marks": lambda: factory})
    with pytest.raises(TypeError, match="not a Layer"):
        load_backends(["bad"], "cpu", {"bad": lambda: lambda device: object()})


def test_a_backend_whose_library_is_missing_says_what_to_install() -> None:
    if importlib.util.find_spec("gliner") is not None:
        pytest.skip("gliner is installed here")
    with pytest.raises(BackendUnavailableError, match="gliner is not installed: `pip install gliner`"):
        load_backends(["gliner"], "cpu")


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("presidio_analyzer") is None, reason="presidio-analyzer not installed")
def test_the_real_presidio_and_spacy_backends_where_installed() -> None:
    presidio, spacy = load_backends(["presidio", "spacy"], "cpu")
    text = "My name is Maria Gonzalez and my email is maria.gonzalez@example.com."
    for layer, kinds in ((presidio, {Kind.PERSON, Kind.CONTACT}), (spacy, {Kind.PERSON})):
        (spans,) = layer.detect([text])
        assert kinds <= {s.kind for s in spans}
        person = next(s for s in spans if s.kind == Kind.PERSON)
        assert text[person.start:person.end] == "Maria Gonzalez"
