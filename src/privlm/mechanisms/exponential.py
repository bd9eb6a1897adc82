"""The exponential mechanism (McSherry & Talwar 2007), with exact probabilities.

    P(y | x) = exp(eps * u(x, y) / (2 Delta)) / sum_y' exp(eps * u(x, y') / (2 Delta))

is eps-DP when Delta bounds |u(x, y) - u(x', y)| over all y and neighbouring x, x'.
Utilities are rows of a tensor: shape (..., |V|), one distribution per row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from privlm._validation import check_float_tensor, check_positive_finite
from privlm.mechanisms.randomness import resolve_generator


def exponential_log_probabilities(utility: torch.Tensor, *, epsilon: float, sensitivity: float) -> torch.Tensor:
    """Exact log-probabilities (float64) of the exponential mechanism, one row per input."""
    check_float_tensor("utility", utility)
    epsilon = check_positive_finite("epsilon", epsilon)
    sensitivity = check_positive_finite("sensitivity", sensitivity)
    logits = utility.to(torch.float64) * (epsilon / (2 * sensitivity))
    return torch.log_softmax(logits, dim=-1)


def sample_from_probabilities(probabilities: torch.Tensor, *, num_samples: int = 1,
                              generator: torch.Generator | None = None) -> torch.Tensor:
    """Draw ``num_samples`` indices per row of a (..., |V|) probability tensor."""
    generator = resolve_generator(generator, probabilities.device)
    flat = probabilities.reshape(-1, probabilities.shape[-1])
    draws = torch.multinomial(flat, num_samples, replacement=True, generator=generator)
    return draws.reshape(*probabilities.shape[:-1], num_samples)


@dataclass(frozen=True, kw_only=True)
class ExponentialMechanism:
    """Exponential mechanism with privacy budget ``epsilon`` and utility sensitivity ``sensitivity``."""

    epsilon: float
    sensitivity: float = 1.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "epsilon", check_positive_finite("epsilon", self.epsilon))
        object.__setattr__(self, "sensitivity", check_positive_finite("sensitivity", self.sensitivity))

    def log_probabilities(self, utility: torch.Tensor) -> torch.Tensor:
        return exponential_log_probabilities(utility, epsilon=self.epsilon, sensitivity=self.sensitivity)

    def probabilities(self, utility: torch.Tensor) -> torch.Tensor:
        """Exact output probabilities (float64), shape of ``utility``."""
        return self.log_probabilities(utility).exp()

    def sample(self, utility: torch.Tensor, *, num_samples: int = 1,
               generator: torch.Generator | None = None) -> torch.Tensor:
        """Sampled output indices, shape (..., num_samples)."""
        return sample_from_probabilities(self.probabilities(utility), num_samples=num_samples,
                                         generator=generator)
