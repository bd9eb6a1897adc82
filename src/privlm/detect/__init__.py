"""Local detection of personal details: typed spans ``(start, end, kind, score, source)`` for a batch of texts,
from validated patterns, gazetteers of packaged public sources and a small tagger on the packaged MiniLM,
combined by union. ``Detector.default().detect(texts)``; docs/detect.md says what is detected and how well."""

from privlm.detect.detector import Detector
from privlm.detect.spans import KINDS, Kind, Layer, Span, merge_spans, widen_to_words

__all__ = ["KINDS", "Detector", "Kind", "Layer", "Span", "merge_spans", "widen_to_words"]
