"""Verdicts, results.md and the plots of ``privlm bench attacks``, all computed from results.json's rows.

Verdicts, per (system, setting, target) where both exist:

- ``gain``: the strongest attack against the one our tables used before. "stronger" when its interval lies wholly
  above the earlier attack's, "weaker" when wholly below, "level" otherwise (95% intervals, so a "level" is no
  evidence either way);
- ``exposure`` (tokens, canaries): what the strongest attack's rate says of the setting, by its interval:
  "exposed" when the lower end reaches 50% (most of the text is read), "leaks" when it reaches 10%, "resists" when
  the upper end stays under 10%, and "unclear" when the interval straddles 10% without reaching 50%.

The calibration re-runs SnD's eta calibration with each attack: the eta at which it recovers 50%, 10%, 1% and 0.1%
of the tokens (log eta linear in logit rate between the two grid etas that bracket the target; NaN when the grid
does not bracket it).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from privlm_bench.attacks.rows import Row
from privlm_bench.harness.json_values import from_json
from privlm_bench.snd.calibration import interpolate_eta

CALIBRATION_TARGETS = (0.5, 0.1, 0.01, 0.001)


def _key(row: Row) -> tuple[str, str, str]:
    return str(row["system"]), str(row["setting"]), str(row["target"])


def _by_role(rows: Sequence[Row]) -> dict[tuple[str, str, str], dict[str, Row]]:
    grouped: dict[tuple[str, str, str], dict[str, Row]] = {}
    for row in rows:
        grouped.setdefault(_key(row), {}).setdefault(str(row["role"]), row)
    return grouped


def gain(before: Row, strongest: Row) -> str:
    if strongest["ci_low"] > before["ci_high"]:
        return "stronger"
    if strongest["ci_high"] < before["ci_low"]:
        return "weaker"
    return "level"


def exposure(row: Row) -> str:
    if row["ci_low"] >= 0.5:
        return "exposed"
    if row["ci_low"] >= 0.1:
        return "leaks"
    if row["ci_high"] < 0.1:
        return "resists"
    return "unclear"


def verdicts(rows: Sequence[Row]) -> list[dict[str, Any]]:
    out = []
    for (system, setting, target), roles in _by_role(rows).items():
        strongest = roles.get("strongest")
        if strongest is None:
            continue
        verdict: dict[str, Any] = {"system": system, "setting": setting, "target": target,
                                   "strongest": strongest["attack"], "rate": strongest["rate"]}
        if "before" in roles:
            verdict |= {"before": roles["before"]["attack"], "before_rate": roles["before"]["rate"],
                        "gain": gain(roles["before"], strongest)}
        if target in ("tokens", "canaries") and strongest["kind"] == "rate":
            verdict["exposure"] = exposure(strongest)
        out.append(verdict)
    return out


def calibration(rows: Sequence[Row], system: str = "snd") -> dict[str, dict[str, float]]:
    """Per role (before, strongest): target rate -> the eta at which that attack reaches it."""
    out = {}
    for role in ("before", "strongest"):
        grid = [(float(r["level"]), float(r["rate"])) for r in rows
                if r["system"] == system and r["target"] == "tokens" and r["role"] == role]
        if len(grid) >= 2:
            out[role] = {f"{t:g}": interpolate_eta(grid, t) for t in CALIBRATION_TARGETS}
    return out


def _pct(value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{100 * float(value):.1f}%" if float(value) >= 0.001 or float(value) == 0 else f"{100 * float(value):.2f}%"


def _cell(row: Row | None) -> str:
    if row is None:
        return "-"
    if row["kind"] == "score":
        return f"{row['rate']:.3f} [{row['ci_low']:.3f}, {row['ci_high']:.3f}] ({row['attack']})"
    count = f"{row['successes']}/{row['trials']}" if row["target"] == "canaries" else _pct(row["rate"])
    return f"{count} [{_pct(row['ci_low'])}, {_pct(row['ci_high'])}] ({row['attack']})"


def markdown(payload: Mapping[str, Any]) -> str:
    meta, rows = payload["metadata"], payload["rows"]
    grouped = _by_role(rows)
    found = {(v["system"], v["setting"], v["target"]): v for v in payload.get("verdicts", [])}
    lines = ["# privlm bench attacks", "",
             f"`{meta.get('command', '')}` at commit `{meta.get('git_commit', 'unknown')}`, seed {meta.get('seed')}"
             f"{' (quick)' if meta.get('quick') else ''}; sections took "
             + ", ".join(f"{k} {v} s" for k, v in meta.get("section_seconds", {}).items()) + ".", "",
             *[line for k, v in meta.get("section_notes", {}).items() for line in (f"Section {k}: {v}", "")],
             "Each row: one system at one operating point, one target. `before` is the attack our tables used "
             "until now, `strongest` the strongest we have; intervals are exact 95% binomial (rates) or bootstrap "
             "(scores). Verdicts: see `privlm_bench/attacks/report.py`.", "",
             "| system | setting | target | before | strongest | gain | exposure | notes |",
             "|---|---|---|---|---|---|---|---|"]
    for key, roles in grouped.items():
        verdict = found.get(key, {})
        notes = [f"{name} {roles['strongest'][name]:.3g}" for name in ("clip_rate", "eta_estimated")
                 if "strongest" in roles and isinstance(roles["strongest"].get(name), int | float)]
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {_cell(roles.get('before'))} | "
                     f"{_cell(roles.get('strongest'))} | {verdict.get('gain', '-')} | {verdict.get('exposure', '-')} "
                     f"| {'; '.join(notes)} |")
    others = [r for r in rows if r["role"] == "other"]
    if others:
        lines += ["", "Further attacks:", "", "| system | setting | target | attack | result |",
                  "|---|---|---|---|---|"]
        lines += [f"| {r['system']} | {r['setting']} | {r['target']} | {r['attack']} | {_cell(r)} |" for r in others]
    cal = payload.get("calibration", {})
    if cal:
        lines += ["", "## SnD's eta calibration, per attack", "",
                  "The eta at which each attack recovers the target share of tokens (NaN: outside the grid).", "",
                  "| attack | " + " | ".join(f"{float(t):.1%}" for t in CALIBRATION_TARGETS) + " |",
                  "|---|" + "---|" * len(CALIBRATION_TARGETS)]
        for role, targets in cal.items():
            lines.append(f"| {role} | " + " | ".join(f"{targets[f'{t:g}']:.1f}" for t in CALIBRATION_TARGETS) + " |")
    return "\n".join(lines) + "\n"


def _is_level_sweep(rows: Sequence[Row]) -> bool:
    """Whether a system's settings are just its privacy levels (one curve), rather than named configurations."""
    return all(r["setting"] == f"{r['level_name']}={float(r['level']):g}" for r in rows)


def _draw(ax: Any, rows: Sequence[Row], system: str) -> None:
    sweep = _is_level_sweep(rows)
    settings = sorted({str(r["setting"]) for r in rows}, key=lambda s: next(float(r["level"]) for r in rows
                                                                           if r["setting"] == s))
    for offset, (role, style) in zip((-0.15, 0.15), (("before", "o--"), ("strongest", "s-")), strict=True):
        points = sorted(((float(r["level"]) if sweep else settings.index(str(r["setting"])) + offset, r)
                         for r in rows if r["role"] == role), key=lambda p: p[0])
        if not points:
            continue
        y = [p[1]["rate"] for p in points]
        err = [[p[1]["rate"] - p[1]["ci_low"] for p in points], [p[1]["ci_high"] - p[1]["rate"] for p in points]]
        ax.errorbar([p[0] for p in points], y, yerr=err, fmt=style if sweep else style[0], capsize=3,
                    label=f"{role}: {points[0][1]['attack']}" if sweep else role)
    ax.set_title(system)
    if sweep:
        ax.set_xscale("log")
        ax.set_xlabel(str(rows[0]["level_name"]))
    else:
        ax.set_xticks(range(len(settings)), settings, rotation=30, ha="right", fontsize=7)
    ax.set_ylim(-0.02, 1.02)
    ax.set_ylabel("tokens recovered")
    ax.legend(fontsize=7)


def plot(payload: Mapping[str, Any], path: Path) -> Path:
    """Token recovery per system: the earlier attack and the strongest, with intervals, against the privacy level
    (a system swept over levels) or per configuration."""
    rows = [r for r in payload["rows"] if r["target"] == "tokens" and r["role"] in ("before", "strongest")]
    systems = sorted({str(r["system"]) for r in rows})
    figure = Figure(figsize=(4.2 * max(1, len(systems)), 4.0))
    axes = figure.subplots(1, max(1, len(systems)), squeeze=False)[0]
    for ax, system in zip(axes, systems, strict=False):
        _draw(ax, [r for r in rows if r["system"] == system], system)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    return path


def render_attacks_report(out_dir: Path) -> list[Path]:
    """results.md and tokens_vs_level.png from ``out_dir/results.json`` (``privlm bench report``)."""
    payload = from_json(json.loads((out_dir / "results.json").read_text()))
    assert isinstance(payload, dict)
    (out_dir / "results.md").write_text(markdown(payload))
    return [out_dir / "results.md", plot(payload, out_dir / "tokens_vs_level.png")]
