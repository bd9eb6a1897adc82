"""Cape's parameters, validated once: epsilon per token, the utility's weights, the buckets and the logit bound."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from privlm.models.text_mechanisms import check_epsilon
from privlm.validation import check_choice, check_non_negative_finite, check_positive_finite, check_positive_int

OnUncalibrated = Literal["error", "calibrate"]
ON_UNCALIBRATED: tuple[OnUncalibrated, ...] = ("error", "calibrate")


@dataclass(frozen=True, kw_only=True)
class CapeConfig:
    """Cape's parameters (defaults from the paper: lambda_L = 0.5, lambda_D = 1.0, N_b = 50).

    ``n_buckets=None`` turns bucketing off (the plain exponential mechanism on the hybrid utility).
    ``logit_bound`` is B, the clipping bound of the device model's logits; None until calibrated.
    """

    epsilon: float
    lambda_L: float = 0.5  # noqa: N815 (the paper's name)
    lambda_D: float = 1.0  # noqa: N815
    n_buckets: int | None = 50
    logit_bound: float | None = None
    on_uncalibrated: OnUncalibrated = "error"
    batch_size: int = 16

    def __post_init__(self) -> None:
        object.__setattr__(self, "epsilon", check_epsilon(self.epsilon))
        object.__setattr__(self, "lambda_L", check_non_negative_finite("lambda_L", self.lambda_L))
        object.__setattr__(self, "lambda_D", check_non_negative_finite("lambda_D", self.lambda_D))
        if self.lambda_L == 0 and self.lambda_D == 0:
            raise ValueError("lambda_L and lambda_D cannot both be 0: the utility would be constant")
        if self.n_buckets is not None:
            check_positive_int("n_buckets", self.n_buckets)
        if self.logit_bound is not None:
            object.__setattr__(self, "logit_bound", check_positive_finite("logit_bound", self.logit_bound))
        check_choice("on_uncalibrated", self.on_uncalibrated, ON_UNCALIBRATED)
        check_positive_int("batch_size", self.batch_size)

    @property
    def sensitivity(self) -> float:
        """Delta = lambda_L + lambda_D: every utility lies in [0, Delta]."""
        return self.lambda_L + self.lambda_D

    @property
    def uses_logits(self) -> bool:
        """lambda_L > 0: the device model runs; lambda_L = 0 is distance only (no forward pass)."""
        return self.lambda_L > 0

    @property
    def bucketed(self) -> bool:
        return self.n_buckets is not None
