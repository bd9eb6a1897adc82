"""The report of ``privlm bench chat-quality``: results.md, verdicts and plots, all from results.json alone.

Verdicts, each computed from the rows:

(1) The bar (issue 24): a differentially private point lets at most 5% of the personal spans through verbatim (the
    95% Clopper-Pearson upper bound of its share),
    and its answers are as close to the original's as the placeholder control's (not below it by more than the
    noise margin). The control's detector is an oracle here: a real redactor (Presidio) misses spans and leaks them.
(2) cape-public against Cape, CUSTEXT+ and DP-Prompt: answer similarity, and tweets AUC, at matched attack success
    (LM reconstruction top-1 on the personal-span tokens, KNN top-10, and the share of spans sent verbatim; DP-Prompt,
    which rewrites the prompt, on the last only), read as ``privlm bench cape`` reads its claims
    (:func:`privlm_bench.cape.claims.tradeoff`: straight lines between measured points, compared at common attack
    levels). The margin of a similarity difference is 1.96 times the root sum of squares of the two points'
    standard errors (the largest of each curve); for AUC, Hanley and McNeil's.
(3) cape-public's spend (and cape-public-fast's): every request's reported spend is exactly (perturbed tokens) x
    epsilon.
(4) The extraction: whether InferDPT's extraction (the gateway's ``--extract``, run by the bench with the same
    call) moves answers closer to the original's, per mechanism.
(5) cape-public-fast (two rounds, two forward passes) against cape-public (one decode step per perturbed token):
    what the speed costs in answer similarity at matched attack success, read as (2).
(6) Restore: the gateway's ``--restore`` against the same upstream answer unrestored, per point and at the best
    private point: the mean per-prompt difference in answer similarity, and its margin, Z times the standard error
    of the per-prompt differences (paired: both sides are one upstream answer, so its noise cancels; the unpaired
    margin of two points, :func:`_pair_margin`, would count it twice over).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.figure import Figure

from privlm.attacks import AttackResult
from privlm.models.text_mechanisms import text_mechanism
from privlm_bench.cape.claims import TradeOff, Z, tradeoff, verdict_counts
from privlm_bench.harness.json_values import from_json, to_json
from privlm_bench.harness.report import markdown_table

Row = dict[str, Any]
OURS = "cape-public"
RIVALS = ("cape", "custext-plus", "dp-prompt")
FAST = "cape-public-fast"  # compared with OURS in verdict (5)
EXACT_SPEND = (OURS, FAST)  # verdict (3)
ATTACK = "lm_top1"
ORIGINAL, PLACEHOLDERS = "original", "placeholders"
GOAL = 0.05


def _n(row: Row | None, key: str) -> float:
    value = None if row is None else row.get(key)
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else math.nan


def _f(value: float, digits: int = 3) -> str:
    return "n/a" if not math.isfinite(value) else f"{value:.{digits}f}"


def label(method: str) -> str:
    if method == ORIGINAL:
        return "original prompt (no privacy)"
    if method == PLACEHOLDERS:
        return "placeholders for the marked spans (no DP, oracle detector)"
    try:
        return text_mechanism(method).label
    except ValueError:
        return method


def _row(rows: Sequence[Row], method: str) -> Row | None:
    return next((r for r in rows if r["method"] == method), None)


def _private(rows: Sequence[Row]) -> list[Row]:
    return [r for r in rows if r["method"] not in (ORIGINAL, PLACEHOLDERS)]


# --------------------------------------------------------------------------------------------- verdicts
AXES = {ATTACK: "LM reconstruction top-1", "span_verbatim": "spans verbatim", "knn_success": "KNN top-10"}
UTILITIES = {"answer_similarity": "answer similarity", "classifier_auc": "tweets AUC"}


def similarity_margin(rows: Sequence[Row], a: str, b: str) -> float:
    """Z times the root sum of squares of each curve's largest standard error (NaN: not measurable)."""
    errors = [max((_n(r, "answer_similarity_se") for r in rows if r["method"] == m), default=math.nan)
              for m in (a, b)]
    return Z * math.sqrt(sum(e**2 for e in errors))


def matched(rows: Sequence[Row], ours: str, other: str, utility: str, attack: str = ATTACK) -> TradeOff:
    """``ours`` against ``other`` at equal ``attack`` success (AUC margins: Hanley and McNeil's, from
    :func:`~privlm_bench.cape.claims.tradeoff`; similarity margins: :func:`similarity_margin`)."""
    result = tradeoff(list(rows), ours, other, utility=utility, attack=attack)
    if utility == "answer_similarity" and result.grid:
        margin = similarity_margin(rows, ours, other)
        if not math.isfinite(margin):
            return dataclasses.replace(result, grid=(), ours_utility=(), other_utility=(), margins=())
        result = dataclasses.replace(result, margins=tuple(margin for _ in result.grid))
    return result


def verbatim_upper(row: Row) -> float:
    """The 95% Clopper-Pearson upper bound of the share of spans sent verbatim."""
    spans = int(_n(row, "spans")) if math.isfinite(_n(row, "spans")) else 0
    if spans < 1:
        return math.nan
    return AttackResult(name="verbatim", successes=round(_n(row, "span_verbatim") * spans), trials=spans).ci_high


def bar_verdict(rows: Sequence[Row]) -> tuple[str, list[str]]:
    """Some DP point whose verbatim share is at most GOAL (its upper confidence bound) and whose answers are within
    the margin of the placeholder control's."""
    control = _row(rows, PLACEHOLDERS)
    if control is None:
        return "not measured", ["the placeholder control is missing from this run"]
    lines, passing = [], []
    for r in _private(rows):
        margin, close = _pair_margin(r, control), _within_noise(r, control)
        upper = verbatim_upper(r)
        private = upper <= GOAL
        if private and close:
            passing.append(r)
        lines.append(f"{label(r['method'])} at epsilon {r['epsilon']:g} (spend {_f(_n(r, 'spend_per_prompt'), 1)} per "
                     f"prompt): {_f(_n(r, 'span_verbatim'))} of spans verbatim (upper bound {_f(upper)}: "
                     f"{'within' if private else 'over'} {GOAL:.0%}); answer similarity "
                     f"{_f(_n(r, 'answer_similarity'))} against the control's {_f(_n(control, 'answer_similarity'))}"
                     f" (margin {_f(margin)}): {'as close' if close else 'further'}")
    return ("holds" if passing else "does not hold"), lines


def _any_pair(row: Row) -> bool:
    """Whether the row's mechanism bounds every pair of sensitive tokens (its epsilons compare with the others')."""
    try:
        return text_mechanism(str(row.get("mechanism", row["method"]))).any_pair
    except ValueError:
        return False


def _under_bar(rows: Sequence[Row]) -> list[Row]:
    return [r for r in _private(rows) if verbatim_upper(r) <= GOAL and math.isfinite(_n(r, "answer_similarity"))]


def _pair_margin(row: Row, reference: Row) -> float:
    """The noise margin of two points' answer similarities: Z times the root sum of squares of their errors."""
    return Z * math.hypot(_n(row, "answer_similarity_se"), _n(reference, "answer_similarity_se"))


def _within_noise(row: Row, reference: Row) -> bool:
    """Whether ``row`` answers no worse than ``reference`` beyond their noise margin."""
    return _n(row, "answer_similarity") >= _n(reference, "answer_similarity") - _pair_margin(row, reference)


def best_private(rows: Sequence[Row]) -> Row | None:
    """The point the demo's chat step uses. Among the DP points under the bar (spans-verbatim upper bound at most
    GOAL) whose epsilon bounds every pair of sensitive tokens (``any_pair``: CUSTEXT's holds only within an output
    group, so its epsilons are not the same guarantee), take the closest answers; then, of the points whose answer
    similarity is within the noise margin of it (1.96 times the root sum of squares of the two standard errors), the
    one with the least spend per prompt: answers this run cannot tell apart, at the least epsilon."""
    comparable = [r for r in _under_bar(rows) if _any_pair(r)]
    best = max(comparable, key=lambda r: _n(r, "answer_similarity"), default=None)
    if best is None:
        return None
    tied = [r for r in comparable if _within_noise(r, best)]
    return min(tied, key=lambda r: (_n(r, "spend_per_prompt"), -_n(r, "answer_similarity")))


def _axes(method: str) -> list[str]:
    """The attack axes on which ``method`` is measured like for like (DP-Prompt's paraphrase: spans verbatim only;
    its LM top-1 is a different measure, and KNN does not apply)."""
    try:
        rewrites = text_mechanism(method).rewrites
    except ValueError:
        rewrites = False
    return ["span_verbatim"] if rewrites else [ATTACK, "knn_success", "span_verbatim"]


def comparison_lines(rows: Sequence[Row], ours: str = OURS, rivals: Sequence[str] = RIVALS) -> list[str]:
    present = {str(r["method"]) for r in rows}
    if ours not in present:
        return [f"**not measured**: {label(ours)} is missing from this run."]
    lines = [f"- {label(ours)} vs {label(o)}: **not measured**: missing from this run." for o in rivals
             if o not in present]
    for other in (o for o in rivals if o in present):
        for attack in _axes(other):
            for utility, name in UTILITIES.items():
                t = matched(rows, ours, other, utility, attack)
                (a_low, a_high), (b_low, b_high) = t.ranges
                head = f"- {label(ours)} vs {label(other)}, {name} at matched {AXES[attack]}"
                if not t.grid:
                    lines.append(f"{head}: **not measurable**: {AXES[attack]} spans [{_f(a_low)}, {_f(a_high)}] and "
                                 f"[{_f(b_low)}, {_f(b_high)}] (no common level, or no margin).")
                    continue
                lines.append(f"{head}: {verdict_counts(t, 'levels')}, margin {_f(float(np.mean(t.margins)))}).")
    return lines


def fast_cost_line(rows: Sequence[Row]) -> str:
    """Verdict (5) in a sentence: at how many matched levels the rounds' answers are worse beyond the margin."""
    if not {OURS, FAST} <= {str(r["method"]) for r in rows}:
        return "What the rounds cost: not measured."
    compared = [matched(rows, FAST, OURS, "answer_similarity", attack) for attack in _axes(OURS)]
    levels = sum(len(t.grid) for t in compared)
    worse, better = sum(t.worse for t in compared), sum(t.better for t in compared)
    if not levels:
        return "What the rounds cost: not measurable (no common attack level)."
    return (f"What the rounds cost in answer similarity: worse beyond the margin at {worse} of {levels} matched "
            f"levels, better at {better}" + (": no cost this run can show." if not worse else "."))


def _best_lines(rows: Sequence[Row]) -> list[str]:
    best = best_private(rows)
    if best is None:
        return ["The best private point: none whose epsilon bounds every pair of tokens keeps spans verbatim under "
                "the bar.", ""]
    lines = [f"The best private point (under the bar, among the mechanisms whose epsilon bounds every pair of "
             f"sensitive tokens, the least epsilon per prompt among the answers within the noise margin of the "
             f"closest): **{label(best['method'])} at epsilon {best['epsilon']:g}**, answer similarity "
             f"{_f(_n(best, 'answer_similarity'))}, spend {_f(_n(best, 'spend_per_prompt'), 1)} per prompt."]
    narrower = [r for r in _under_bar(rows) if not _any_pair(r) and _within_noise(r, best)
                and _n(r, "answer_similarity") > _n(best, "answer_similarity")]
    lines += [f"{label(r['method'])} at epsilon {r['epsilon']:g} answers at {_f(_n(r, 'answer_similarity'))} for "
              f"{_f(_n(r, 'spend_per_prompt'), 1)} per prompt, but its guarantee is narrower (not every pair of "
              "tokens: docs/guarantees.md), so its spend is not compared." for r in narrower]
    return [" ".join(lines), ""]


def restore_gain(row: Row) -> tuple[float, float]:
    """Restore's change in answer similarity at one point, and its paired noise margin (NaN: not measured)."""
    return _n(row, "restored_similarity") - _n(row, "answer_similarity"), Z * _n(row, "restore_gain_se")


def _gain_words(gain: float, margin: float) -> str:
    beyond = math.isfinite(margin) and abs(gain) > margin
    return f"{gain:+.3f} (margin {_f(margin)}: {'beyond' if beyond else 'within'} the margin)"


def restore_lines(rows: Sequence[Row]) -> list[str]:
    """Verdict (6): at the best private point in a sentence, then every private point."""
    measured = [r for r in _private(rows) if all(math.isfinite(x) for x in restore_gain(r))]
    if not measured:
        return ["**(6) Restore (--restore), change in answer similarity:** not measured."]
    best = best_private(rows)
    head = ("no best private point this run" if best is None or best not in measured else
            f"at the best private point ({label(best['method'])} eps {best['epsilon']:g}) "
            f"{_gain_words(*restore_gain(best))}, {_f(_n(best, 'restored'), 1)} replacements restored per prompt "
            f"(answer similarity {_f(_n(best, 'answer_similarity'))}, restored {_f(_n(best, 'restored_similarity'))})")
    each = "; ".join(f"{label(r['method'])} eps {r['epsilon']:g}: {_gain_words(*restore_gain(r))}, "
                     f"{_f(_n(r, 'restored'), 1)} restored" for r in measured)
    return [f"**(6) Restore (--restore), change in answer similarity** (restored answer minus the same upstream "
            f"answer, per prompt; margin {Z} times the paired standard error): {head}. Per point: {each}."]


def spend_verdict(rows: Sequence[Row]) -> str:
    ours = [r for r in rows if r["method"] in EXACT_SPEND]
    if not ours:
        return "not measured"
    return "holds" if all(r.get("spend_is_perturbed_times_epsilon") is True for r in ours) else "does not hold"


def extraction_lines(rows: Sequence[Row]) -> list[str]:
    lines = []
    for r in [*_private(rows), *[x for x in rows if x["method"] == PLACEHOLDERS]]:
        gain = _n(r, "extracted_similarity") - _n(r, "answer_similarity")
        if math.isfinite(gain):
            level = "" if r["method"] == PLACEHOLDERS else f" eps {r['epsilon']:g}"
            lines.append(f"{label(r['method'])}{level}: {gain:+.3f}")
    return lines


# --------------------------------------------------------------------------------------------- tables
COLUMNS = (("spend_per_prompt", "spend / prompt", 1), ("span_verbatim", "spans verbatim", 3),
           ("prompts_leaking", "prompts leaking", 3), ("lm_top1", "LM top-1", 3),
           ("lm_top1_ci_high", "its 95% upper", 3), ("lm_top10", "LM top-10", 3),
           ("knn_success", "KNN top-10", 3), ("answer_similarity", "answer sim.", 3),
           ("answer_similarity_se", "± se", 3), ("restored_similarity", "restored sim.", 3),
           ("restored", "restored / prompt", 1), ("extracted_similarity", "extracted sim.", 3),
           ("released_perplexity", "perplexity", 1), ("classifier_auc", "tweets AUC", 3))


def table(rows: Sequence[Row]) -> str:
    lines = []
    for r in rows:
        eps = r.get("epsilon")
        cells: dict[str, object] = {"method": label(str(r["method"])),
                                    "epsilon": "-" if not isinstance(eps, int | float) or not math.isfinite(eps)
                                    else f"{eps:g}"}
        trials = int(_n(r, "lm_trials")) if math.isfinite(_n(r, "lm_trials")) else 0
        upper = (AttackResult(name="lm", successes=round(_n(r, ATTACK) * trials), trials=trials).ci_high
                 if trials and math.isfinite(_n(r, ATTACK)) else math.nan)
        cells |= {name: _f(upper if key == "lm_top1_ci_high" else _n(r, key), digits) for key, name, digits in COLUMNS}
        lines.append(cells)
    return markdown_table(lines)


def selection_lines(selection: Mapping[str, Any]) -> list[str]:
    grid: list[dict[str, object]] = [
        {"tau": f"{g['tau']:g}", "top_p": f"{g['top_p']:g}", "answer sim.": _f(g["answer_similarity"]),
         "spans verbatim": _f(g["span_verbatim"]), "perplexity": _f(g["released_perplexity"], 1)}
        for g in selection["grid"]]
    chosen, shipped = selection["chosen"], selection["shipped"]
    same = chosen == shipped
    return [f"On {selection['n_prompts']} training prompts at epsilon {selection['epsilon']:g} ({selection['rule']}):",
            "", markdown_table(grid), "",
            f"Chosen: tau {chosen['tau']:g}, top-p {chosen['top_p']:g}. The shipped defaults (tau "
            f"{shipped['tau']:g}, top-p {shipped['top_p']:g}) {'are' if same else 'are NOT'} this choice."]


def quality_markdown(payload: Mapping[str, Any]) -> str:
    rows, meta, s = payload["rows"], payload["metadata"], payload["setting"]
    original, control = _row(rows, ORIGINAL), _row(rows, PLACEHOLDERS)
    bar, bar_lines = bar_verdict(rows)
    lines = [
        "# privlm bench chat-quality", "",
        f"`{meta.get('command')}` at {str(meta.get('git_commit'))[:12]}, seed {meta.get('seed')}, "
        f"{meta.get('seconds', math.nan) / 60:.0f} min. {payload['prompts']['test']} test prompts (split by template), "
        f"answers by `privlm serve-llm` (SmolLM2, greedy, {s['max_tokens']} tokens) through `privlm gateway "
        "--restore --chat-memory off` (the extraction: the call `--extract` makes, run by the bench on the same "
        f"device model); tweets AUC on {s['n_tweets']} tweets. Logit bound B = {payload['logit_bound']['value']:.3f} "
        "(public prompts). Spend is each mechanism's sound per-prompt total, in its own unit (Text2Text's and the "
        "SANTEXT/InferDPT metric mechanisms' are not epsilons of the same kind): compare at matched attack success.",
        "",
        f"An unrelated prompt's answer scores {_f(_n(original, 'unrelated_similarity'))} "
        f"(± {_f(_n(original, 'unrelated_similarity_se'))}); the original's own answer 1.",
        *([] if payload.get("complete", True) else [
            "", f"**Partial run**: {len(rows)} points of the {2 + sum(len(e) for _, e in s['points'])} set; "
            "the verdicts below read only these."]),
        "", table(rows), "",
        "## Verdicts", "",
        f"**(1) At most {GOAL:.0%} of personal spans verbatim, answers as close as the placeholder control's: {bar}.**",
        "", *[f"- {line}" for line in bar_lines], "",
        "The control's detector is an oracle (the marked spans): it leaks nothing here; a real redactor leaks what "
        "it misses.", "",
        *_best_lines(rows),
        f"**(2) {label(OURS)} at matched attack success** (LM reconstruction top-1 on personal-span tokens, KNN "
        "top-10, and the share of spans sent verbatim; DP-Prompt on the last only):", "",
        *comparison_lines(rows), "",
        "DP-Prompt rewrites the prompt: no released token stands for an original one, so its LM top-1 column is "
        "another measure (the share of span token ids found anywhere in the paraphrase, case and word boundaries "
        "ignored), not compared; it is compared at matched spans verbatim, which every row measures on what the "
        "gateway sent.", "",
        f"**(3) The spend of {label(OURS)} and {label(FAST)} is exactly (perturbed tokens) x epsilon on every "
        f"request: {spend_verdict(rows)}.**", "",
        "**(4) The extraction (--extract), change in answer similarity:** "
        + "; ".join(extraction_lines(rows)) + ".", "",
        f"The placeholder control: {_f(_n(control, 'answer_similarity'))} answer similarity, "
        f"{_f(_n(control, 'extracted_similarity'))} after extraction.", "",
        f"**(5) {label(FAST)} (two forward passes) against {label(OURS)} (a decode step per perturbed token), at "
        "matched attack success:**", "", *comparison_lines(rows, FAST, (OURS,)), "", fast_cost_line(rows), "",
        *restore_lines(rows), "",
        "## cape-public's tau and top-p", "", *selection_lines(payload["selection"]), "",
        "## Examples", "",
    ]
    for r in _private(rows):
        for example in r.get("examples", [])[:1]:
            lines += [f"- {label(r['method'])}, eps {r['epsilon']:g}: sent {example['sent']!r}"]
    lines += ["", "Plots: `similarity_vs_attack.png` (dashed: the restored answers), `verbatim_vs_similarity.png`, "
              "`auc_vs_attack.png`."]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------- plots
def _plot(rows: Sequence[Row], x: str, y: str, xlabel: str, ylabel: str, path: Path, title: str,
          lines: Mapping[str, float] | None = None, dashed: str | None = None) -> Path:
    """One curve of ``y`` against ``x`` per method; ``dashed``: a second column, dashed in the method's colour."""
    fig = Figure(figsize=(8, 5.5))
    ax = fig.subplots()
    for method in dict.fromkeys(str(r["method"]) for r in rows):
        colour = None
        for column, style in ((y, "-"), *(((dashed, "--"),) if dashed else ())):
            points = sorted((_n(r, x), _n(r, column)) for r in rows if r["method"] == method)
            points = [p for p in points if math.isfinite(p[0]) and math.isfinite(p[1])]
            if points:
                xs, ys = zip(*points, strict=True)
                drawn = ax.plot(xs, ys, marker="o", markersize=4 if style == "-" else 2, linestyle=style,
                                color=colour, label=label(method) if style == "-" else None)
                colour = drawn[0].get_color()
    for name, value in (lines or {}).items():
        if math.isfinite(value):
            ax.axhline(value, linestyle="--", color="gray", linewidth=1)
            ax.annotate(name, (ax.get_xlim()[0], value), fontsize=7, color="gray")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=6.5, loc="best")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    return path


def write_plots(out_dir: Path, rows: Sequence[Row]) -> list[Path]:
    original, control = _row(rows, ORIGINAL), _row(rows, PLACEHOLDERS)
    floor = {"unrelated answer": _n(original, "unrelated_similarity"),
             "placeholders": _n(control, "answer_similarity")}
    return [
        _plot(rows, ATTACK, "answer_similarity", "LM reconstruction top-1, personal-span tokens (lower: more private)",
              "answer similarity (MiniLM cosine to the original's answer)", out_dir / "similarity_vs_attack.png",
              "chat-quality: answer similarity at matched attack success (dashed: restored)", floor,
              dashed="restored_similarity"),
        _plot(rows, "span_verbatim", "answer_similarity", "share of personal spans sent verbatim",
              "answer similarity", out_dir / "verbatim_vs_similarity.png",
              "chat-quality: spans verbatim against answer similarity", floor),
        _plot(rows, ATTACK, "classifier_auc", "LM reconstruction top-1, personal-span tokens",
              "tweets AUC (MiniLM + logistic regression)", out_dir / "auc_vs_attack.png",
              "chat-quality: tweets AUC at matched attack success", {"chance": 0.5}),
    ]


# --------------------------------------------------------------------------------------------- files
def write_quality_report(out_dir: Path, payload: Mapping[str, Any]) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    results = out_dir / "results.json"
    results.write_text(json.dumps(to_json(payload), indent=2) + "\n")
    return [results, *render_quality_report(out_dir)]


def render_quality_report(out_dir: Path) -> list[Path]:
    """results.md and the plots from results.json alone."""
    payload: Any = from_json(json.loads((out_dir / "results.json").read_text()))
    markdown = out_dir / "results.md"
    markdown.write_text(quality_markdown(payload))
    return [markdown, *write_plots(out_dir, payload["rows"])]
