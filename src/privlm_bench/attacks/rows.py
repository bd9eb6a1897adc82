"""One row of ``privlm bench attacks``: one attack on one system at one operating point.

Every section of the bench (embedding rows, SAP, released prompts) returns these rows, so the report, the plots and
the verdicts read one shape. ``role`` says which attack it is: ``"before"`` the attack our tables used until now (the
weakest), ``"strongest"`` the strongest we have for that target, ``"other"`` any further attack worth reporting.
``target`` says what is attacked (``tokens``, ``canaries``, ``labels``, ``attribute``, ``prompt``), so that a
verdict compares attacks on one target only.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from privlm.attacks import AttackResult, ScoreResult

Role = Literal["before", "strongest", "other"]
ROLES: tuple[Role, ...] = ("before", "strongest", "other")
Row = dict[str, Any]


def attack_row(result: AttackResult | ScoreResult, *, system: str, setting: str, level_name: str, level: float,
               target: str, role: Role, attack: str | None = None, **extra: Any) -> Row:
    """The row of ``result``: its rate (or mean score) with the interval, the chance level where there is one, and
    ``extra`` (e.g. the clip rate, the estimated eta) beside it."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    if isinstance(result, AttackResult):
        figures = {"rate": result.rate, "ci_low": result.ci_low, "ci_high": result.ci_high, "trials": result.trials,
                   "successes": result.successes, "chance": result.chance, "kind": "rate"}
    else:
        figures = {"rate": result.mean, "ci_low": result.ci_low, "ci_high": result.ci_high, "trials": result.n,
                   "successes": None, "chance": None, "kind": "score"}
    return {"system": system, "setting": setting, "level_name": level_name, "level": float(level),
            "target": target, "role": role, "attack": attack or result.name, **figures,
            "details": {k: v for k, v in result.to_dict()["details"].items() if _plain(v)}, **extra}


def _plain(value: Any) -> bool:
    """Details small enough for results.json: numbers, short strings and short lists."""
    if isinstance(value, bool | int | str) or value is None:
        return True
    if isinstance(value, float):
        return not math.isnan(value)
    if isinstance(value, list | tuple):
        return len(value) <= 16 and all(_plain(v) for v in value)
    if isinstance(value, dict):
        return len(value) <= 16 and all(_plain(v) for v in value.values())
    return False
