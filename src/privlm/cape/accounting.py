"""What one Cape release costs, under the paper's accounting and under privlm's sound one.

Neighbouring relation (privlm). Two prompts are neighbours when they have the same number of tokens
and the same non-sensitive tokens in the same places; their sensitive tokens may all differ. What is
revealed: the token count, and which tokens are non-sensitive (they are released unchanged).

- ``"paper"``: the sum over perturbed tokens of eps + eps'_i, with eps'_i = ln(max_b |b| / min_b |b|)
  the realised eps' of that position's buckets (eps'_i = 0 without bucketing). It is the paper's
  Theorem 4.1 composed over tokens. It is not a sound bound: the paper's per-token bound omits
  ln(K'/K) (the two inputs' counts of non-empty buckets), and it treats each token as if only its own
  utility row depended on it.
- ``"privlm"``: sound. Positions are drawn independently given the prompt, but the utility row of
  every position depends on the other tokens through the device model's context (every later
  position for a causal model, every position for a masked one). So changing one sensitive token
  may change every perturbed position's distribution, and the per-prompt bound composes over ALL
  perturbed positions, each at the data-independent worst case of the sound pair bound:
    - with bucketing: eps + ln(N_b) + ln(|C|) per position
      (:meth:`~privlm.mechanisms.BucketizedExponentialMechanism.spend`; it bounds
      eps + ln(K'/K) + ln(max|b'| / min|b|) over every pair of rows in [0, Delta]);
    - without bucketing: eps per position (any two rows in [0, Delta] differ by at most Delta).
  The total holds against every neighbouring prompt, whatever B is (every utility lies in [0, Delta]).
  It is what the ledger is charged, before anything is drawn.

For two concrete prompts, :class:`PairBound` gives the sound per-position bound on their own rows
(:func:`~privlm.mechanisms.bucketized_pair_bound`) and the exact per-position loss; their sums bound
the privacy loss of releasing one of these two prompts rather than the other.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from privlm.mechanisms import BucketizedExponentialMechanism, ExponentialMechanism
from privlm.models.perturbation import Accounting
from privlm.models.prompts import PromptTokens

PAPER, PRIVLM = Accounting.PAPER, Accounting.PRIVLM

GUARANTEE = ("privlm: the 'privlm' total is an epsilon-DP bound for this release against any neighbouring prompt "
             "(same token count, same non-sensitive tokens in the same places; both are revealed), composed over "
             "every perturbed position because each position's utility depends on the whole context")


def privlm_total(mechanism: BucketizedExponentialMechanism | ExponentialMechanism, utility: torch.Tensor) -> float:
    """Sound per-prompt total: the mechanism's worst-case spend, per perturbed position (rows of ``utility``)."""
    if utility.shape[0] == 0:
        return 0.0
    return float(mechanism.spend(utility).amount)


def paper_total(epsilon: float, eps_prime: torch.Tensor) -> float:
    """The paper's accounting: sum over perturbed positions of eps + eps'_i."""
    return float(epsilon * eps_prime.numel() + eps_prime.double().sum().item())


def check_neighbours(prompt: PromptTokens, prompt_prime: PromptTokens) -> None:
    """Same token count, and the same non-sensitive tokens in the same places; else a ValueError saying why."""
    if len(prompt) != len(prompt_prime):
        raise ValueError(f"the prompts are not neighbours: they have {len(prompt)} and {len(prompt_prime)} tokens "
                         "(neighbours have the same token count)")
    for i, (kept, kept_prime) in enumerate(zip(prompt.non_sensitive, prompt_prime.non_sensitive, strict=True)):
        if kept != kept_prime or (kept and prompt.ids[i] != prompt_prime.ids[i]):
            raise ValueError(f"the prompts are not neighbours: token {i} differs in a non-sensitive place "
                             "(neighbours have the same non-sensitive tokens in the same places)")


@dataclass(frozen=True)
class PairBound:
    """Per perturbed position of two neighbouring prompts: the sound bound and the exact loss."""

    positions: tuple[int, ...]  # the perturbed positions (the same for both prompts)
    per_position: tuple[float, ...]  # sound bound on max_y |ln P(y|x) / P(y|x')| at each position
    exact: tuple[float, ...]  # the exact max_y |ln P(y|x) / P(y|x')| at each position
    epsilon: float

    @property
    def total(self) -> float:
        """The sum of the per-position bounds: a bound for releasing one whole prompt rather than the other."""
        return float(sum(self.per_position))

    @property
    def exact_total(self) -> float:
        """The sum of the exact per-position losses (an upper bound on the exact loss of the whole release)."""
        return float(sum(self.exact))
