"""The SnD paper's claims, checked against the rows of ``privlm bench snd`` (``results.json``).

Each check compares two methods at the same eta and task, on the test AUC of the probe and on the
cosine to the clean embedding. A difference smaller than ``TIE`` in AUC counts as a tie: with
1,000 test sentences the standard error of one AUC is about 0.01.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from privlm.eval.bench import load_results

TIE = 0.01
SND = "SnD, ablation budget"  # every ablation is trained at this budget; the shipped SnD is larger
SHIPPED = "SnD"


@dataclass(frozen=True)
class Comparison:
    task: str
    eta: float
    ours: str
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


def _index(rows: Sequence[dict[str, object]]) -> dict[tuple[str, str, float], dict[str, object]]:
    return {(str(r["task"]), str(r["method"]), float(r["eta"])): r for r in rows}  # type: ignore[arg-type]


def compare(rows: Sequence[dict[str, object]], ours: str, other: str) -> list[Comparison]:
    """``ours`` against ``other`` at every finite (task, eta) where both were measured."""
    index = _index(rows)
    out = []
    for (task, method, eta), row in index.items():
        twin = index.get((task, other, eta))
        if method != ours or twin is None or math.isinf(eta):
            continue
        out.append(Comparison(task, eta, ours, other, (float(row["auc"]), float(twin["auc"])),  # type: ignore[arg-type]
                              (float(row["cosine_to_clean"]), float(twin["cosine_to_clean"]))))  # type: ignore[arg-type]
    return sorted(out, key=lambda c: (c.task, c.eta))


def mean_relative_auc_gain(comparisons: Sequence[Comparison]) -> float:
    return sum(c.auc_gain / c.auc[1] for c in comparisons) / len(comparisons) if comparisons else math.nan


def _table(comparisons: Sequence[Comparison]) -> list[str]:
    lines = ["| task | eta | AUC, " + comparisons[0].ours + " | AUC, " + comparisons[0].other
             + " | difference | cosine, " + comparisons[0].ours + " | cosine, " + comparisons[0].other + " | verdict |",
             "|---|---|---|---|---|---|---|---|"]
    for c in comparisons:
        lines.append(f"| {c.task} | {c.eta:g} | {c.auc[0]:.3f} | {c.auc[1]:.3f} | {c.auc_gain:+.3f} | "
                     f"{c.cosine[0]:.3f} | {c.cosine[1]:.3f} | {c.verdict} |")
    return lines


def _section(title: str, rows: Sequence[dict[str, object]], ours: str, other: str, claim: str, *,
             ties_hold: bool = False, not_better_note: str = "") -> list[str]:
    comparisons = compare(rows, ours, other)
    if not comparisons:
        return [f"## {title}", "", f"Not measured: `{ours}` or `{other}` is missing from this run.", ""]
    verdicts = [c.verdict for c in comparisons]
    holds = all(v != "worse" for v in verdicts) and (ties_hold or "better" in verdicts)
    summary = (f"**{claim}: {'holds' if holds else 'does not hold'}** "
               f"({verdicts.count('better')} better, {verdicts.count('tie')} ties, {verdicts.count('worse')} worse "
               f"of {len(verdicts)}; mean relative AUC gain {mean_relative_auc_gain(comparisons):+.1%}).")
    lines = [f"## {title}", "", summary, "", *_table(comparisons), ""]
    not_better = [f"{c.task} at eta {c.eta:g}" for c in comparisons if c.verdict != "better"]
    if not_better_note and not_better:
        lines += [f"{not_better_note}: {', '.join(not_better)}.", ""]
    return lines


def pivot_table(rows: Sequence[dict[str, object]], task: str, metric: str) -> list[str]:
    """Methods x etas for one task and metric (the non-private reference in its own column)."""
    index = _index(rows)
    etas = sorted({e for (t, _, e) in index if t == task and not math.isinf(e)})
    methods = list(dict.fromkeys(m for (t, m, e) in index if t == task and not math.isinf(e)))
    clean = next((r for (t, m, e), r in index.items() if t == task and math.isinf(e)), None)
    lines = ["| method | " + " | ".join(f"eta {e:g}" for e in etas) + " | non-private |",
             "|---|" + "---|" * (len(etas) + 1)]
    reference = f"{float(clean[metric]):.3f}" if clean else "-"  # type: ignore[arg-type]
    for method in methods:
        cells = [f"{float(index[(task, method, e)][metric]):.3f}" if (task, method, e) in index else "-"  # type: ignore[arg-type]
                 for e in etas]
        lines.append(f"| {method} | {' | '.join(cells)} | {reference} |")
    return lines


def claims_report(rows: Sequence[dict[str, object]]) -> str:
    tasks = list(dict.fromkeys(str(r["task"]) for r in rows))
    tables: list[str] = []
    for task in tasks:
        for metric, label in (("auc", "test AUC"), ("cosine_to_clean", "cosine to the clean embedding"),
                              ("attack_success", "nearest-neighbour inversion of what the server receives")):
            tables += [f"### {task}: {label}", "", *pivot_table(rows, task, metric), ""]
    lines = ["# SnD: the paper's claims, checked", "", *tables,
             f"From `results.json`. Verdicts compare test AUC; |difference| < {TIE} is a tie. The denoiser "
             f"ablations are trained at one budget, so they are compared with `{SND}` (same budget); "
             f"`{SHIPPED}` is the longer-trained shipped denoiser.", ""]
    for baseline in ("TokEmbPriv", "Text2Text"):
        for ours in (SHIPPED, SND):
            comparisons = compare(rows, ours, baseline)
            for task in sorted({c.task for c in comparisons}):
                in_task = [c for c in comparisons if c.task == task]
                gain = mean_relative_auc_gain(in_task)
                lines.append(f"- {ours} vs {baseline} on {task}: mean relative AUC gain {gain:+.1%} over "
                             f"{len(in_task)} etas; the claim (>= +10%) {'holds' if gain >= 0.10 else 'fails'}.")
    lines.append("")
    for baseline in ("TokEmbPriv", "Text2Text"):
        lines += _section(f"SnD vs {baseline}", rows, SHIPPED, baseline, f"SnD beats {baseline}")
    lines += _section("User-side vs server-side denoiser", rows, SND, "server-side denoiser",
                      "the user-side denoiser beats the server-side one")
    lines += _section("Clipping", rows, SND, "SnD, no clip", "clipping helps")
    wasted = "The server's work is wasted (SnD no better than the local-only model) on"
    lines += _section("SnD vs the local-only model", rows, SND, "local-only model",
                      "the server's e_n adds to the user's own tokens", not_better_note=wasted)
    lines += _section("Shipped SnD vs the local-only model", rows, SHIPPED, "local-only model",
                      "the shipped SnD beats the local-only model", not_better_note=wasted)
    lines += _section("SnD without the e_n residual vs the local-only model", rows, "SnD, no e_n residual",
                      "local-only model", "SnD without the residual beats the local-only model",
                      not_better_note=wasted)
    lines += _section("The e_n residual", rows, SND, "SnD, no e_n residual", "the residual on e_n helps")
    lines += _section("SnD with a query readout vs the local-only model", rows, "SnD, query readout",
                      "local-only model", "SnD with e_n as an ordinary input row beats the local-only model",
                      not_better_note=wasted)
    lines += _section("One eta-conditioned denoiser vs one per eta group", rows, SND,
                      "SnD, one denoiser per eta group", "the eta-conditioned denoiser is at least as good",
                      ties_hold=True)
    return "\n".join(lines)


def write_claims(out_dir: Path) -> Path:
    path = out_dir / "claims.md"
    path.write_text(claims_report(load_results(out_dir)[1]))
    return path
