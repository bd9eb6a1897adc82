"""Results files round-trip non-finite floats and numpy scalars at any depth."""

from __future__ import annotations

import json
import math

import numpy as np

from privlm_bench.harness.json_values import from_json, to_json


def test_non_finite_values_round_trip_at_any_depth():
    value = {"eps": math.inf, "rows": [{"x": -math.inf, "y": (1.5, np.float64(np.nan))}], 3: np.int64(7), "s": "inf?"}
    text = json.dumps(to_json(value), allow_nan=False)  # strict JSON: it would raise on a bare inf
    back = from_json(json.loads(text))
    assert isinstance(back, dict) and back["eps"] == math.inf and back["3"] == 7 and back["s"] == "inf?"
    assert back["rows"][0]["x"] == -math.inf and back["rows"][0]["y"][0] == 1.5 and math.isnan(back["rows"][0]["y"][1])
