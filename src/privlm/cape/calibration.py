"""The logit bound B: calibrated from sample prompts, stored with the fingerprint of the model it holds for.

B = the ``quantile`` of |L| over the candidate columns of the device model's logits at every position
of the sample texts (``quantile=1``: the largest). The quantile is the inverted-CDF one: the smallest
value v with at least a fraction ``quantile`` of the |L| at most v. A ``LogitBound`` saved by one model
is refused by another (its ``model_fingerprint`` is the device model's ``weights_fingerprint``).

B shapes utility, never privacy: clipped and rescaled logits lie in [0, 1] whatever B is.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Annotated, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt

from privlm.validation import validated

FORMAT: Literal["privlm.cape.logit-bound/1"] = "privlm.cape.logit-bound/1"


class LogitBound(BaseModel):
    """B, and where it came from: checked on construction and on every read (an unknown key is refused)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    format: Literal["privlm.cape.logit-bound/1"] = FORMAT
    value: Annotated[float, Field(gt=0, allow_inf_nan=False)]
    model_fingerprint: Annotated[str, Field(min_length=1)]
    quantile: Annotated[float, Field(gt=0, le=1)] = 1.0
    n_texts: NonNegativeInt = 0
    n_logits: NonNegativeInt = 0

    def check_model(self, fingerprint: str) -> None:
        """Refuse a bound calibrated on another model."""
        if fingerprint != self.model_fingerprint:
            raise ValueError(f"this logit bound was calibrated on another model (fingerprint "
                             f"{self.model_fingerprint[:12]}..., the device model's is {fingerprint[:12]}...); "
                             "call Cape.calibrate on this model")

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.model_dump(), indent=2) + "\n", encoding="utf-8")
        return path

    @classmethod
    def load(cls, path: str | Path) -> LogitBound:
        content = json.loads(Path(path).read_text(encoding="utf-8"))
        if not isinstance(content, dict) or content.get("format") != FORMAT:
            raise ValueError(f"{path} is not a saved Cape logit bound ({FORMAT})")
        return validated(cls, content, refusal=f"{path} is not a valid Cape logit bound")


def bound_from_logits(magnitudes: torch.Tensor, quantile: float) -> float:
    """The inverted-CDF ``quantile`` of a flat tensor of |logits|."""
    n = magnitudes.numel()
    if n == 0:
        raise ValueError("calibration needs at least one logit")
    k = max(1, math.ceil(quantile * n))
    value = float(magnitudes.max()) if k == n else float(magnitudes.kthvalue(k).values)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"the calibration texts give a logit bound of {value}; B must be finite and > 0")
    return value
