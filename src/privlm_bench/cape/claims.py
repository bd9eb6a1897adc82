"""The Cape paper's claims, checked against the rows of ``privlm bench cape`` (``results.json``), and its plots.

Claims, each with a verdict computed from the rows:

(a) Cape's trade-off dominates SANTEXT and InferDPT at equal KNN attack success (the paper's claim), and CUSTEXT+
    (a baseline the paper leaves out of it, and the strongest here);
(b) the contextual logits help (Cape vs Cape with lambda_L = 0);
(c) bucketing helps (Cape vs Cape without buckets).

Trade-offs are compared at matched attack success, because the mechanisms' epsilons are not on one
scale (and, within Cape, the ablations change what one epsilon buys). Each method's points
(attack success, utility) over its epsilons are sorted by attack success, ties averaged, and joined
by straight lines; both curves are read at ``GRID`` evenly spaced attack levels spanning the range where
they overlap. A difference counts only beyond its noise margin: 1.96 times the standard error of the
difference of two independent AUCs (Hanley and McNeil 1982, from the test set's class counts); for
Rouge-L and cosine a fixed ``TIE``. The margin is conservative: both AUCs are measured on the same test
texts, so their difference varies less than that of two independent AUCs. ``ours`` dominates where it
is never below the other by more than the margin and above it by more somewhere; curves whose attack
ranges do not overlap cannot be compared.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from privlm_bench.cape.sweep import ATTACK_METRIC, CAPE_INT8, METHODS
from privlm_bench.harness.bench import NON_PRIVATE, Row, load_results

GRID = 9
TIE = 0.01  # Rouge-L and cosine: differences below this are ties
Z = 1.96
UTILITIES = {"classifier_auc": "classifier AUC (MiniLM + logistic regression)",
             "zero_shot_auc": "zero-shot AUC (device model, Cape's prompt)",
             "rouge_l": "Rouge-L F1 to the original (words)", "cosine": "MiniLM cosine to the original"}
PRIVACY = {"knn_success_sensitive": "KNN top-10 attack success (tokens every mechanism perturbs)",
           "knn_success": "KNN top-10 attack success (each mechanism's own perturbed tokens)",
           "mti_success": "MTI (causal-LM stand-in) token accuracy",
           "retention": "retention ratio (mechanism's positions unchanged)", "nw_median": "N_w, median over tokens"}
_CLASS_COUNTS = {"classifier_auc": ("n_positive", "n_negative"),
                 "zero_shot_auc": ("zero_shot_n_positive", "zero_shot_n_negative")}


# --- reading the rows --------------------------------------------------------------------------
def _number(row: Row, metric: str) -> float:
    value = row.get(metric, math.nan)
    return float(value) if isinstance(value, int | float) else math.nan


def curve(rows: Sequence[Row], method: str, x: str, y: str) -> list[tuple[float, float, float]]:
    """(x, y, epsilon) of ``method``'s finite-epsilon rows where both metrics are numbers, by epsilon."""
    points = [(_number(r, x), _number(r, y), _number(r, "epsilon")) for r in rows if r["method"] == method]
    return sorted((p for p in points if math.isfinite(p[0]) and math.isfinite(p[1]) and math.isfinite(p[2])),
                  key=lambda p: p[2])


def _by_attack(points: Sequence[tuple[float, float, float]]) -> tuple[np.ndarray, np.ndarray]:
    """Attack levels ascending, utilities averaged over equal attack levels."""
    xs = sorted({p[0] for p in points})
    ys = [float(np.mean([p[1] for p in points if p[0] == x])) for x in xs]
    return np.asarray(xs), np.asarray(ys)


def auc_standard_error(auc: float, n_positive: float, n_negative: float) -> float:
    """Hanley and McNeil's standard error of an AUC estimated on n_positive and n_negative examples."""
    if not (math.isfinite(auc) and n_positive >= 1 and n_negative >= 1):
        return math.nan
    q1, q2 = auc / (2 - auc), 2 * auc**2 / (1 + auc)
    variance = (auc * (1 - auc) + (n_positive - 1) * (q1 - auc**2) + (n_negative - 1) * (q2 - auc**2))
    return math.sqrt(max(variance, 0.0) / (n_positive * n_negative))


def noise_margin(metric: str, values: tuple[float, float], rows: Sequence[Row]) -> float:
    """The difference of two values of ``metric`` that counts: Z * SE of the difference (AUCs), else TIE."""
    if metric not in _CLASS_COUNTS:
        return TIE
    positive, negative = (max((_number(r, c) for r in rows), default=math.nan) for c in _CLASS_COUNTS[metric])
    errors = [auc_standard_error(v, positive, negative) for v in values]
    margin = Z * math.sqrt(sum(e**2 for e in errors))
    return margin if math.isfinite(margin) else TIE


# --- comparisons -----------------------------------------------------------------------------
@dataclass(frozen=True)
class TradeOff:
    """Two curves read at common attack levels; ``verdict`` is holds / does not hold / not measurable."""

    ours: str
    other: str
    utility: str
    attack: str
    grid: tuple[float, ...]
    ours_utility: tuple[float, ...]
    other_utility: tuple[float, ...]
    margins: tuple[float, ...]
    ranges: tuple[tuple[float, float], tuple[float, float]]
    steps: tuple[float, float] = (math.nan, math.nan)  # widest gap between measured attack levels, per curve

    @property
    def differences(self) -> tuple[float, ...]:
        return tuple(a - b for a, b in zip(self.ours_utility, self.other_utility, strict=True))

    @property
    def better(self) -> int:
        return sum(d > m for d, m in zip(self.differences, self.margins, strict=True))

    @property
    def worse(self) -> int:
        return sum(d < -m for d, m in zip(self.differences, self.margins, strict=True))

    @property
    def verdict(self) -> str:
        if not self.grid:
            return "not measurable"
        return "holds" if self.worse == 0 and self.better > 0 else "does not hold"


def tradeoff(rows: Sequence[Row], ours: str, other: str, *, utility: str = "classifier_auc",
             attack: str = ATTACK_METRIC, grid: int = GRID) -> TradeOff:
    """``ours`` against ``other``: utility at equal ``attack`` over the attack range both curves cover."""
    a, b = curve(rows, ours, attack, utility), curve(rows, other, attack, utility)
    ranges = tuple((min(p[0] for p in c), max(p[0] for p in c)) if c else (math.nan, math.nan) for c in (a, b))
    low, high = max(ranges[0][0], ranges[1][0]), min(ranges[0][1], ranges[1][1])
    if not (a and b) or not low <= high:
        return TradeOff(ours, other, utility, attack, (), (), (), (), (ranges[0], ranges[1]))
    levels = np.linspace(low, high, grid if high > low else 1)
    ours_u, other_u = (np.interp(levels, *_by_attack(c)) for c in (a, b))
    margins = tuple(noise_margin(utility, (float(u), float(v)), rows) for u, v in zip(ours_u, other_u, strict=True))
    steps = tuple(float(np.diff(_by_attack(c)[0]).max(initial=0.0)) for c in (a, b))
    return TradeOff(ours, other, utility, attack, tuple(levels.tolist()), tuple(ours_u.tolist()),
                    tuple(other_u.tolist()), margins, (ranges[0], ranges[1]), (steps[0], steps[1]))


@dataclass(frozen=True)
class LevelComparison:
    """Two methods at the same epsilon: utility, attack success and retention of each."""

    epsilon: float
    utility: tuple[float, float]
    attack: tuple[float, float]
    retention: tuple[float, float]


def at_equal_epsilon(rows: Sequence[Row], ours: str, other: str, *, utility: str = "classifier_auc",
                     attack: str = ATTACK_METRIC) -> list[LevelComparison]:
    index = {(str(r["method"]), _number(r, "epsilon")): r for r in rows}
    out = []
    for (method, eps), row in sorted(index.items(), key=lambda item: item[0][1]):
        twin = index.get((other, eps))
        if method != ours or twin is None or not math.isfinite(eps):
            continue
        out.append(LevelComparison(eps, (_number(row, utility), _number(twin, utility)),
                                   (_number(row, attack), _number(twin, attack)),
                                   (_number(row, "retention"), _number(twin, "retention"))))
    return out


# --- the report ------------------------------------------------------------------------------
def _f(value: float) -> str:
    return "n/a" if not math.isfinite(value) else f"{value:.3f}"


def pivot(rows: Sequence[Row], labels: Mapping[str, str], metric: str) -> list[str]:
    """Methods x epsilons for one metric, the non-private reference in its own column."""
    epsilons = sorted({_number(r, "epsilon") for r in rows if math.isfinite(_number(r, "epsilon"))})
    methods = list(dict.fromkeys(str(r["method"]) for r in rows if r["method"] != NON_PRIVATE.key))
    index = {(str(r["method"]), _number(r, "epsilon")): r for r in rows}
    clean = next((r for r in rows if r["method"] == NON_PRIVATE.key), None)
    lines = ["| method | " + " | ".join(f"eps {e:g}" for e in epsilons) + " | non-private |",
             "|---|" + "---|" * (len(epsilons) + 1)]
    for method in methods:
        cells = [_f(_number(index[(method, e)], metric)) if (method, e) in index else "-" for e in epsilons]
        lines.append(f"| {labels.get(method, method)} | {' | '.join(cells)} | "
                     f"{_f(_number(clean, metric)) if clean else '-'} |")
    return lines


def verdict_counts(t: TradeOff, levels: str) -> str:
    """"**verdict** at n ``levels`` in [a, b] (.. better, .. worse, .. within the margin; mean difference d" (the
    caller closes the bracket): a trade-off's verdict and what it rests on, one sentence for every report."""
    return (f"**{t.verdict}** at {len(t.grid)} {levels} in [{t.grid[0]:.3f}, {t.grid[-1]:.3f}] ({t.better} better, "
            f"{t.worse} worse, {len(t.grid) - t.better - t.worse} within the margin; mean difference "
            f"{float(np.mean(t.differences)):+.3f}")


def _tradeoff_lines(t: TradeOff, labels: Mapping[str, str]) -> list[str]:
    ours, other = labels.get(t.ours, t.ours), labels.get(t.other, t.other)
    (a_low, a_high), (b_low, b_high) = t.ranges
    if not t.grid:
        return [f"- {ours} vs {other} on {t.utility}: **not measurable**: attack success spans "
                f"[{_f(a_low)}, {_f(a_high)}] for {ours} and [{_f(b_low)}, {_f(b_high)}] for {other}; no common level."]
    lines = [f"- {ours} vs {other} on {t.utility}: {verdict_counts(t, 'attack levels')}). "
             f"{ours} spans [{_f(a_low)}, {_f(a_high)}], "
             f"{other} [{_f(b_low)}, {_f(b_high)}]; the widest step between measured attack levels, read by "
             f"straight lines, is {_f(t.steps[0])} for {ours} and {_f(t.steps[1])} for {other}.", "",
             f"  | {t.attack} | {ours} | {other} | difference | margin |", "  |---|---|---|---|---|"]
    for level, u, v, m in zip(t.grid, t.ours_utility, t.other_utility, t.margins, strict=True):
        lines.append(f"  | {level:.3f} | {u:.3f} | {v:.3f} | {u - v:+.3f} | {m:.3f} |")
    return [*lines, ""]


def _equal_epsilon_lines(comparisons: Sequence[LevelComparison], labels: Mapping[str, str], ours: str,
                         other: str) -> list[str]:
    if not comparisons:
        return []
    a, b = labels.get(ours, ours), labels.get(other, other)
    lines = [f"  At equal epsilon ({a} vs {b}):", "",
             f"  | epsilon | AUC, {a} | AUC, {b} | KNN, {a} | KNN, {b} | retention, {a} | retention, {b} |",
             "  |---|---|---|---|---|---|---|"]
    for c in comparisons:
        lines.append(f"  | {c.epsilon:g} | {_f(c.utility[0])} | {_f(c.utility[1])} | {_f(c.attack[0])} | "
                     f"{_f(c.attack[1])} | {_f(c.retention[0])} | {_f(c.retention[1])} |")
    return [*lines, ""]


def _reason(t: TradeOff, comparisons: Sequence[LevelComparison], labels: Mapping[str, str]) -> str:
    """What the numbers point to when a claim does not hold."""
    ours, other = labels.get(t.ours, t.ours), labels.get(t.other, t.other)
    parts = []
    if not t.grid:
        parts.append(f"the curves share no attack level: {ours} and {other} never reach the same KNN success at the "
                     "epsilons swept, so neither can be said to dominate on this data")
    if t.grid and t.worse:
        where = [f"{g:.3f}" for g, d, m in zip(t.grid, t.differences, t.margins, strict=True) if d < -m]
        parts.append(f"{ours} has the lower utility at attack success {', '.join(where)}")
    elif t.grid and not t.better:
        parts.append(f"no difference exceeds the noise margin (largest |difference| "
                     f"{max(abs(d) for d in t.differences):.3f}, margins {min(t.margins):.3f} to {max(t.margins):.3f})")
    if comparisons:
        du, da, dr = (float(np.nanmean([pair[0] - pair[1] for pair in pairs])) for pairs in (
            [c.utility for c in comparisons], [c.attack for c in comparisons], [c.retention for c in comparisons]))
        parts.append(f"at equal epsilon {ours} has {_more(du)} utility ({du:+.3f} on average), {_more(da)} KNN "
                     f"success ({da:+.3f}) and {_more(dr)} retention ({dr:+.3f}) than {other}")
    return "Why: " + "; ".join(parts) + "."


def _more(difference: float) -> str:
    return "higher" if difference > 0 else "lower" if difference < 0 else "equal"


def claim_section(rows: Sequence[Row], labels: Mapping[str, str], title: str, claim: str, ours: str,
                  others: Sequence[str], *, equal_epsilon: bool = False) -> list[str]:
    present = {str(r["method"]) for r in rows}
    lines = [f"## {title}", ""]
    measured = [o for o in others if o in present]
    if ours not in present or not measured:
        missing = [labels.get(m, m) for m in (ours, *others) if m not in present]
        return [*lines, f"**{claim}: not measured**: {', '.join(missing)} missing from this run.", ""]
    results = [tradeoff(rows, ours, other) for other in measured]
    holds = all(t.verdict == "holds" for t in results) and len(measured) == len(others)
    verdict = "holds" if holds else "does not hold" if any(t.verdict == "does not hold" for t in results) else \
        "not measurable" if all(t.verdict == "not measurable" for t in results) else "partly measured"
    lines += [f"**{claim}: {verdict}** (classifier AUC at matched KNN attack success).", ""]
    for t in results:
        comparisons = at_equal_epsilon(rows, ours, t.other)
        lines += _tradeoff_lines(t, labels)
        if equal_epsilon:
            lines += _equal_epsilon_lines(comparisons, labels, ours, t.other)
        if t.verdict != "holds":
            lines += [_reason(t, comparisons, labels), ""]
    secondary = [f"{u}: " + ", ".join(f"vs {labels.get(o, o)} {tradeoff(rows, ours, o, utility=u).verdict}"
                                      for o in measured) for u in ("zero_shot_auc", "rouge_l", "cosine")]
    lines += ["Other utilities at matched KNN success (secondary): " + "; ".join(secondary) + ".", ""]
    return lines


def zero_shot_range(rows: Sequence[Row]) -> list[str]:
    clean = next((r for r in rows if r["method"] == NON_PRIVATE.key), None)
    if clean is None or not math.isfinite(_number(clean, "zero_shot_auc")):
        return ["## Zero-shot range", "", "Not measured in this run.", ""]
    auc = _number(clean, "zero_shot_auc")
    se = auc_standard_error(auc, _number(clean, "zero_shot_n_positive"), _number(clean, "zero_shot_n_negative"))
    lines = ["## How much range the zero-shot measure has", "",
             f"The device model's zero-shot AUC on the clean texts is {auc:.3f} (standard error {se:.3f}); 0.5 is no "
             f"signal, so the measure's whole range is {auc - 0.5:+.3f}."]
    if se > 0:
        lines[-1] += (f" That is {(auc - 0.5) / se:.1f} standard errors: a perturbed text's zero-shot AUC can be told "
                      "from the clean one, or from chance, only by differences larger than about "
                      f"{Z * se * math.sqrt(2):.3f}. Read the zero-shot results as coarse.")
    return [*lines, ""]


def int8_section(rows: Sequence[Row], labels: Mapping[str, str]) -> list[str]:
    comparisons = [c for c in at_equal_epsilon(rows, CAPE_INT8.key, "cape")]
    if not comparisons:
        return []
    index = {(str(r["method"]), _number(r, "epsilon")): r for r in rows}
    lines = ["## int8 device model: effect on utility", "",
             "| epsilon | classifier AUC, int8 | fp32 | zero-shot AUC, int8 | fp32 | KNN, int8 | fp32 |",
             "|---|---|---|---|---|---|---|"]
    for c in comparisons:
        q, f = index[(CAPE_INT8.key, c.epsilon)], index[("cape", c.epsilon)]
        lines.append(f"| {c.epsilon:g} | {_f(_number(q, 'classifier_auc'))} | {_f(_number(f, 'classifier_auc'))} | "
                     f"{_f(_number(q, 'zero_shot_auc'))} | {_f(_number(f, 'zero_shot_auc'))} | "
                     f"{_f(_number(q, 'knn_success'))} | {_f(_number(f, 'knn_success'))} |")
    gaps = [c.utility[0] - c.utility[1] for c in comparisons]
    margins = [noise_margin("classifier_auc", c.utility, rows) for c in comparisons]
    within = all(abs(g) <= m for g, m in zip(gaps, margins, strict=True))
    lines += ["", f"Classifier AUC, int8 minus fp32: {', '.join(f'{g:+.3f}' for g in gaps)} "
                  f"({'all within' if within else 'not all within'} the noise margin "
                  f"{', '.join(f'{m:.3f}' for m in margins)}). The speed-up is in speed.md.", ""]
    return lines


def claims_report(rows: Sequence[Row], labels: Mapping[str, str], meta: Mapping[str, object]) -> str:
    labels = {m.key: m.label for m in METHODS} | {NON_PRIVATE.key: NON_PRIVATE.label} | dict(labels)
    lines = ["# Cape: the paper's claims, checked", "",
             f"From `results.json` (command `{meta.get('command')}`, seed {meta.get('seed')}, commit "
             f"`{meta.get('git_commit')}`). Verdicts are computed from the rows; see the method in "
             "`privlm_bench.cape.claims`: utilities are compared at matched KNN attack success, read off "
             "straight lines between each method's epsilons, and a difference counts only beyond "
             f"{Z} standard errors of the difference of two independent AUCs (conservative: both are measured on "
             f"the same test texts; Rouge-L and cosine: {TIE}).", ""]
    lines += claim_section(rows, labels, "(a) Cape vs SANTEXT, InferDPT and CUSTEXT+",
                           "Cape's trade-off dominates SANTEXT, InferDPT and CUSTEXT+ at equal KNN attack success "
                           "(the paper compares SANTEXT and InferDPT only)", "cape",
                           ["santext", "inferdpt", "custext-plus"])
    lines += claim_section(rows, labels, "(b) The contextual logits", "the contextual logits help (lambda_L > 0)",
                           "cape", ["cape-distance"], equal_epsilon=True)
    lines += claim_section(rows, labels, "(c) Bucketing", "bucketing helps", "cape", ["cape-unbucketed"],
                           equal_epsilon=True)
    lines += zero_shot_range(rows) + int8_section(rows, labels)
    lines += ["## Tables", ""]
    for metric, title in {**UTILITIES, **PRIVACY, "unchanged_share": "share of all tokens unchanged",
                          "eps_privlm_per_prompt": "privlm's per-prompt total (each mechanism's unit)",
                          "perturb_seconds": "seconds to perturb the test texts"}.items():
        lines += [f"### {title} (`{metric}`)", "", *pivot(rows, labels, metric), ""]
    return "\n".join(lines)


# --- plots -----------------------------------------------------------------------------------
def _caption(meta: Mapping[str, object]) -> str:
    return f"{meta.get('command')}  (seed {meta.get('seed')}, {str(meta.get('git_commit'))[:12]})"


def _grid_plot(rows: Sequence[Row], labels: Mapping[str, str], meta: Mapping[str, object], metrics: Mapping[str, str],
               *, x: str | None, path: Path, title: str) -> Path:
    """One panel per metric: against ``x`` (attack success), or against epsilon when ``x`` is None."""
    fig = Figure(figsize=(11, 8.5))
    axes = fig.subplots(2, 2).flatten()
    methods = list(dict.fromkeys(str(r["method"]) for r in rows if r["method"] != NON_PRIVATE.key))
    clean = next((r for r in rows if r["method"] == NON_PRIVATE.key), None)
    for ax, (metric, name) in zip(axes, metrics.items(), strict=False):
        for method in methods:
            points = curve(rows, method, x or "epsilon", metric)
            if points:
                xs, ys, _ = zip(*points, strict=True)
                ax.plot(xs, ys, marker="o", markersize=3.5, label=labels.get(method, method))
        if clean is not None and math.isfinite(_number(clean, metric)):
            if x is None:
                ax.axhline(_number(clean, metric), color="black", linestyle="--", linewidth=1, label="non-private")
            else:
                ax.scatter([_number(clean, x)], [_number(clean, metric)], marker="*", s=150, color="black", zorder=5,
                           label="non-private")
        if metric.endswith("auc"):
            ax.axhline(0.5, color="gray", linestyle=":", linewidth=1)
        ax.set_xlabel("epsilon (each mechanism's own)" if x is None else PRIVACY.get(x, x) + " (lower: more private)")
        if x is None:
            ax.set_xscale("log")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7, loc="best")
    fig.suptitle(title)
    fig.text(0.01, 0.005, _caption(meta), fontsize=6, color="gray")
    fig.tight_layout(rect=(0, 0.02, 1, 0.97))
    fig.savefig(path, dpi=130)
    return path


def write_plots(out_dir: Path, rows: Sequence[Row], labels: Mapping[str, str], meta: Mapping[str, object]
                ) -> list[Path]:
    return [
        _grid_plot(rows, labels, meta, UTILITIES, x=ATTACK_METRIC, path=out_dir / "utility_vs_attack.png",
                   title="Cape benchmark: utility against KNN attack success"),
        _grid_plot(rows, labels, meta, UTILITIES, x=None, path=out_dir / "utility_vs_epsilon.png",
                   title="Cape benchmark: utility against epsilon"),
        _grid_plot(rows, labels, meta, PRIVACY, x=None, path=out_dir / "privacy_vs_epsilon.png",
                   title="Cape benchmark: attacks, retention and N_w against epsilon"),
    ]


def write_reports(out_dir: Path) -> list[Path]:
    """claims.md, the plots, and speed.md when speed.json is there: all from the JSON files alone."""
    results = load_results(out_dir, known=METHODS)
    labels = {m.key: m.label for m in METHODS} | results.labels
    claims = out_dir / "claims.md"
    claims.write_text(claims_report(results.rows, labels, results.meta) + "\n")
    files = [claims, *write_plots(out_dir, results.rows, labels, results.meta)]
    if (out_dir / "speed.json").exists():
        from privlm_bench.cape.speed import render_speed

        files.append(render_speed(out_dir))
    return files

