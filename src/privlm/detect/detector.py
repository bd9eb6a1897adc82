"""The detector: every layer's spans for a batch of texts, combined by union (recall first).

``Detector.default()`` stacks the validated patterns, the gazetteers and the learned tagger (which applies the
per-kind thresholds it was shipped with, chosen on its validation split). Another detector (Presidio, spaCy,
GLiNER, or a plugin's) is one more layer: ``Detector.default(backends=["presidio"])`` by its entry point's name
(:mod:`privlm.detect.backends`), or ``Detector.default(extra=[layer])``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from privlm.detect.spans import Kind, Layer, Span, merge_spans


class Detector:
    """Typed spans of personal details for a batch of texts: ``detect(texts)[i]`` are ``texts[i]``'s spans, sorted,
    non-overlapping, whole words, offsets into ``texts[i]``."""

    def __init__(self, layers: Sequence[Layer], thresholds: Mapping[Kind, float] | None = None) -> None:
        if not layers:
            raise ValueError("a detector needs at least one layer")
        self.layers = tuple(layers)
        self.thresholds = dict(thresholds or {})

    @classmethod
    def default(cls, *, device: str = "auto", backends: Sequence[str] = (), extra: Sequence[Layer] = ()
                ) -> Detector:
        """Patterns, gazetteers and the packaged tagger, then the ``backends`` named (raises ``ValueError`` for a
        name no entry point has, :class:`~privlm.detect.backends.BackendUnavailableError` where one's library or
        weights are missing), then ``extra``."""
        from privlm.detect.backends import load_backends
        from privlm.detect.gazetteers import GazetteerLayer
        from privlm.detect.patterns import PatternLayer
        from privlm.detect.tagger import TaggerLayer

        # The tagger applies its own thresholds (chosen on its validation split, on its probabilities); they would
        # mean nothing on the other layers' scores, so the union keeps every span the layers return.
        plugged = load_backends(backends, device) if backends else []
        return cls([PatternLayer(), GazetteerLayer(), TaggerLayer.packaged(device=device), *plugged, *extra])

    def detect(self, texts: Sequence[str]) -> list[list[Span]]:
        texts = list(texts)
        found: list[list[Span]] = [[] for _ in texts]
        for layer in self.layers:
            for i, spans in enumerate(layer.detect(texts)):
                found[i].extend(spans)
        return [merge_spans(text, spans, self.thresholds) for text, spans in zip(texts, found, strict=True)]


__all__ = ["Detector"]
