"""The benchmark harness: a named sweep of methods x privacy levels x tasks.

A sweep prepares shared state once (models, data), then evaluates every point. The harness shows
progress, times each point, and writes ``results.json`` (every figure with its provenance),
``results.md`` (a table) and one privacy-utility PNG per task.

Methods have a stable ``key`` (command lines, ``results.json`` rows) and a display ``label`` (tables,
plots); ``results.json`` keeps the key -> label map in its metadata. Files written before keys existed
hold labels in their rows; :func:`load_results` maps them back to keys with the sweep's registry entry.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from privlm.provenance import provenance
from privlm_bench.harness.json_values import from_json, to_json
from privlm_bench.harness.report import markdown_report, plot_privacy_utility


@dataclass(frozen=True)
class Method:
    """A method of a sweep: ``key`` is its stable id, ``label`` its display name, ``stream`` the name its
    noise is seeded from (methods that must release the same noise share a stream)."""

    key: str
    label: str
    stream: str = ""

    def __post_init__(self) -> None:
        if not self.key or not all(c.isalnum() or c in "-_" for c in self.key):
            raise ValueError(f"method key must be letters, digits, '-' or '_', got {self.key!r}")
        if not self.stream:
            object.__setattr__(self, "stream", self.label)


NON_PRIVATE = Method("non-private", "non-private")


@dataclass(frozen=True)
class Point:
    method: str  # a method key
    level: float  # eta or epsilon; math.inf is the non-private reference
    task: str


@dataclass
class Sweep:
    """A named grid. ``evaluate`` maps a point to its metrics (floats)."""

    name: str
    description: str
    methods: Sequence[Method]
    levels: Sequence[float]
    tasks: Sequence[str]
    evaluate: Callable[[Point], dict[str, float]]
    level_name: str = "eta"
    utility_metric: str = "auc"
    attack_metric: str = "attack_success"
    settings: dict[str, object] = field(default_factory=dict)
    references: Sequence[Point] = ()  # extra points, e.g. the non-private model

    def points(self) -> list[Point]:
        grid = [Point(m.key, lvl, t) for t in self.tasks for m in self.methods for lvl in self.levels]
        return [*self.references, *grid]

    def labels(self) -> dict[str, str]:
        """key -> label of every method, the non-private reference included."""
        return {NON_PRIVATE.key: NON_PRIVATE.label} | {m.key: m.label for m in self.methods}


@dataclass
class BenchReport:
    directory: Path
    rows: list[dict[str, object]]
    files: list[Path]


def _level(value: object) -> float:
    if not isinstance(value, int | float):
        raise ValueError(f"a privacy level must be a number, got {value!r}")
    return float(value)


def run_sweep(sweep: Sweep, *, out_dir: Path, seed: int, console: Console | None = None,
              command: list[str] | None = None, resume: bool = False) -> BenchReport:
    """Evaluate every point; with ``resume``, keep the points a crashed run already finished."""
    console = console or Console()
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = provenance(seed=seed, command=command) | {"sweep": sweep.name, "description": sweep.description,
                                                     "settings": sweep.settings, "level_name": sweep.level_name,
                                                     "methods": sweep.labels()}
    partial = out_dir / "results.partial.jsonl"
    rows = _resumable_rows(partial, sweep) if resume else []
    done = {(r["task"], r["method"], r[sweep.level_name]) for r in rows}
    if not resume:
        partial.unlink(missing_ok=True)
    started = time.perf_counter()
    columns = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=False) as progress:
        overall = progress.add_task(f"sweep {sweep.name}", total=len(sweep.points()), completed=len(done))
        for point in sweep.points():
            if (point.task, point.method, point.level) in done:
                continue
            progress.update(overall, description=f"{sweep.name}: {point.task} / {sweep.labels()[point.method]} / "
                                                 f"{sweep.level_name}={point.level:g}")
            t0 = time.perf_counter()
            metrics = sweep.evaluate(point)
            rows.append({"task": point.task, "method": point.method, sweep.level_name: point.level,
                         **metrics, "seconds": round(time.perf_counter() - t0, 2)})
            with partial.open("a") as file:  # one line per finished point, so a crash loses one point only
                file.write(json.dumps({k: to_json(v) for k, v in rows[-1].items()}) + "\n")
            progress.advance(overall)
    partial.unlink(missing_ok=True)
    order = {(p.task, p.method, p.level): i for i, p in enumerate(sweep.points())}
    rows.sort(key=lambda r: order[(str(r["task"]), str(r["method"]), _level(r[sweep.level_name]))])
    meta["wall_seconds"] = round(time.perf_counter() - started, 1)
    files = [out_dir / "results.json", out_dir / "results.md"]
    payload = {"metadata": meta, "rows": [{k: to_json(v) for k, v in row.items()} for row in rows]}
    meta |= {"utility_metric": sweep.utility_metric, "attack_metric": sweep.attack_metric}
    files[0].write_text(json.dumps(payload, indent=2) + "\n")
    return BenchReport(directory=out_dir, rows=rows, files=files[:1] + render_report(out_dir))


def _resumable_rows(partial: Path, sweep: Sweep) -> list[dict[str, object]]:
    if not partial.exists():
        return []
    wanted = {(p.task, p.method, p.level) for p in sweep.points()}
    rows = [{k: from_json(v) for k, v in json.loads(line).items()} for line in partial.read_text().splitlines()]
    return [r for r in rows if (r["task"], r["method"], r[sweep.level_name]) in wanted]


Row = dict[str, object]


@dataclass(frozen=True)
class Results:
    """A sweep's ``results.json``: metadata, rows keyed by method key, and each key's display label."""

    meta: dict[str, object]
    rows: list[Row]
    labels: dict[str, str]

    def labelled_rows(self) -> list[Row]:
        """Rows with each method key replaced by its label, for tables and plots."""
        return [r | {"method": self.labels.get(str(r["method"]), str(r["method"]))} for r in self.rows]


def load_results(out_dir: Path, *, known: Sequence[Method] = ()) -> Results:
    """``out_dir/results.json`` with "inf"/"nan" back as floats. ``known`` maps the labels that files
    written before method keys hold in their rows back to keys."""
    payload = json.loads((out_dir / "results.json").read_text())
    meta, rows = payload["metadata"], [{k: from_json(v) for k, v in row.items()} for row in payload["rows"]]
    labels = meta.get("methods")
    if labels is None:
        by_label = {m.label: m.key for m in (NON_PRIVATE, *known)}
        labels = {by_label.get(str(r["method"]), str(r["method"])): str(r["method"]) for r in rows}
        rows = [r | {"method": by_label.get(str(r["method"]), str(r["method"]))} for r in rows]
    return Results(meta=meta, rows=rows, labels={str(k): str(v) for k, v in labels.items()})


def render_report(out_dir: Path, *, known: Sequence[Method] = ()) -> list[Path]:
    """(Re)write ``results.md`` and the plots from ``results.json`` alone."""
    results = load_results(out_dir, known=known)
    meta, rows = results.meta, results.labelled_rows()
    level_name = str(meta["level_name"])
    files = [out_dir / "results.md"]
    files[0].write_text(markdown_report(meta, rows))
    for task in dict.fromkeys(str(r["task"]) for r in rows):
        png = out_dir / f"privacy_utility_{task}.png"
        plot_privacy_utility([r for r in rows if r["task"] == task], path=png, title=f"{meta['sweep']}: {task}",
                             level_name=level_name, x_metric=str(meta.get("attack_metric", "attack_success")),
                             y_metric=str(meta.get("utility_metric", "auc")),
                             caption=f"{meta['command']}  (seed {meta['seed']}, {str(meta['git_commit'])[:12]})")
        files.append(png)
    return files
