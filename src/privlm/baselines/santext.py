"""SANTEXT and SANTEXT+ (Yue et al., Findings of ACL 2021) on the device model's candidate vocabulary.

SANTEXT. Every token x of a prompt is replaced by a candidate y drawn from

    P(y | x) = exp(-eps d(x, y) / 2) / sum_{y' in C} exp(-eps d(x, y') / 2),    d(x, y) = ||phi(x) - phi(y)||_2,

over every candidate y of C (phi: the device model's input embedding rows). For two inputs x, x' and
every output y, the triangle inequality bounds the ratio of the numerators, and that of the
normalisers, by exp(eps d(x, x') / 2), so

    |ln P(y | x) / P(y | x')| <= eps * d(x, x')              (metric local DP, per token),

and a prompt, against any prompt of the same length, loses at most eps * sum_i d(x_i, x'_i). The
ledger unit is ``PrivacyUnit.ETA_TOKEN``, eps per token: a total E bounds the loss by E * r for
prompts whose tokens are at most r apart. The bound is nearly attained when most candidates lie
beyond x' as seen from x (tests). SANTEXT has no stopword list: every token is replaced, numbers
included (the reference code replaces numbers with ``randint``, which is not DP; privlm does not).

SANTEXT+. The sensitive candidates S are the least frequent fraction w (default 0.9) of C by public
word frequency (:mod:`privlm.baselines.frequency`; never the user's data). Outputs always lie in S:

- a sensitive input (in S, or no candidate at all, like the tokenizer's unknown token) is released
  by SANTEXT's law restricted to S: P_S(y | x) = exp(-eps d(x, y) / 2) / sum_{y' in S} ...;
- a frequent input x (in C \\ S) is released the same way with probability p (default 0.3) and
  otherwise kept (reported as ``TokenOutcome.KEPT``): P(y | x) = (1 - p) [y = x] + p P_S(y | x).

Guarantee: for two sensitive inputs, |ln P(y|x) / P(y|x')| <= eps d(x, x') (SANTEXT's argument on S).
A frequent input has no DP guarantee: it is released verbatim with probability 1 - p, an output
that no other input can produce, and which tokens are frequent is public. The neighbouring relation
of the per-prompt bound is therefore: same length, the same frequent tokens in the same places,
sensitive tokens replaced by sensitive tokens; the loss is then at most eps * sum_i d(x_i, x'_i)
over the sensitive positions. The report and the ledger charge eps (eta-token) for every token of the
prompt, before the keep-or-resample coins are drawn (so the charge reveals nothing about them); under
the relation above the frequent tokens cost nothing, so the charge is an upper bound.

Like for like: both use the device model's tokenizer, candidate set and input embeddings (Cape's).
The paper used GloVe word vectors (and BERT's embeddings) over a vocabulary built from the task's data.

Mechanism objects. :class:`SanTextMechanism` and :class:`SanTextPlusMechanism` implement the privlm
mechanism protocol on token ids. x is an int64 tensor of token ids, 0-d (one position) or 1-D (n
positions), one independent release per id; outputs are candidate indices (0 .. |C| - 1) of shape
``x.shape`` (with ``num_samples=m``: ``(m, *x.shape)``); ``log_probabilities(x)`` has shape
``(*x.shape, |C|)``. Map outputs to token ids with ``vocabulary.candidate_ids``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch

from privlm.accounting import Ledger
from privlm.baselines.frequency import least_frequent
from privlm.baselines.token_level import TokenLevelBaseline
from privlm.mechanisms import OutputKind, PrivacyUnit, Spend
from privlm.mechanisms.randomness import resolve_generator
from privlm.models.perturbation import TokenOutcome
from privlm.models.prompts import PromptTokens
from privlm.models.vocabulary import CandidateVocabulary
from privlm.validation import check_in_interval, check_positive_finite, check_positive_int

CHUNK_POSITIONS = 256  # positions per block of distance rows: at most 256 x |C| floats at a time


# --- shared by the token-id mechanisms (SANTEXT, SANTEXT+, InferDPT) ------------------------------
def check_token_ids(name: str, token_ids: object, vocabulary: CandidateVocabulary) -> torch.Tensor:
    """A 0-d or 1-D non-empty integer tensor of rows of the embedding table, as int64 on its device."""
    if not isinstance(token_ids, torch.Tensor) or token_ids.dtype == torch.bool or token_ids.is_floating_point() \
            or token_ids.is_complex():
        raise ValueError(f"{name} must be an integer tensor of token ids, got "
                         f"{getattr(token_ids, 'dtype', type(token_ids).__name__)}")
    if token_ids.ndim > 1 or token_ids.numel() == 0:
        raise ValueError(f"{name} must be a 0-d tensor (one token) or a non-empty 1-D tensor (one release per "
                         f"token), got shape {tuple(token_ids.shape)}")
    n_ids = vocabulary.embeddings.shape[0]
    if int(token_ids.min()) < 0 or int(token_ids.max()) >= n_ids:
        raise ValueError(f"{name} must hold token ids in [0, {n_ids}), some are outside it")
    return token_ids.to(device=vocabulary.device, dtype=torch.long)




def distance_rows(vocabulary: CandidateVocabulary, token_ids: torch.Tensor) -> torch.Tensor:
    """(n, |C|) float64 distances from each id's row to every candidate; d(x, x) = 0 exactly for a candidate x.

    The one-matrix-product distances leave ~1e-3 of rounding on the diagonal; it is set to its true value.
    """
    ids = token_ids.reshape(-1)
    rows = vocabulary.distances(ids).double()
    own = vocabulary.candidate_index[ids]
    on_diagonal = (own >= 0).nonzero().squeeze(-1)
    rows[on_diagonal, own[on_diagonal]] = 0.0
    return rows


def pair_distances(vocabulary: CandidateVocabulary, x: torch.Tensor, x_prime: torch.Tensor) -> torch.Tensor:
    """(n,) float64 d(x_i, x'_i) from the rows themselves (no rounding of the matrix-product form)."""
    if x.shape != x_prime.shape:
        raise ValueError(f"x and x_prime must have the same shape, got {tuple(x.shape)} and {tuple(x_prime.shape)}")
    rows, rows_prime = vocabulary.rows_of(x.reshape(-1)).double(), vocabulary.rows_of(x_prime.reshape(-1)).double()
    return (rows - rows_prime).norm(dim=-1)


def laws_in_blocks(x: torch.Tensor, law: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``law`` (ids -> (n, |C|) log-probabilities) of every id of ``x``, CHUNK_POSITIONS ids at a time:
    shape (*x.shape, |C|)."""
    return torch.cat([law(block) for block in x.reshape(-1).split(CHUNK_POSITIONS)]).reshape(*x.shape, -1)


def draw_in_blocks(x: torch.Tensor, law: Callable[[torch.Tensor], torch.Tensor], *, num_samples: int | None,
                   generator: torch.Generator) -> torch.Tensor:
    """One draw of ``law`` per id of ``x`` (:func:`sample_rows`), CHUNK_POSITIONS ids at a time: shape x.shape
    (``num_samples=m``: (m, *x.shape))."""
    draws = [sample_rows(law(block), num_samples=num_samples, generator=generator)
             for block in x.reshape(-1).split(CHUNK_POSITIONS)]
    return torch.cat(draws, dim=-1).reshape(draws_shape(x, num_samples))


def sample_rows(log_probabilities: torch.Tensor, *, num_samples: int | None,
                generator: torch.Generator) -> torch.Tensor:
    """One index per row of (n, |C|) log-probabilities, shape (n,) (``num_samples=m``: (m, n)), by inverse CDF.

    Exact up to float64 rounding, and faster than ``torch.multinomial`` on wide rows; outputs of
    probability 0 are never drawn (``right=True``: the first index whose cumulative sum exceeds u).
    """
    cdf = log_probabilities.exp().cumsum(dim=-1)
    m = 1 if num_samples is None else check_positive_int("num_samples", num_samples)
    u = torch.rand((cdf.shape[0], m), generator=generator, dtype=torch.float64, device=cdf.device) * cdf[:, -1:]
    draws = torch.searchsorted(cdf, u, right=True).clamp_max_(cdf.shape[-1] - 1)
    return draws[:, 0] if num_samples is None else draws.T


def _log(value: float) -> float:
    return math.log(value) if value > 0 else -math.inf


def draws_shape(x: torch.Tensor, num_samples: int | None) -> tuple[int, ...]:
    """x.shape, or (num_samples, *x.shape) for a positive integer ``num_samples``."""
    return tuple(x.shape) if num_samples is None else (check_positive_int("num_samples", num_samples), *x.shape)


# --- SANTEXT -----------------------------------------------------------------------------------
def santext_log_probabilities(distances: torch.Tensor, *, epsilon: float,
                              outputs: torch.Tensor | None = None) -> torch.Tensor:
    """ln P(y | x) = -eps d(x, y) / 2 - ln Z(x) over the candidates (``outputs``: a mask of allowed ones)."""
    logits = distances.to(torch.float64) * (-epsilon / 2)
    if outputs is not None:
        logits = logits.masked_fill(~outputs, -math.inf)
    return torch.log_softmax(logits, dim=-1)


@dataclass(frozen=True, eq=False)
class SanTextMechanism:
    """SANTEXT at one position per token id: P(y | x) ∝ exp(-eps ||phi(x) - phi(y)|| / 2) over every candidate.

    Input x: int64 token ids, 0-d or 1-D (one release per id); output: candidate indices. Claim:
    eps * sum_i d(x_i, x'_i) for any two inputs of the same shape; spend: eps per id (eta-token).
    """

    unit: ClassVar[PrivacyUnit] = PrivacyUnit.ETA_TOKEN  # metric DP: the loss scales with the embedding distance
    vocabulary: CandidateVocabulary
    epsilon: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "epsilon", check_positive_finite("epsilon", self.epsilon))

    @property
    def output_kind(self) -> OutputKind:
        return "discrete"

    def log_probabilities(self, x: torch.Tensor) -> torch.Tensor:
        """Exact float64 log-probabilities, shape (*x.shape, |C|): one distance row per id."""
        x = check_token_ids("x", x, self.vocabulary)
        return laws_in_blocks(x, self._log_probabilities)

    def _log_probabilities(self, ids: torch.Tensor) -> torch.Tensor:
        return santext_log_probabilities(distance_rows(self.vocabulary, ids), epsilon=self.epsilon)

    def sample(self, x: torch.Tensor, *, num_samples: int | None = None,
               generator: torch.Generator | None = None) -> torch.Tensor:
        """Candidate indices of shape x.shape (``num_samples=m``: (m, *x.shape)), by inverse-CDF draws."""
        x = check_token_ids("x", x, self.vocabulary)
        generator = resolve_generator(generator, self.vocabulary.device)
        return draw_in_blocks(x, self._log_probabilities, num_samples=num_samples, generator=generator)

    def privacy_bound(self, x: torch.Tensor, x_prime: torch.Tensor) -> float:
        """eps * sum_i ||phi(x_i) - phi(x'_i)||_2 (metric DP, composed over positions)."""
        x, x_prime = check_token_ids("x", x, self.vocabulary), check_token_ids("x_prime", x_prime, self.vocabulary)
        return self.epsilon * float(pair_distances(self.vocabulary, x, x_prime).sum())

    def spend(self, x: torch.Tensor) -> Spend:
        """eps per released id, in eta-token units (loss <= total * r for inputs at most r apart)."""
        x = check_token_ids("x", x, self.vocabulary)
        return Spend(self.unit, self.epsilon * x.numel())


# --- SANTEXT+ ----------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class SanTextPlusMechanism:
    """SANTEXT+ at one position per token id: outputs in the sensitive set S; frequent inputs kept w.p. 1 - p.

    ``sensitive``: (|C|,) bool mask of S over the candidates (:func:`~privlm.baselines.frequency.least_frequent`).
    Input x: int64 token ids, 0-d or 1-D; output: candidate indices. Claim: eps * sum_i d(x_i, x'_i) for
    inputs that differ only where both are sensitive (other pairs are refused: no guarantee); spend:
    eps per id (eta-token).
    """

    unit: ClassVar[PrivacyUnit] = SanTextMechanism.unit  # SANTEXT's law, restricted to S
    vocabulary: CandidateVocabulary
    epsilon: float
    sensitive: torch.Tensor
    p: float = 0.3

    def __post_init__(self) -> None:
        object.__setattr__(self, "epsilon", check_positive_finite("epsilon", self.epsilon))
        object.__setattr__(self, "p", check_in_interval("p", self.p, 0, 1))
        mask = self.sensitive
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.shape != (self.vocabulary.size,):
            raise ValueError(f"sensitive must be a bool tensor of shape ({self.vocabulary.size},), one flag per "
                             "candidate")
        if not mask.any():
            raise ValueError("sensitive must mark at least one candidate: the output set is the sensitive set")
        object.__setattr__(self, "sensitive", mask.to(self.vocabulary.device))

    @classmethod
    def from_frequencies(cls, vocabulary: CandidateVocabulary, epsilon: float, *, w: float = 0.9,
                         p: float = 0.3) -> SanTextPlusMechanism:
        """S = the least frequent fraction w of the candidates by public (wordfreq) frequency."""
        return cls(vocabulary, epsilon, least_frequent(vocabulary, check_in_interval("w", w, 0, 1, low_open=True)), p)

    @property
    def output_kind(self) -> OutputKind:
        return "discrete"

    def is_sensitive(self, x: torch.Tensor) -> torch.Tensor:
        """Bool, shape of x: in S, or not a candidate at all (always resampled)."""
        index = self.vocabulary.candidate_index[x]
        return (index < 0) | self.sensitive[index.clamp_min(0)]

    def restricted_log_probabilities(self, x: torch.Tensor) -> torch.Tensor:
        """ln P_S(y | x): SANTEXT's law restricted to S, shape (*x.shape, |C|)."""
        x = check_token_ids("x", x, self.vocabulary)
        return laws_in_blocks(x, self._restricted)

    def _restricted(self, ids: torch.Tensor) -> torch.Tensor:
        return santext_log_probabilities(distance_rows(self.vocabulary, ids), epsilon=self.epsilon,
                                         outputs=self.sensitive)

    def log_probabilities(self, x: torch.Tensor) -> torch.Tensor:
        """Exact float64: ln P_S(y|x) for sensitive x, ln((1 - p)[y = x] + p P_S(y|x)) for frequent x."""
        x = check_token_ids("x", x, self.vocabulary)
        restricted = self.restricted_log_probabilities(x)
        frequent = ~self.is_sensitive(x)
        if not frequent.any():
            return restricted
        own = torch.nn.functional.one_hot(self.vocabulary.candidate_index[x].clamp_min(0), self.vocabulary.size)
        log_kept = torch.full_like(restricted, -math.inf).masked_fill(own.bool(), _log(1 - self.p))
        mixed = torch.logaddexp(log_kept, restricted + _log(self.p))
        return torch.where(frequent.unsqueeze(-1), mixed, restricted)

    def draw_kept(self, x: torch.Tensor, *, num_samples: int | None = None,
                  generator: torch.Generator | None = None) -> torch.Tensor:
        """Bool, shape x.shape (or (m, *x.shape)): frequent and not picked (probability 1 - p) for resampling."""
        x = check_token_ids("x", x, self.vocabulary)
        generator = resolve_generator(generator, self.vocabulary.device)
        coins = torch.rand(draws_shape(x, num_samples), generator=generator, dtype=torch.float64,
                           device=self.vocabulary.device)
        return ~self.is_sensitive(x) & (coins >= self.p)

    def resample(self, x: torch.Tensor, *, num_samples: int | None = None,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        """Draws of P_S(. | x): candidate indices in S, shape x.shape (or (m, *x.shape))."""
        x = check_token_ids("x", x, self.vocabulary)
        generator = resolve_generator(generator, self.vocabulary.device)
        return draw_in_blocks(x, self._restricted, num_samples=num_samples, generator=generator)

    def sample(self, x: torch.Tensor, *, num_samples: int | None = None,
               generator: torch.Generator | None = None) -> torch.Tensor:
        """The full law: a kept frequent input releases itself, every other input a draw of P_S."""
        x = check_token_ids("x", x, self.vocabulary)
        generator = resolve_generator(generator, self.vocabulary.device)
        kept = self.draw_kept(x, num_samples=num_samples, generator=generator)
        resampled = self.resample(x, num_samples=num_samples, generator=generator)
        return torch.where(kept, self.vocabulary.candidate_index[x].expand_as(kept), resampled)

    def privacy_bound(self, x: torch.Tensor, x_prime: torch.Tensor) -> float:
        """eps * sum_i d(x_i, x'_i) when every differing position holds two sensitive tokens; refused otherwise."""
        x, x_prime = check_token_ids("x", x, self.vocabulary), check_token_ids("x_prime", x_prime, self.vocabulary)
        distances = pair_distances(self.vocabulary, x, x_prime)
        differ = (x != x_prime).reshape(-1)
        both_sensitive = (self.is_sensitive(x) & self.is_sensitive(x_prime)).reshape(-1)
        if (differ & ~both_sensitive).any():
            raise ValueError("x and x_prime differ at a frequent (non-sensitive) token: SANTEXT+ releases a frequent "
                             "token verbatim with probability 1 - p, so it has no DP guarantee there")
        return self.epsilon * float(distances[differ].sum())

    def spend(self, x: torch.Tensor) -> Spend:
        """eps per released id, in eta-token units (an upper bound: frequent positions cost 0 under the relation)."""
        x = check_token_ids("x", x, self.vocabulary)
        return Spend(self.unit, self.epsilon * x.numel())


# --- the perturbers ----------------------------------------------------------------------------
class SanText(TokenLevelBaseline):
    """SANTEXT on prompts: every token replaced by a draw of :class:`SanTextMechanism`."""

    name = "santext"
    unit = SanTextMechanism.unit
    guarantee = ("metric LDP per token: against any prompt of the same length, the loss is at most "
                 "eps * sum_i ||phi(x_i) - phi(x'_i)|| (phi: the device model's input embeddings); the totals are "
                 "eta-token units (eps per token)")

    def __init__(self, vocabulary: CandidateVocabulary, *, epsilon: float, generator: torch.Generator | None = None,
                 ledger: Ledger | None = None, principal: str = "local") -> None:
        super().__init__(vocabulary, epsilon=epsilon, generator=generator, ledger=ledger, principal=principal)
        self.mechanism = SanTextMechanism(vocabulary, self.epsilon)


class SanTextPlus(TokenLevelBaseline):
    """SANTEXT+ on prompts: sensitive tokens always resampled; frequent ones resampled w.p. p, else KEPT."""

    name = "santext+"
    unit = SanTextPlusMechanism.unit
    guarantee = ("metric LDP between sensitive tokens only: against a prompt of the same length with the same "
                 "frequent tokens in the same places, the loss is at most eps * sum of ||phi(x_i) - phi(x'_i)|| over "
                 "the sensitive positions; a frequent token has no guarantee (kept verbatim w.p. 1 - p). The totals "
                 "charge eps (eta-token) per token that went through the mechanism, an upper bound")

    mechanism: SanTextPlusMechanism

    def __init__(self, vocabulary: CandidateVocabulary, *, epsilon: float, w: float = 0.9, p: float = 0.3,
                 generator: torch.Generator | None = None, ledger: Ledger | None = None,
                 principal: str = "local") -> None:
        w, p = check_in_interval("w", w, 0, 1, low_open=True), check_in_interval("p", p, 0, 1)  # before the table
        super().__init__(vocabulary, epsilon=epsilon, generator=generator, ledger=ledger, principal=principal)
        self.w = w
        self.mechanism = SanTextPlusMechanism.from_frequencies(vocabulary, self.epsilon, w=w, p=p)

    def outcomes(self, prompt: PromptTokens) -> list[TokenOutcome]:
        """PERTURBED (UNKNOWN) for sensitive and resampled frequent tokens; KEPT for frequent ones not resampled."""
        outcomes = super().outcomes(prompt)
        if not outcomes:
            return outcomes
        ids = torch.tensor(prompt.ids, dtype=torch.long, device=self.vocabulary.device)
        kept = self.mechanism.draw_kept(ids, generator=self.generator).tolist()
        return [TokenOutcome.KEPT if keep else outcome for outcome, keep in zip(outcomes, kept, strict=True)]

    def release(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.vocabulary.candidate_ids[self.mechanism.resample(token_ids, generator=self.generator)]
