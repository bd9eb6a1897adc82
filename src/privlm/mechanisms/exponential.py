"""The exponential mechanism (McSherry & Talwar 2007), with exact probabilities.

    P(y | x) = exp(eps * u(x, y) / (2 Delta)) / sum_y' exp(eps * u(x, y') / (2 Delta))

is eps-DP when Delta bounds |u(x, y) - u(x', y)| over all y and neighbouring x, x'.
Utilities are rows of a tensor: shape (..., |V|), one distribution per row.

With a public base measure mu (the same for both inputs: a function of public data only),

    P(y | x) = mu(y) exp(eps * u(x, y) / (2 Delta)) / sum_y' mu(y') exp(eps * u(x, y') / (2 Delta))

is eps-DP under the same condition: ln P(y|x) - ln P(y|x') = eps (u - u') / (2 Delta) + ln(Z'/Z), and each term
is at most eps / 2 (McSherry & Talwar's mechanism is defined with a base measure). Candidates with mu(y) = 0 are
never released, for any input.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from privlm.mechanisms.protocol import OutputKind, PrivacyUnit, Spend, rows_of
from privlm.mechanisms.randomness import resolve_generator
from privlm.validation import check_float_tensor, check_positive_finite, check_positive_int

_NEIGHBOUR_TOLERANCE = 1e-9


def exponential_log_probabilities(utility: torch.Tensor, *, epsilon: float, sensitivity: float) -> torch.Tensor:
    """Exact log-probabilities (float64) of the exponential mechanism, one row per input."""
    check_float_tensor("utility", utility)
    epsilon = check_positive_finite("epsilon", epsilon)
    sensitivity = check_positive_finite("sensitivity", sensitivity)
    logits = utility.to(torch.float64) * (epsilon / (2 * sensitivity))
    return torch.log_softmax(logits, dim=-1)


def sample_from_probabilities(probabilities: torch.Tensor, *, num_samples: int | None = None,
                              generator: torch.Generator | None = None) -> torch.Tensor:
    """One index per row of a (..., |V|) probability tensor, shape (...); ``num_samples=n``: shape (n, ...)."""
    generator = resolve_generator(generator, probabilities.device)
    n = 1 if num_samples is None else check_positive_int("num_samples", num_samples)
    flat = probabilities.reshape(-1, probabilities.shape[-1])
    draws = torch.multinomial(flat, n, replacement=True, generator=generator)  # (rows, n)
    batch = probabilities.shape[:-1]
    return draws.reshape(batch) if num_samples is None else draws.T.reshape(n, *batch)


def check_neighbours(utility: torch.Tensor, utility_prime: torch.Tensor, sensitivity: float) -> None:
    """Two utility tensors of one shape whose rows differ by at most ``sensitivity`` for every candidate."""
    if utility.shape != utility_prime.shape:
        raise ValueError(f"utility rows must have the same shape, got {tuple(utility.shape)} and "
                         f"{tuple(utility_prime.shape)}")
    gap = (utility.to(torch.float64) - utility_prime.to(torch.float64)).abs().max().item()
    if gap > sensitivity * (1 + _NEIGHBOUR_TOLERANCE):
        raise ValueError(f"the inputs are not neighbours: max |u - u'| = {gap:.6g} > sensitivity = {sensitivity:.6g}")


@dataclass(frozen=True, kw_only=True)
class ExponentialMechanism:
    """Exponential mechanism with privacy budget ``epsilon`` and utility sensitivity ``sensitivity``.

    Input: utility rows (..., |V|), one release per row. Neighbouring relation: utility rows that differ
    by at most ``sensitivity`` for every candidate; the claim is ``epsilon`` per row, added over rows.
    """

    unit: ClassVar[PrivacyUnit] = PrivacyUnit.EPSILON  # what spend counts: epsilon per row
    epsilon: float
    sensitivity: float = 1.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "epsilon", check_positive_finite("epsilon", self.epsilon))
        object.__setattr__(self, "sensitivity", check_positive_finite("sensitivity", self.sensitivity))

    @property
    def output_kind(self) -> OutputKind:
        return "discrete"

    def log_probabilities(self, utility: torch.Tensor) -> torch.Tensor:
        """Exact output log-probabilities (float64), shape of ``utility``."""
        return exponential_log_probabilities(utility, epsilon=self.epsilon, sensitivity=self.sensitivity)

    def probabilities(self, utility: torch.Tensor) -> torch.Tensor:
        """Exact output probabilities (float64), shape of ``utility``."""
        return self.log_probabilities(utility).exp()

    def sample(self, utility: torch.Tensor, *, num_samples: int | None = None,
               generator: torch.Generator | None = None) -> torch.Tensor:
        """Sampled candidate ids: shape (...) for utility (..., |V|); ``num_samples=n``: (n, ...)."""
        return sample_from_probabilities(self.probabilities(utility), num_samples=num_samples,
                                         generator=generator)

    def privacy_bound(self, utility: torch.Tensor, utility_prime: torch.Tensor) -> float:
        """epsilon per row, for neighbouring utility rows (refused otherwise)."""
        check_neighbours(utility, utility_prime, self.sensitivity)
        return self.epsilon * rows_of(utility)

    def spend(self, utility: torch.Tensor) -> Spend:
        return Spend(self.unit, self.epsilon * rows_of(utility))


@dataclass(frozen=True, kw_only=True, eq=False)
class BaseMeasureExponentialMechanism(ExponentialMechanism):
    """The exponential mechanism over a public base measure: P(y | x) proportional to mu(y) exp(eps u / (2 Delta)).

    ``log_base``: ln mu, shape (|V|) or one row per input row (broadcast against the utility rows); -inf excludes a
    candidate; every row needs at least one finite entry. It must not depend on the private input: the claim
    (:class:`ExponentialMechanism`'s: ``epsilon`` per row for utility rows that differ by at most ``sensitivity``)
    assumes it is public. Sampling, the claim and the spend are the plain mechanism's.
    """

    log_base: torch.Tensor
    # Compared by identity: a tensor field has no single truth value (the parent compares epsilon and sensitivity).
    __eq__ = object.__eq__
    __hash__ = object.__hash__

    def __post_init__(self) -> None:
        super().__post_init__()
        check_float_tensor("log_base", self.log_base, allow_minus_inf=True)
        if bool(torch.isneginf(self.log_base).all(dim=-1).any()):
            raise ValueError("every row of log_base needs a candidate with a finite log-weight")

    def log_probabilities(self, utility: torch.Tensor) -> torch.Tensor:
        """Exact output log-probabilities (float64), shape of ``utility``."""
        check_float_tensor("utility", utility)
        logits = self.log_base.to(torch.float64) + utility.to(torch.float64) * (self.epsilon / (2 * self.sensitivity))
        return torch.log_softmax(logits, dim=-1)
