"""CUSTEXT and CUSTEXT+ (Chen et al., Findings of ACL 2023): each token is replaced within a fixed output set.

Mechanism, for one token x. S(x) is x's output set: its group of K = 20 candidates, built by the paper's
Algorithm 1 (:mod:`privlm.baselines.neighbours`). With d the Euclidean distance between embedding rows,

    u(x, y) = (max_{s in S(x)} d(x, s) - d(x, y)) / (max_{s in S(x)} d(x, s) - min_{s in S(x)} d(x, s))  in [0, 1]
    P(y | x) = exp(eps u(x, y) / 2) / sum_{s in S(x)} exp(eps u(x, s) / 2)   for y in S(x), and 0 elsewhere

(u is the min-max normalised similarity, the negative distance; u = 1 on the whole set if every distance is
equal, as in a group of one).

Guarantee. If x and x' share their output set S, all their utilities lie in [0, 1], so for every y in S
    ln P(y|x) / P(y|x') = eps (u(x, y) - u(x', y)) / 2 + ln Z(x') / Z(x) <= eps / 2 + eps / 2 = eps.
That is all CUSTEXT guarantees. Tokens with different output sets have disjoint supports: the privacy loss
between them is infinite (no DP), and the output reveals which group the input came from. The groups are
public and fixed (they depend on the embedding table only). privlm's accounting therefore takes as
neighbouring prompts two prompts of the same length whose tokens, position by position, share their output
set (CUSTEXT+: and whose non-sensitive tokens are the same, in the same places). Their privacy loss is at
most eps per position where they differ; the report and the ledger count eps per perturbed token.

Inputs that are not candidates (a special or an unknown token id) take the output set of their nearest
candidate, found on the fly, with u computed from their own embedding row: they share that group's guarantee.

CUSTEXT perturbs every token. CUSTEXT+ keeps the non-sensitive tokens (stopwords and punctuation,
:meth:`~privlm.models.prompts.NonSensitiveTokens.english`) and reports them as such. Unlike the reference
code, the output sets come from the public candidate vocabulary alone (never from the user's texts), no word
is kept because it is missing from them, and digits are tokens like any other (no ``randint``).

Like every privlm baseline this uses Cape's tokenizer, candidate vocabulary and input embedding table
(SmolLM2-135M by default), so that the comparison is like for like; the paper worked on words, with GloVe and
counter-fitted word vectors.

Shapes of :class:`CustextMechanism`: its input x is an integer tensor of token ids of any shape (...), one
release per id (usually (n,), the tokens of a prompt; a 0-d tensor is one release). ``sample`` returns
candidate indices (0 .. |C| - 1, see ``CandidateVocabulary.candidate_ids``) of shape (...), or (m, ...) with
``num_samples=m``; ``log_probabilities`` returns (..., |C|) float64.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch

from privlm.accounting import Ledger
from privlm.baselines.neighbours import (
    CUSTEXT_K,
    OutputSets,
    check_k,
    check_token_ids,
    load_output_sets,
    nearest_candidates,
)
from privlm.baselines.token_level import TokenLevelBaseline
from privlm.mechanisms import OutputKind, PrivacyUnit, Spend, sample_from_probabilities
from privlm.models.prompts import NonSensitiveTokens
from privlm.models.vocabulary import CandidateVocabulary
from privlm.validation import check_positive_finite


@dataclass(frozen=True, eq=False)
class CustextMechanism:
    """CUSTEXT at one position: a token id in, a candidate index of its output set out (see the module doc)."""

    unit: ClassVar[PrivacyUnit] = PrivacyUnit.EPSILON  # eps bounds the log-ratio within an output set
    vocabulary: CandidateVocabulary
    output_sets: OutputSets
    epsilon: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "epsilon", check_positive_finite("epsilon", self.epsilon))
        if self.output_sets.fingerprint != self.vocabulary.fingerprint:
            raise ValueError("output_sets were built for another vocabulary (fingerprints differ)")

    @property
    def output_kind(self) -> OutputKind:
        return "discrete"

    def groups(self, x: torch.Tensor) -> torch.Tensor:
        """The output set (group index) of every token id; a non-candidate takes its nearest candidate's."""
        x = check_token_ids("x", x, self.vocabulary)
        index = self.vocabulary.candidate_index[x]
        outside = index < 0
        if bool(outside.any()):
            index = index.clone()
            index[outside] = nearest_candidates(self.vocabulary, x[outside], 1)[0].squeeze(-1)
        return self.output_sets.group_of[index]

    def utilities(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Members (..., K) of each id's output set (-1 pads a short last group) and u (..., K) float64."""
        members = self.output_sets.members_of(self.groups(x))
        present = members >= 0
        rows = self.vocabulary.rows_of(x).double().unsqueeze(-2)
        distance = (self.vocabulary.candidate_embeddings[members.clamp_min(0)].double() - rows).norm(dim=-1)
        far = distance.masked_fill(~present, -math.inf).amax(dim=-1, keepdim=True)
        near = distance.masked_fill(~present, math.inf).amin(dim=-1, keepdim=True)
        span = far - near
        u = torch.where(span > 0, (far - distance) / span.clamp_min(torch.finfo(torch.float64).tiny), 1.0)
        return members, u.masked_fill(~present, math.nan)

    def set_log_probabilities(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Members (..., K) and their exact log-probabilities (..., K) float64 (-inf on the padding)."""
        members, u = self.utilities(x)
        logits = (u * (self.epsilon / 2)).masked_fill(members < 0, -math.inf)
        return members, torch.log_softmax(logits, dim=-1)

    def log_probabilities(self, x: torch.Tensor) -> torch.Tensor:
        """Exact output log-probabilities over every candidate, (..., |C|) float64; -inf outside S(x)."""
        members, log_p = self.set_log_probabilities(x)
        size = self.vocabulary.size
        full = torch.full((*members.shape[:-1], size + 1), -math.inf, dtype=torch.float64, device=members.device)
        # The padding goes to the extra last column, which is then dropped.
        return full.scatter(-1, torch.where(members >= 0, members, size), log_p)[..., :size]

    def sample(self, x: torch.Tensor, *, num_samples: int | None = None,
               generator: torch.Generator | None = None) -> torch.Tensor:
        """Candidate indices, shape of x ((m, *x.shape) with ``num_samples=m``)."""
        members, log_p = self.set_log_probabilities(x)
        slots = sample_from_probabilities(log_p.exp(), num_samples=num_samples, generator=generator)
        if num_samples is not None:
            members = members.expand(num_samples, *members.shape)
        return members.gather(-1, slots.unsqueeze(-1)).squeeze(-1)

    def privacy_bound(self, x: torch.Tensor, x_prime: torch.Tensor) -> float:
        """eps per position where the ids differ; refused when a position's ids have different output sets."""
        if x.shape != x_prime.shape:
            raise ValueError(f"x and x_prime must have the same shape, got {tuple(x.shape)} and "
                             f"{tuple(x_prime.shape)}")
        apart = (self.groups(x) != self.groups(x_prime)).reshape(-1)
        if bool(apart.any()):
            raise ValueError(f"positions {apart.nonzero().squeeze(1).tolist()} hold tokens with different output "
                             "sets: their supports are disjoint and CUSTEXT gives no guarantee between them")
        return self.epsilon * int((x != x_prime).sum())

    def spend(self, x: torch.Tensor) -> Spend:
        """eps per released token."""
        return Spend(self.unit, self.epsilon * x.numel())


@dataclass(frozen=True, kw_only=True)
class CustextOptions:
    """Where CUSTEXT's output sets come from when none are given: groups of ``k`` (the paper's K = 20), loaded from
    the cache under ``cache_root`` (default ``cache_dir()/neighbours``), built there on first use."""

    k: int = CUSTEXT_K
    cache_root: Path | None = None


class Custext(TokenLevelBaseline):
    """CUSTEXT as a :class:`~privlm.models.perturbation.TextPerturber`: every token is perturbed."""

    name = "custext"
    unit = CustextMechanism.unit
    guarantee = ("eps per perturbed token against any prompt of the same length whose tokens share, position by "
                 "position, their CUSTEXT output set (public groups of K; the group of each token and the token "
                 "count are revealed; tokens of different groups have disjoint supports: no DP between them)")

    def __init__(self, vocabulary: CandidateVocabulary, *, epsilon: float, output_sets: OutputSets | None = None,
                 options: CustextOptions | None = None, generator: torch.Generator | None = None,
                 ledger: Ledger | None = None, principal: str = "local") -> None:
        """``output_sets``: prebuilt groups (shared by several instances); else loaded as ``options`` say (groups of
        K = 20 from the default cache)."""
        super().__init__(vocabulary, epsilon=epsilon, generator=generator, ledger=ledger, principal=principal)
        options = options or CustextOptions()
        self.k = check_k(options.k, vocabulary)
        if output_sets is None:
            output_sets = load_output_sets(vocabulary, self.k, root=options.cache_root)
        elif output_sets.k != self.k:
            raise ValueError(f"output_sets were built with k={output_sets.k}, not k={self.k}")
        self.mechanism = CustextMechanism(vocabulary, output_sets, self.epsilon)

    @classmethod
    def check(cls, vocabulary: CandidateVocabulary, *, epsilon: float) -> None:
        super().check(vocabulary, epsilon=epsilon)
        check_k(CUSTEXT_K, vocabulary)


class CustextPlus(Custext):
    """CUSTEXT+: CUSTEXT that keeps the non-sensitive tokens (English stopwords and punctuation by default)."""

    name = "custext+"
    guarantee = Custext.guarantee + "; the non-sensitive tokens must be the same, in the same places, and are kept"

    def __init__(self, vocabulary: CandidateVocabulary, *, epsilon: float, output_sets: OutputSets | None = None,
                 options: CustextOptions | None = None, non_sensitive: NonSensitiveTokens | None = None,
                 generator: torch.Generator | None = None, ledger: Ledger | None = None,
                 principal: str = "local") -> None:
        super().__init__(vocabulary, epsilon=epsilon, output_sets=output_sets, options=options, generator=generator,
                         ledger=ledger, principal=principal)
        self.non_sensitive = non_sensitive or NonSensitiveTokens.english()
