"""Benchmark values to and from JSON, which has no infinity or NaN: those go as the strings "inf", "-inf", "nan".

One recursive pair for every results file (sweep rows, partial files, whole payloads); numpy scalars become Python
numbers and mapping keys strings on the way out.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

NON_FINITE = ("inf", "-inf", "nan")


def to_json(value: object) -> object:
    """``value`` with every non-finite float a string and every numpy scalar a Python number, at any depth."""
    if isinstance(value, np.floating | np.integer):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, Mapping):
        return {str(k): to_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_json(v) for v in value]
    return value


def from_json(value: object) -> object:
    """The inverse of :func:`to_json` on what ``json.loads`` gives: "inf", "-inf" and "nan" floats again."""
    if isinstance(value, str) and value in NON_FINITE:
        return float(value)
    if isinstance(value, dict):
        return {k: from_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [from_json(v) for v in value]
    return value
