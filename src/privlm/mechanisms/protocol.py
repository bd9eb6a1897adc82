"""The one interface every privlm mechanism implements (after OpenDP: the privacy map lives on the
mechanism object, next to its sampler).

A mechanism M maps an input tensor x (a batch of rows along the leading axes) to a random output:
  - ``sample(x, num_samples=None, generator=...)``: one release of every row of x; with
    ``num_samples=n``, n independent releases stacked on a new leading axis (torch.distributions'
    convention). Randomness comes only from ``generator``: OS-seeded when None;
  - ``privacy_bound(x, x_prime)``: the mechanism's claim, an upper bound on
    max over output sets S of |ln P[M(x) in S] / P[M(x') in S]| for these two inputs, composed over
    their rows. A mechanism refuses a pair outside the neighbouring relation its guarantee assumes;
  - ``spend(x)``: what one release of x costs in the privacy ledger, in the mechanism's unit;
  - ``output_kind``: ``continuous`` (vectors) or ``discrete`` (candidate ids). A discrete mechanism
    also gives its exact output distribution, ``log_probabilities(x)`` (float64, one row per input row),
    so its privacy loss can be computed exactly rather than estimated.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Literal, Protocol, runtime_checkable

import torch

OutputKind = Literal["continuous", "discrete"]


class PrivacyUnit(StrEnum):
    """What a ledger counts.

    ``epsilon``: pure epsilon-DP; releases compose by adding their epsilons.
    ``eta-token``: d_chi releases; each token vector released at level eta adds eta. For two inputs whose
    token rows are at most r apart (L2), a total of E eta-tokens bounds the privacy loss by E * r.
    ``eta-hidden-state``: d_chi releases of hidden states after one or more transformer blocks (SAP's deeper
    bottoms); each position released at level eta adds eta, and the distance r is between the two inputs' hidden
    states, which depend on the whole text and are about ten times the scale of word embeddings. Counted apart
    from eta-tokens, so that incomparable metrics never add up in one budget.
    """

    EPSILON = "epsilon"
    ETA_TOKEN = "eta-token"
    ETA_HIDDEN_STATE = "eta-hidden-state"


@dataclass(frozen=True)
class Spend:
    """The privacy cost of one release, in ``unit``."""

    unit: PrivacyUnit
    amount: float


@runtime_checkable
class Mechanism(Protocol):
    """Sampling with an explicit generator, and the privacy claim of the sample."""

    @property
    def output_kind(self) -> OutputKind: ...

    def sample(self, x: torch.Tensor, *, num_samples: int | None = None,
               generator: torch.Generator | None = None) -> torch.Tensor: ...

    def privacy_bound(self, x: torch.Tensor, x_prime: torch.Tensor) -> float: ...

    def spend(self, x: torch.Tensor) -> Spend: ...


@runtime_checkable
class DiscreteMechanism(Mechanism, Protocol):
    """A mechanism whose outputs are candidate ids, with its exact output distribution."""

    def log_probabilities(self, x: torch.Tensor) -> torch.Tensor: ...


def rows_of(x: torch.Tensor) -> int:
    """Number of rows (releases) in a batch whose last axis is one row."""
    return int(torch.Size(x.shape[:-1]).numel())
