"""``privlm bench detect-dev``: the detector's choices swept on the hand-written set's development quarter only.

The test parts are never read here. Two of the tagger's decoding choices are scored with the bench's own measures
(:func:`privlm_bench.detect.metrics.score`), the other layers and the tagger's probabilities computed once:
- the growth ratio (:data:`privlm.detect.tagger.EXTEND_RATIO`): a run grows into neighbours whose probability of
  its kind reaches this share of the kind's threshold; 1 is no growth;
- a floor under every threshold (what raising the thresholds buys in precision and costs in recall), with the
  shipped growth ratio.
Writes development.json (with provenance) and development.md beside the bench's results.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from privlm.detect import Detector, Kind, Span, merge_spans
from privlm.detect.tagger import EXTEND_RATIO, TaggerLayer, decode
from privlm.provenance import provenance
from privlm_bench.detect.data import HANDWRITTEN_FILE, GoldPrompt, read_handwritten
from privlm_bench.detect.metrics import score
from privlm_bench.harness.report import markdown_table

GROWTH_RATIOS = (1.0, 0.5, 0.3, 0.2, 0.1, 0.05)
THRESHOLD_FLOORS = (0.0, 0.3, 0.5, 0.7)
Probabilities = Sequence[tuple[np.ndarray, np.ndarray]]  # per text: token offsets, label probabilities


def _measures(prompts: Sequence[GoldPrompt], found: Sequence[Sequence[Span]]) -> dict[str, Any]:
    overall = score(prompts, found)["overall"]
    return {name: overall[name] for name in ("recall", "partly", "precision", "char_precision")}


def variants(prompts: Sequence[GoldPrompt], other_spans: Sequence[Sequence[Span]], probabilities: Probabilities,
             thresholds: Mapping[Kind, float], ratios: Sequence[float] = GROWTH_RATIOS,
             floors: Sequence[float] = THRESHOLD_FLOORS, shipped_ratio: float = EXTEND_RATIO) -> dict[str, Any]:
    """The measures of each growth ratio, and of each threshold floor at ``shipped_ratio``: every variant is the
    union of ``other_spans`` (the patterns' and gazetteers') and the tagger decoded from ``probabilities``."""

    def scored(limits: Mapping[Kind, float], ratio: float) -> dict[str, Any]:
        found = [merge_spans(p.text, [*others, *decode(p.text, offsets, probs, limits, extend=ratio)])
                 for p, others, (offsets, probs) in zip(prompts, other_spans, probabilities, strict=True)]
        return _measures(prompts, found)

    return {"growth": [{"ratio": r, **scored(thresholds, r)} for r in ratios],
            "floors": [{"floor": f, **scored({k: max(v, f) for k, v in thresholds.items()}, shipped_ratio)}
                       for f in floors]}


def development_sweep(device: str = "cpu", handwritten_file: str | Path = HANDWRITTEN_FILE,
                      command: list[str] | None = None) -> dict[str, Any]:
    """Every variant on the development quarter of ``handwritten_file``, with the default detector's layers."""
    started = provenance(seed=0, command=command)
    dev = read_handwritten(handwritten_file, part="dev")
    prompts = list(dev.prompts)
    detector = Detector.default(device=device)
    tagger = next(layer for layer in detector.layers if isinstance(layer, TaggerLayer))
    texts = [p.text for p in prompts]
    other_spans: list[list[Span]] = [[] for _ in texts]
    for layer in detector.layers:
        if layer is not tagger:
            for spans, found in zip(other_spans, layer.detect(texts), strict=True):
                spans.extend(found)
    result = variants(prompts, other_spans, tagger.probabilities(texts), tagger.thresholds)
    return {"provenance": started, "set": dev.name, "file": str(handwritten_file), "prompts": len(prompts),
            "spans": sum(len(p.spans) for p in prompts), "shipped_ratio": EXTEND_RATIO, **result}


def _percent(measure: Mapping[str, Any]) -> str:
    return f"{measure['rate']:.1%} ({measure['hits']}/{measure['n']})" if measure["n"] else "-"


def development_markdown(payload: Mapping[str, Any]) -> str:
    def row(head: dict[str, object], entry: Mapping[str, Any]) -> dict[str, object]:
        return head | {name: _percent(entry[name]) for name in ("recall", "partly", "precision", "char_precision")}

    return "\n".join([
        "# privlm bench detect-dev", "",
        f"`{payload['provenance']['command']}` at {str(payload['provenance']['git_commit'])[:12]}: "
        f"{payload['set']}, {payload['prompts']} prompts, {payload['spans']} gold spans (the development quarter "
        "only; the test parts are never read). Measures as in results.md.", "",
        "## The tagger's growth ratio", "",
        markdown_table([row({"ratio": f"{e['ratio']:g}"}, e) for e in payload["growth"]]),
        f"## A floor under every threshold (growth ratio {payload['shipped_ratio']:g})", "",
        markdown_table([row({"floor": f"{e['floor']:g}"}, e) for e in payload["floors"]])])


def write_development(payload: Mapping[str, Any], out_dir: str | Path) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "development.json", out / "development.md"]
    written[0].write_text(json.dumps(payload, indent=1) + "\n", encoding="utf-8")
    written[1].write_text(development_markdown(payload) + "\n", encoding="utf-8")
    return written


__all__ = ["GROWTH_RATIOS", "THRESHOLD_FLOORS", "development_markdown", "development_sweep", "variants",
           "write_development"]
