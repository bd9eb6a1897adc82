"""The SnD paper's claims, checked against the rows of ``privlm bench snd`` (``results.json``).

Each check compares two methods at the same eta and task, on the test AUC of the probe and on the
cosine to the clean embedding. A difference smaller than ``TIE`` in AUC counts as a tie: with
1,000 test sentences the standard error of one AUC is about 0.01.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from privlm_bench.harness.bench import Row, load_results
from privlm_bench.harness.embedding import TEXT2TEXT, TOKEMBPRIV
from privlm_bench.snd.sweep import (
    ABLATION_BUDGET,
    ETA_GROUPS,
    LOCAL_ONLY,
    METHODS,
    NO_CLIP,
    NO_RESIDUAL,
    QUERY_READOUT,
    SERVER_SIDE,
    SND,
)

TIE = 0.01
BUDGET = ABLATION_BUDGET.key  # every ablation is trained at this budget; the shipped SnD is larger
SHIPPED = SND.key


@dataclass(frozen=True)
class Comparison:
    task: str
    eta: float
    ours: str  # method keys
    other: str
    auc: tuple[float, float]
    cosine: tuple[float, float]

    @property
    def auc_gain(self) -> float:
        return self.auc[0] - self.auc[1]

    @property
    def verdict(self) -> str:
        if abs(self.auc_gain) < TIE:
            return "tie"
        return "better" if self.auc_gain > 0 else "worse"


def _number(row: Row, metric: str) -> float:
    value = row[metric]
    if not isinstance(value, int | float):
        raise ValueError(f"{metric} must be a number in every row, got {value!r}")
    return float(value)


def _index(rows: Sequence[Row]) -> dict[tuple[str, str, float], Row]:
    return {(str(r["task"]), str(r["method"]), _number(r, "eta")): r for r in rows}


def compare(rows: Sequence[Row], ours: str, other: str) -> list[Comparison]:
    """``ours`` against ``other`` at every finite (task, eta) where both were measured."""
    index = _index(rows)
    out = []
    for (task, method, eta), row in index.items():
        twin = index.get((task, other, eta))
        if method != ours or twin is None or math.isinf(eta):
            continue
        out.append(Comparison(task, eta, ours, other, (_number(row, "auc"), _number(twin, "auc")),
                              (_number(row, "cosine_to_clean"), _number(twin, "cosine_to_clean"))))
    return sorted(out, key=lambda c: (c.task, c.eta))


def mean_relative_auc_gain(comparisons: Sequence[Comparison]) -> float:
    return sum(c.auc_gain / c.auc[1] for c in comparisons) / len(comparisons) if comparisons else math.nan


def _table(comparisons: Sequence[Comparison], labels: Mapping[str, str]) -> list[str]:
    ours, other = labels[comparisons[0].ours], labels[comparisons[0].other]
    lines = ["| task | eta | AUC, " + ours + " | AUC, " + other
             + " | difference | cosine, " + ours + " | cosine, " + other + " | verdict |",
             "|---|---|---|---|---|---|---|---|"]
    for c in comparisons:
        lines.append(f"| {c.task} | {c.eta:g} | {c.auc[0]:.3f} | {c.auc[1]:.3f} | {c.auc_gain:+.3f} | "
                     f"{c.cosine[0]:.3f} | {c.cosine[1]:.3f} | {c.verdict} |")
    return lines


def _section(title: str, rows: Sequence[Row], labels: Mapping[str, str], ours: str, other: str, claim: str, *,
             ties_hold: bool = False, not_better_note: str = "") -> list[str]:
    comparisons = compare(rows, ours, other)
    if not comparisons:
        return [f"## {title}", "", f"Not measured: `{labels[ours]}` or `{labels[other]}` is missing from this run.",
                ""]
    verdicts = [c.verdict for c in comparisons]
    holds = all(v != "worse" for v in verdicts) and (ties_hold or "better" in verdicts)
    summary = (f"**{claim}: {'holds' if holds else 'does not hold'}** "
               f"({verdicts.count('better')} better, {verdicts.count('tie')} ties, {verdicts.count('worse')} worse "
               f"of {len(verdicts)}; mean relative AUC gain {mean_relative_auc_gain(comparisons):+.1%}).")
    lines = [f"## {title}", "", summary, "", *_table(comparisons, labels), ""]
    not_better = [f"{c.task} at eta {c.eta:g}" for c in comparisons if c.verdict != "better"]
    if not_better_note and not_better:
        lines += [f"{not_better_note}: {', '.join(not_better)}.", ""]
    return lines


def pivot_table(rows: Sequence[Row], labels: Mapping[str, str], task: str, metric: str) -> list[str]:
    """Methods x etas for one task and metric (the non-private reference in its own column)."""
    index = _index(rows)
    etas = sorted({e for (t, _, e) in index if t == task and not math.isinf(e)})
    methods = list(dict.fromkeys(m for (t, m, e) in index if t == task and not math.isinf(e)))
    clean = next((r for (t, m, e), r in index.items() if t == task and math.isinf(e)), None)
    lines = ["| method | " + " | ".join(f"eta {e:g}" for e in etas) + " | non-private |",
             "|---|" + "---|" * (len(etas) + 1)]
    reference = f"{_number(clean, metric):.3f}" if clean else "-"
    for method in methods:
        cells = [f"{_number(index[(task, method, e)], metric):.3f}" if (task, method, e) in index else "-"
                 for e in etas]
        lines.append(f"| {labels.get(method, method)} | {' | '.join(cells)} | {reference} |")
    return lines


def claims_report(rows: Sequence[Row], labels: Mapping[str, str] | None = None) -> str:
    """The claims, from rows keyed by method key; ``labels`` names methods (default: the sweep's labels)."""
    labels = {m.key: m.label for m in METHODS} | {"non-private": "non-private"} | dict(labels or {})
    tasks = list(dict.fromkeys(str(r["task"]) for r in rows))
    tables: list[str] = []
    for task in tasks:
        for metric, label in (("auc", "test AUC"), ("cosine_to_clean", "cosine to the clean embedding"),
                              ("attack_success", "nearest-neighbour inversion of what the server receives")):
            tables += [f"### {task}: {label}", "", *pivot_table(rows, labels, task, metric), ""]
    lines = ["# SnD: the paper's claims, checked", "", *tables,
             f"From `results.json`. Verdicts compare test AUC; |difference| < {TIE} is a tie. The denoiser "
             f"ablations are trained at one budget, so they are compared with `{labels[BUDGET]}` (same budget); "
             f"`{labels[SHIPPED]}` is the longer-trained shipped denoiser.", ""]
    for baseline in (TOKEMBPRIV.key, TEXT2TEXT.key):
        for ours in (SHIPPED, BUDGET):
            comparisons = compare(rows, ours, baseline)
            for task in sorted({c.task for c in comparisons}):
                in_task = [c for c in comparisons if c.task == task]
                gain = mean_relative_auc_gain(in_task)
                lines.append(f"- {labels[ours]} vs {labels[baseline]} on {task}: mean relative AUC gain {gain:+.1%} "
                             f"over {len(in_task)} etas; the claim (>= +10%) {'holds' if gain >= 0.10 else 'fails'}.")
    lines.append("")

    def section(title: str, ours: str, other: str, claim: str, **options: Any) -> list[str]:
        return _section(title, rows, labels, ours, other, claim, **options)

    for other in (TOKEMBPRIV, TEXT2TEXT):
        lines += section(f"SnD vs {other.label}", SHIPPED, other.key, f"SnD beats {other.label}")
    lines += section("User-side vs server-side denoiser", BUDGET, SERVER_SIDE.key,
                     "the user-side denoiser beats the server-side one")
    lines += section("Clipping", BUDGET, NO_CLIP.key, "clipping helps")
    wasted = "The server's work is wasted (SnD no better than the local-only model) on"
    lines += section("SnD vs the local-only model", BUDGET, LOCAL_ONLY.key,
                     "the server's e_n adds to the user's own tokens", not_better_note=wasted)
    lines += section("Shipped SnD vs the local-only model", SHIPPED, LOCAL_ONLY.key,
                     "the shipped SnD beats the local-only model", not_better_note=wasted)
    lines += section("SnD without the e_n residual vs the local-only model", NO_RESIDUAL.key, LOCAL_ONLY.key,
                     "SnD without the residual beats the local-only model", not_better_note=wasted)
    lines += section("The e_n residual", BUDGET, NO_RESIDUAL.key, "the residual on e_n helps")
    lines += section("SnD with a query readout vs the local-only model", QUERY_READOUT.key, LOCAL_ONLY.key,
                     "SnD with e_n as an ordinary input row beats the local-only model", not_better_note=wasted)
    lines += section("One eta-conditioned denoiser vs one per eta group", BUDGET, ETA_GROUPS.key,
                     "the eta-conditioned denoiser is at least as good", ties_hold=True)
    return "\n".join(lines)


def write_claims(out_dir: Path) -> Path:
    results = load_results(out_dir, known=METHODS)
    path = out_dir / "claims.md"
    path.write_text(claims_report(results.rows, results.labels))
    return path
