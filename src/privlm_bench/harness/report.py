"""Benchmark outputs: a Markdown table and privacy-utility plots."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from matplotlib.figure import Figure  # the object API draws to files without touching pyplot's backend


def _cell(value: object) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "n/a"
        if math.isinf(value):
            return "∞"
        return f"{value:.4f}" if abs(value) < 10 else f"{value:.1f}"
    return str(value)


def _number(value: object) -> float:
    if not isinstance(value, int | float | str):
        raise ValueError(f"expected a number, got {value!r}")
    return float(value)


def markdown_table(rows: Sequence[dict[str, object]]) -> str:
    columns = list(dict.fromkeys(key for row in rows for key in row))
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(row.get(c, "")) for c in columns) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def markdown_report(meta: dict[str, object], rows: Sequence[dict[str, object]]) -> str:
    machine = meta["machine"]
    return (f"# Benchmark `{meta['sweep']}`\n\n{meta['description']}\n\n"
            f"- command: `{meta['command']}`\n- seed: {meta['seed']}\n- git commit: `{meta['git_commit']}`\n"
            f"- machine: {machine}\n- started (UTC): {meta['started_utc']}, wall time {meta['wall_seconds']} s\n"
            f"- settings: {meta['settings']}\n\n" + markdown_table(rows))


def plot_privacy_utility(rows: Sequence[dict[str, object]], *, path: Path, title: str, level_name: str,
                         x_metric: str, y_metric: str, caption: str = "") -> None:
    """Utility on y, attack success on x, one curve per method in order of its privacy level, each point
    labelled with its level; the non-private reference (level = inf) is a black star on top."""
    fig = Figure(figsize=(7.5, 5.2))
    ax = fig.subplots()
    for method in dict.fromkeys(str(r["method"]) for r in rows):
        points = sorted(((_number(r[x_metric]), _number(r[y_metric]), _number(r[level_name]))
                         for r in rows if r["method"] == method), key=lambda p: p[2])
        finite = [p for p in points if math.isfinite(p[2])]
        for x, y, _ in (p for p in points if math.isinf(p[2])):
            ax.scatter([x], [y], marker="*", s=180, color="black", zorder=5, label=f"{method} ({level_name}=∞)")
        if not finite:
            continue
        xs, ys, _ = zip(*finite, strict=True)
        ax.plot(xs, ys, marker="o", label=method)
        for x, y, level in finite:
            ax.annotate(f"{level_name}={level:g}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set_xlabel(f"{x_metric} (attack success, lower is more private)")
    ax.set_ylabel(f"{y_metric} (utility)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    if caption:
        fig.text(0.01, 0.005, caption, fontsize=6, color="gray")
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    fig.savefig(path, dpi=130)
