"""The report of ``privlm bench detect``: results.md, the issue's verdicts and the recall plot, from results.json
alone (``privlm bench report benchmarks/detect`` re-renders them).

Verdicts (issue 39, "Done when"), each per set and computed from the ``privlm`` row of the run:
- overall recall at least :data:`RECALL_GOALS` (97% on the test split, 95% on the hand-written set and on its
  second batch alone);
- recall at least 90% in every kind with at least 20 gold spans;
- recall above Presidio's row of the same run, overall and in every kind with gold spans (point estimates; the
  intervals are in the tables; where both catch every span of a kind, 100% each, the kind passes: a tie at the
  ceiling cannot be beaten);
- median latency per prompt at most 15 ms at batch 32 and at most 30 ms at batch 1;
- precision at least 80% (expected, not a gate).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.figure import Figure

from privlm.detect import Kind
from privlm_bench.harness.json_values import from_json, to_json
from privlm_bench.harness.report import markdown_table

Row = Mapping[str, Any]
OURS, RIVAL = "privlm", "presidio"
RECALL_GOALS = {"test-split": 0.97, "handwritten": 0.95, "handwritten-batch-2": 0.95}
KIND_GOAL, KIND_MIN_SPANS = 0.90, 20
BATCHED_GOAL_MS, SINGLE_GOAL_MS = 15.0, 30.0
PRECISION_EXPECTED = 0.80
HOLDS, FAILS, UNMEASURED = "holds", "does not hold", "not measured"
PLOT = "recall_per_kind.png"


def _rate(measure: Mapping[str, Any] | None) -> float:
    value = None if measure is None else measure.get("rate")
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else math.nan


def _row(payload: Mapping[str, Any], key: str, set_name: str) -> Row | None:
    return next((r for r in payload["rows"] if r["row"] == key and r["set"] == set_name), None)


def _pct(value: float) -> str:
    return "n/a" if not math.isfinite(value) else f"{value:.1%}"


def _verdict(set_name: str, claim: str, holds: bool | None, detail: str) -> dict[str, str]:
    return {"set": set_name, "claim": claim, "verdict": UNMEASURED if holds is None else HOLDS if holds else FAILS,
            "detail": detail}


# --------------------------------------------------------------------------------------------- verdicts
def _recall_verdicts(set_name: str, ours: Row) -> list[dict[str, str]]:
    goal = RECALL_GOALS.get(set_name, max(RECALL_GOALS.values()))
    recall = ours["overall"]["recall"]
    big = {k: m["recall"] for k, m in ours["kinds"].items() if m["recall"]["n"] >= KIND_MIN_SPANS}
    short = [f"{k} {_pct(_rate(m))}" for k, m in big.items() if not _rate(m) >= KIND_GOAL]
    return [
        _verdict(set_name, f"overall recall >= {goal:.0%}", _rate(recall) >= goal,
                 f"{_pct(_rate(recall))} [{_pct(recall['low'])}, {_pct(recall['high'])}] of {recall['n']} spans"),
        _verdict(set_name, f"recall >= {KIND_GOAL:.0%} in every kind with >= {KIND_MIN_SPANS} spans",
                 None if not big else not short,
                 ("no kind has that many spans" if not big else
                  "below: " + ", ".join(short) if short else
                  "all of " + ", ".join(f"{k} {_pct(_rate(m))}" for k, m in big.items()))),
    ]


def _not_above(ours: float, rival: float) -> bool:
    """Whether ``ours`` fails to beat ``rival``: below it, or level with it short of 100% (a tie at 100% cannot be
    beaten, so it passes)."""
    return not (ours > rival or ours == rival == 1.0)


def _rival_verdict(set_name: str, ours: Row, rival: Row | None) -> dict[str, str]:
    claim = "recall above Presidio's, overall and in every kind (a tie at 100% passes)"
    if rival is None:
        return _verdict(set_name, claim, None, "no Presidio row in this run")
    pairs = {"overall": (ours["overall"]["recall"], rival["overall"]["recall"])}
    pairs |= {k: (m["recall"], rival["kinds"].get(k, {}).get("recall")) for k, m in ours["kinds"].items()}
    not_above = [f"{k} {_pct(_rate(a))} vs {_pct(_rate(b))}" for k, (a, b) in pairs.items()
                 if _not_above(_rate(a), _rate(b))]
    detail = ("not above in: " + "; ".join(not_above)) if not_above else \
        "; ".join(f"{k} {_pct(_rate(a))} vs {_pct(_rate(b))}" for k, (a, b) in pairs.items())
    return _verdict(set_name, claim, not not_above, detail)


def _latency_verdicts(set_name: str, ours: Row, rival: Row | None, median_chars: float | None
                      ) -> list[dict[str, str]]:
    latency = ours["latency"]
    size = int(latency["batch_size"])
    beside = "" if rival is None else (f" (Presidio: {rival['latency']['batched_median_ms']:.1f} ms and "
                                       f"{rival['latency']['batch1_median_ms']:.1f} ms)")
    if median_chars is not None:  # time per prompt grows with its length: say how long this set's prompts are
        beside += f"; prompts of median length {median_chars:,.0f} characters"
    return [
        _verdict(set_name, f"median latency <= {BATCHED_GOAL_MS:g} ms per prompt at batch {size}",
                 latency["batched_median_ms"] <= BATCHED_GOAL_MS,
                 f"{latency['batched_median_ms']:.1f} ms over {int(latency['batches'])} batches{beside}"),
        _verdict(set_name, f"median latency <= {SINGLE_GOAL_MS:g} ms per prompt at batch 1",
                 latency["batch1_median_ms"] <= SINGLE_GOAL_MS,
                 f"{latency['batch1_median_ms']:.1f} ms (p90 {latency['batch1_p90_ms']:.1f} ms)"),
    ]


def verdicts(payload: Mapping[str, Any]) -> list[dict[str, str]]:
    """The issue's verdicts per set, from the rows of ``payload``."""
    out = []
    for set_name in payload["sets"]:
        ours, rival = _row(payload, OURS, set_name), _row(payload, RIVAL, set_name)
        if ours is None:
            out.append(_verdict(set_name, "every verdict", None, f"no {OURS} row in this run"))
            continue
        precision = ours["overall"]["precision"]
        out += [*_recall_verdicts(set_name, ours), _rival_verdict(set_name, ours, rival),
                *_latency_verdicts(set_name, ours, rival, payload["sets"][set_name].get("median_chars")),
                _verdict(set_name, f"precision >= {PRECISION_EXPECTED:.0%} (expected)",
                         _rate(precision) >= PRECISION_EXPECTED,
                         f"{_pct(_rate(precision))} of {precision['n']} detected spans")]
    return out


# --------------------------------------------------------------------------------------------- tables
def _cell(measure: Mapping[str, Any] | None) -> str:
    if measure is None or not measure.get("n"):
        return "-"
    return f"{_rate(measure):.3f} [{measure['low']:.3f}, {measure['high']:.3f}]"


def _label(payload: Mapping[str, Any], key: str) -> str:
    return str(payload["row_info"].get(key, {}).get("label", key))


def _set_rows(payload: Mapping[str, Any], set_name: str) -> list[Row]:
    return [r for r in payload["rows"] if r["set"] == set_name]


def recall_table(payload: Mapping[str, Any], set_name: str, measure: str = "recall") -> str:
    counts = payload["sets"][set_name]["span_counts"]
    lines: list[dict[str, object]] = []
    for r in _set_rows(payload, set_name):
        cells: dict[str, object] = {"row": _label(payload, r["row"]),
                                    f"overall (n={payload['sets'][set_name]['spans']})": _cell(r["overall"][measure])}
        cells |= {f"{k} (n={n})": _cell(r["kinds"].get(k, {}).get(measure)) for k, n in counts.items()}
        lines.append(cells)
    return markdown_table(lines)


def precision_table(payload: Mapping[str, Any], set_name: str) -> str:
    rows = _set_rows(payload, set_name)
    kinds = [k.value for k in Kind if any(k.value in r["precision_kinds"] for r in rows)]
    lines: list[dict[str, object]] = []
    for r in rows:
        overall = r["overall"]["precision"]
        cells: dict[str, object] = {"row": _label(payload, r["row"]), "overall": _cell(overall),
                                    "detected": overall["n"], "characters": _cell(r["overall"].get("char_precision"))}
        for kind in kinds:
            measure = r["precision_kinds"].get(kind)
            cells[kind] = "-" if measure is None else f"{_rate(measure):.3f} (n={measure['n']})"
        lines.append(cells)
    return markdown_table(lines)


def leak_table(payload: Mapping[str, Any], set_name: str) -> str:
    return markdown_table([{"row": _label(payload, r["row"]), "caught": _cell(r["overall"]["recall"]),
                            "left verbatim": _cell(r["overall"]["verbatim"]),
                            "partly covered": _cell(r["overall"]["partly"]),
                            "prompts leaking": _cell(r["overall"]["prompts_leaking"])}
                           for r in _set_rows(payload, set_name)])


def latency_table(payload: Mapping[str, Any]) -> str:
    lines: list[dict[str, object]] = []
    for key in dict.fromkeys(r["row"] for r in payload["rows"]):
        cells: dict[str, object] = {"row": _label(payload, key)}
        for set_name in payload["sets"]:
            row = _row(payload, key, set_name)
            if row is None:
                continue
            latency = row["latency"]
            cells |= {f"{set_name}: batch 1 median": f"{latency['batch1_median_ms']:.1f}",
                      f"{set_name}: batch 1 p90": f"{latency['batch1_p90_ms']:.1f}",
                      f"{set_name}: batch {int(latency['batch_size'])} median": f"{latency['batched_median_ms']:.1f}",
                      f"{set_name}: prompts whose spans differ batched": int(latency["batch_differs"])}
        lines.append(cells)
    return markdown_table(lines)


def _header(payload: Mapping[str, Any]) -> list[str]:
    meta, setting = payload["metadata"], payload["metadata"]["setting"]
    machine = meta["machine"]
    sets = "; ".join(f"{name}: {s['prompts']} prompts, {s['spans']} gold spans (`{s['file']}`)"
                     for name, s in payload["sets"].items())
    lines = ["# privlm bench detect", "",
             f"`{meta['command']}` at {str(meta['git_commit'])[:12]}, {meta['seconds'] / 60:.1f} min, "
             f"{meta['started_utc']}. Machine: {machine.get('processor')}, {meta['cores']} cores usable, torch on "
             f"{meta['torch_threads']} threads, device {setting['device']}.", "", f"Sets: {sets}.", ""]
    if setting.get("limit") is not None:
        lines += [f"**Quick run** (`--limit {setting['limit']}`): the first prompts of each set only; the verdicts "
                  "read only these.", ""]
    lines += [f"- {_label(payload, key)}: skipped, {why}" for key, why in payload["skipped_rows"].items()]
    return lines


def markdown(payload: Mapping[str, Any]) -> str:
    lines = _header(payload)
    lines += ["", "Recall: a gold span is caught when every letter and digit of it lies inside some detected span (of "
              "any kind: a redactor removes them all); typed: caught, and the detected span covering most of it has "
              "its kind. Left verbatim: none of its letters and digits covered; partly: some. Precision: a detected "
              "span is correct when it shares a letter or digit with some gold span; characters: of the letters and "
              "digits inside detected spans, the share inside gold spans (over-redaction counts). Cells: the share "
              "[95% Clopper-Pearson interval]; n: gold spans (recall) or detected spans (precision). Latency in ms per "
              "prompt, after the same warm-up for every row, each prompt and batch timed `passes` times (the setting) "
              "and its fastest kept; scores from the batch-1 pass.", "", "## Verdicts", ""]
    lines += [f"- {v['set']}: {v['claim']}: **{v['verdict']}** ({v['detail']})" for v in payload["verdicts"]]
    for set_name in payload["sets"]:
        lines += ["", f"## {set_name}", "", "### Recall", "", recall_table(payload, set_name),
                  "### Typed recall", "", recall_table(payload, set_name, "typed_recall"),
                  "### Left verbatim after redaction", "", leak_table(payload, set_name),
                  "### Precision (per detected kind)", "", precision_table(payload, set_name)]
    lines += ["", "## Latency (ms per prompt)", "", latency_table(payload), f"Plot: `{PLOT}`."]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------- plot
def plot(payload: Mapping[str, Any], path: Path) -> Path:
    """Recall per kind (and overall) per row with its interval, one panel per set."""
    sets = list(payload["sets"])
    widest = max((len(payload["sets"][s]["span_counts"]) for s in sets), default=1)
    fig = Figure(figsize=(max(8.0, 1.1 * (widest + 1)), 3.6 * max(len(sets), 1)))
    axes = fig.subplots(max(len(sets), 1), 1, squeeze=False)[:, 0]
    for ax, set_name in zip(axes, sets, strict=False):
        groups = ["overall", *payload["sets"][set_name]["span_counts"]]
        rows = _set_rows(payload, set_name)
        width = 0.8 / max(len(rows), 1)
        for i, r in enumerate(rows):
            measures = [r["overall"]["recall"], *(r["kinds"].get(k, {}).get("recall") for k in groups[1:])]
            rates = np.array([_rate(m) for m in measures])
            low = np.array([rate - m["low"] if m else 0.0 for rate, m in zip(rates, measures, strict=True)])
            high = np.array([m["high"] - rate if m else 0.0 for rate, m in zip(rates, measures, strict=True)])
            ax.bar(np.arange(len(groups)) + (i - (len(rows) - 1) / 2) * width, np.nan_to_num(rates), width,
                   yerr=np.nan_to_num(np.vstack([low, high])), capsize=2, label=_label(payload, r["row"]))
        goal = RECALL_GOALS.get(set_name)
        if goal is not None:
            ax.axhline(goal, linestyle="--", color="gray", linewidth=1)
        ax.set_xticks(np.arange(len(groups)), [f"{g}\n(n={payload['sets'][set_name]['span_counts'].get(g, '')})"
                                               if g != "overall" else "overall" for g in groups], fontsize=7)
        ax.set_ylim(0, 1.05)
        ax.set_ylabel("recall (95% CI)")
        ax.set_title(f"{set_name}: gold spans caught whole", fontsize=9)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=6.5, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    meta = payload["metadata"]
    fig.text(0.01, 0.003, f"{meta['command']} ({str(meta['git_commit'])[:12]})", fontsize=6, color="gray")
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    fig.savefig(path, dpi=130)
    return path


# --------------------------------------------------------------------------------------------- files
def write_detect_report(out_dir: Path, payload: Mapping[str, Any]) -> list[Path]:
    """results.json (the verdicts with it), then results.md and the plot from it."""
    out_dir.mkdir(parents=True, exist_ok=True)
    results = out_dir / "results.json"
    results.write_text(json.dumps(to_json(dict(payload) | {"verdicts": verdicts(payload)}), indent=2) + "\n")
    return [results, *render_detect_report(out_dir)]


def render_detect_report(out_dir: Path) -> list[Path]:
    """results.md and the plot from results.json alone."""
    payload: Any = from_json(json.loads((out_dir / "results.json").read_text()))
    payload["verdicts"] = verdicts(payload)
    markdown_path = out_dir / "results.md"
    markdown_path.write_text(markdown(payload))
    return [markdown_path, plot(payload, out_dir / PLOT)]
