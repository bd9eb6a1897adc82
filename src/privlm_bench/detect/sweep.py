"""``privlm bench detect``: every row on both evaluation sets in one run, scored (:mod:`.metrics`) and timed.

Latency, per row and set, after the same warm-up for every row (``warmup`` single prompts, then one batch):
- batch 1: each prompt alone, timed; the median and the 90th percentile over prompts;
- batch ``batch_size`` (32): consecutive prompts in batches; per batch, its time over its size; the median over
  batches.
The scores are those of the batch-1 pass (a gateway detects one prompt at a time); ``batch_differs`` counts the
prompts whose spans (start, end, kind) the batched pass gives otherwise. Torch runs on ``threads`` threads (default:
the cores this process may use), recorded with the machine.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.console import Console

from privlm.detect import Span
from privlm.provenance import provenance
from privlm_bench.chat.quality_prompts import PROMPTS_FILE
from privlm_bench.detect.data import HANDWRITTEN_FILE, load_sets
from privlm_bench.detect.metrics import score
from privlm_bench.detect.rows import (
    PRESIDIO_PIPELINE,
    PRESIDIO_THRESHOLD,
    ROW_BUILDERS,
    DetectRow,
    RowBuilder,
    RowContext,
    RowUnavailableError,
)

NAME = "detect"
ROWS = tuple(ROW_BUILDERS)


def available_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@dataclass(frozen=True, kw_only=True)
class DetectSetting:
    """Everything the run records in ``results.json``."""

    rows: tuple[str, ...] = ROWS
    device: str = "cpu"
    limit: int | None = None  # the first prompts of each set only (a quick run)
    prompts_file: str = str(PROMPTS_FILE)
    handwritten_file: str = str(HANDWRITTEN_FILE)
    batch_size: int = 32
    warmup: int = 3
    passes: int = 3  # each prompt (and batch) timed this many times, its fastest kept: a busy moment is no latency
    threads: int = field(default_factory=available_cores)
    presidio_pipeline: str = PRESIDIO_PIPELINE
    presidio_threshold: float = PRESIDIO_THRESHOLD
    seed: int = 0  # nothing is drawn at random; recorded as every bench records one

    def __post_init__(self) -> None:
        for name in ("batch_size", "warmup", "passes", "threads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "warmup" else 1):
                raise ValueError(f"{name} must be a {'non-negative' if name == 'warmup' else 'positive'} integer, "
                                 f"got {value!r}")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"limit must be at least 1, got {self.limit}")
        if not self.rows or len(set(self.rows)) != len(self.rows):
            raise ValueError(f"rows must be distinct and at least one, got {self.rows}")
        if not 0.0 <= self.presidio_threshold <= 1.0:
            raise ValueError(f"presidio_threshold must lie in [0, 1], got {self.presidio_threshold}")


def _shape(spans: Sequence[Span]) -> list[tuple[int, int, str]]:
    return [(s.start, s.end, s.kind.value) for s in spans]


def _fastest(detect: Callable[[list[str]], list[list[Span]]], texts: list[str], passes: int
             ) -> tuple[list[list[Span]], float]:
    """``detect(texts)`` (the first pass's spans) and the fastest of ``passes`` timings, in seconds."""
    seconds: list[float] = []
    found: list[list[Span]] = []
    for n in range(passes):
        started = time.perf_counter()
        spans = detect(texts)
        seconds.append(time.perf_counter() - started)
        found = spans if n == 0 else found
    return found, min(seconds)


def timed_detect(row: DetectRow, texts: Sequence[str], batch_size: int, warmup: int, passes: int = 1
                 ) -> tuple[list[list[Span]], dict[str, float]]:
    """The row's spans for each text (alone), and its latency per prompt at batch 1 and at ``batch_size``: each
    prompt and each batch timed ``passes`` times, the fastest kept."""
    for text in texts[:warmup]:
        row.detect([text])
    if warmup:
        row.detect(texts[:batch_size])
    gc.collect()
    single, found = [], []
    for text in texts:
        spans, seconds = _fastest(row.detect, [text], passes)
        found += spans
        single.append(seconds)
    per_prompt, batched = [], []
    for at in range(0, len(texts), batch_size):
        chunk = list(texts[at:at + batch_size])
        spans, seconds = _fastest(row.detect, chunk, passes)
        batched += spans
        per_prompt.append(seconds / len(chunk))
    if len(found) != len(texts) or len(batched) != len(texts):
        raise ValueError(f"row {row.key} returned spans for {len(found)} / {len(batched)} of {len(texts)} texts")
    single_ms, batched_ms = np.asarray(single) * 1000.0, np.asarray(per_prompt) * 1000.0
    latency = {"batch1_median_ms": float(np.median(single_ms)), "batch1_p90_ms": float(np.percentile(single_ms, 90)),
               "batch1_mean_ms": float(np.mean(single_ms)), "batched_median_ms": float(np.median(batched_ms)),
               "batch_size": float(batch_size), "batches": float(len(per_prompt)), "passes": float(passes),
               "last_batch": float(len(texts) - batch_size * (len(per_prompt) - 1))}
    differs = sum(_shape(a) != _shape(b) for a, b in zip(found, batched, strict=True))
    return found, latency | {"batch_differs": float(differs)}


def run_detect_bench(setting: DetectSetting, out_dir: Path, console: Console | None = None, *,
                     command: Sequence[str] | None = None,
                     builders: Mapping[str, RowBuilder] = ROW_BUILDERS) -> list[Path]:
    """Every row of ``setting.rows`` on both sets; writes results.json, results.md and the plot in ``out_dir``."""
    from privlm_bench.detect.report import write_detect_report

    console = console or Console()
    unknown = sorted(set(setting.rows) - set(builders))
    if unknown:
        raise ValueError(f"unknown rows {unknown}; known: {', '.join(builders)}")
    torch.set_num_threads(setting.threads)
    meta = {"sweep": NAME, **provenance(seed=setting.seed, command=list(command) if command else None),
            "setting": asdict(setting), "torch_threads": torch.get_num_threads(), "cores": available_cores()}
    started = time.perf_counter()
    sets = load_sets(setting.prompts_file, setting.handwritten_file, setting.limit)
    context = RowContext(setting.device, setting.presidio_pipeline, setting.presidio_threshold)
    rows: list[dict[str, Any]] = []
    info: dict[str, Any] = {}
    skipped: dict[str, str] = {}
    for key in setting.rows:
        row = _build(builders[key], context, key, skipped, console.log)
        if row is None:
            continue
        info[key] = {"label": row.label, **row.info}
        for eval_set in sets:
            found, latency = timed_detect(row, [p.text for p in eval_set.prompts], setting.batch_size, setting.warmup,
                                          setting.passes)
            rows.append({"row": key, "set": eval_set.name, "prompts": len(eval_set.prompts),
                         **score(eval_set.prompts, found), "latency": latency})
            recall = rows[-1]["overall"]["recall"]["rate"]
            console.log(f"{key} on {eval_set.name}: recall {recall:.3f}, batch 1 {latency['batch1_median_ms']:.1f} ms, "
                        f"batch {setting.batch_size} {latency['batched_median_ms']:.1f} ms per prompt", highlight=False)
    payload = {"metadata": meta | {"seconds": time.perf_counter() - started},
               "sets": {s.name: {"file": s.source, "prompts": len(s.prompts), "spans": sum(s.span_counts().values()),
                                 "median_chars": float(np.median([len(p.text) for p in s.prompts])),
                                 "span_counts": s.span_counts()} for s in sets},
               "row_info": info, "skipped_rows": skipped, "rows": rows}
    return write_detect_report(out_dir, payload)


def _build(builder: RowBuilder, context: RowContext, key: str, skipped: dict[str, str],
           log: Callable[..., None]) -> DetectRow | None:
    try:
        row = builder(context)
    except RowUnavailableError as reason:
        skipped[key] = str(reason)
        log(f"{key}: skipped ({reason})", highlight=False)
        return None
    if row.key != key:
        raise ValueError(f"the builder of row {key!r} made row {row.key!r}")
    return row

