"""Text2Text (Feyisetan et al. 2019): release the vocabulary token nearest to phi(x) + z.

z is d_chi noise with density proportional to exp(-eta ||z||) (:class:`~privlm.mechanisms.DChiLaplace`), so
phi(x) + z is eta ||phi(x) - phi(x')||-private, and so is the nearest token: post-processing. The law of the
released token is the noise's mass on the Voronoi cells of the vocabulary rows around phi(x): it has no closed
form in d > 1, so no exact log-probabilities are given; the claim is checked by the auditor and by Monte Carlo.
Both classes here share that release, :func:`release_nearest`:

- :class:`Text2Text` works on a :class:`~privlm.models.SplitModel` (``privlm bench baselines``): every
  user-text token is replaced by the nearest (L2) row of the model's whole embedding table. Tokenizer-added
  special tokens ([CLS], [SEP]) carry no user text; they are kept and counted (``kept_special``) rather than
  perturbed, so the clean model still sees a well-formed input.
- :class:`Text2TextPerturber` is the token-level baseline of Cape's benchmark (a
  :class:`~privlm.models.perturbation.TextPerturber`): it uses Cape's tokenizer, candidate vocabulary and
  embedding table, and releases the nearest *candidate*, so a special token is never released. Its
  ``epsilon`` is the d_chi level eta. Guarantee: two prompts of the same length (and, when non-sensitive tokens
  are kept, the same non-sensitive tokens in the same places) give outputs whose privacy loss is at most
  eta * sum_i ||phi(x_i) - phi(x'_i)||; the report and the ledger count eta per perturbed token
  (``PrivacyUnit.ETA_TOKEN``). This is a metric guarantee: for two tokens at distance r it is an epsilon of
  eta * r, so an eta is not comparable to another mechanism's epsilon without the distances. The paper used
  GloVe and fastText word vectors; privlm uses the device model's embedding table, like Cape.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import ClassVar

import numpy as np
import torch

from privlm.accounting import Ledger
from privlm.baselines.common import text_positions
from privlm.baselines.neighbours import check_token_ids
from privlm.baselines.token_level import TokenLevelBaseline
from privlm.mechanisms import DChiLaplace, OutputKind, PrivacyUnit, Spend, make_generator, project_to_vocabulary
from privlm.models import SplitModel, TokenBatch
from privlm.models.batching import map_in_length_order
from privlm.models.prompts import NonSensitiveTokens
from privlm.models.vocabulary import CandidateVocabulary
from privlm.validation import check_positive_finite, check_positive_int


def release_nearest(noise: DChiLaplace, rows: torch.Tensor, table: torch.Tensor, *,
                    generator: torch.Generator | None, num_samples: int | None = None, chunk_size: int = 1024,
                    table_squared_norms: torch.Tensor | None = None) -> torch.Tensor:
    """Index of the ``table`` row nearest (L2) to each noisy row rows + z: shape rows.shape[:-1] ((m, ...)).

    The projection is :func:`~privlm.mechanisms.project_to_vocabulary`'s, ``chunk_size`` noisy rows at a time;
    ``table_squared_norms`` (computed once by the caller) saves a pass over the table per call.
    """
    noisy = noise.sample(rows, num_samples=num_samples, generator=generator)
    return project_to_vocabulary(noisy, table, chunk_size=chunk_size, vocabulary_sq_norms=table_squared_norms)


@dataclass
class ReleasedTokens:
    batch: TokenBatch
    released_ids: torch.Tensor
    perturbed: torch.Tensor  # positions that went through the mechanism
    kept_special: int  # special tokens passed through unchanged


class Text2Text:
    def __init__(self, model: SplitModel, *, eta: float, generator: torch.Generator | None = None,
                 chunk_size: int = 1024) -> None:
        self.model = model
        self.mechanism = DChiLaplace(eta=eta)
        self.generator = generator or make_generator(device=model.device)
        self.chunk_size = chunk_size

    @torch.inference_mode()
    def privatize(self, texts: Sequence[str]) -> ReleasedTokens:
        batch = self.model.tokenize(texts)
        perturbed = text_positions(self.model, batch)
        clean = self.model.embed_tokens(batch.input_ids[perturbed])
        released = batch.input_ids.clone()
        released[perturbed] = release_nearest(self.mechanism, clean, self.model.embedding_matrix,
                                               generator=self.generator, chunk_size=self.chunk_size)
        kept = int((batch.attention_mask.bool() & ~perturbed).sum())
        return ReleasedTokens(batch=batch, released_ids=released, perturbed=perturbed, kept_special=kept)

    @torch.inference_mode()
    def encode(self, texts: Sequence[str], *, batch_size: int = 64) -> np.ndarray:
        """(n, d) float32 embeddings of the released token sequences by the clean model."""
        def encode_batch(chunk: list[str]) -> np.ndarray:
            released = self.privatize(chunk)
            pooled = self.model.forward_ids(released.released_ids, released.batch.attention_mask)
            return pooled.float().cpu().numpy()
        return map_in_length_order(texts, encode_batch, batch_size=batch_size)


@dataclass(frozen=True, eq=False)
class Text2TextMechanism:
    """Text2Text at one position: a token id in, the candidate nearest to its noisy embedding row out.

    Input x: an integer tensor of token ids of any shape (...), one release per id (usually (n,); a 0-d tensor
    is one release). ``sample`` returns candidate indices of shape (...), or (m, ...) with ``num_samples=m``.
    Discrete outputs, but no ``log_probabilities``: the law has no closed form (see the module doc).
    """

    unit: ClassVar[PrivacyUnit] = DChiLaplace.unit  # d_chi's, kept by the projection (post-processing)
    vocabulary: CandidateVocabulary
    eta: float
    chunk_size: int = 1024

    def __post_init__(self) -> None:
        object.__setattr__(self, "eta", check_positive_finite("eta", self.eta))
        check_positive_int("chunk_size", self.chunk_size)

    @cached_property
    def noise(self) -> DChiLaplace:
        return DChiLaplace(eta=self.eta)

    @cached_property
    def candidate_squared_norms(self) -> torch.Tensor:
        return self.vocabulary.candidate_embeddings.pow(2).sum(dim=-1)

    @property
    def output_kind(self) -> OutputKind:
        return "discrete"

    def sample(self, x: torch.Tensor, *, num_samples: int | None = None,
               generator: torch.Generator | None = None) -> torch.Tensor:
        rows = self.vocabulary.rows_of(check_token_ids("x", x, self.vocabulary))
        return release_nearest(self.noise, rows, self.vocabulary.candidate_embeddings, generator=generator,
                               num_samples=num_samples, chunk_size=self.chunk_size,
                               table_squared_norms=self.candidate_squared_norms)

    def privacy_bound(self, x: torch.Tensor, x_prime: torch.Tensor) -> float:
        """eta * sum_i ||phi(x_i) - phi(x'_i)||: d_chi's claim, kept by the projection (post-processing)."""
        if x.shape != x_prime.shape:
            raise ValueError(f"x and x_prime must have the same shape, got {tuple(x.shape)} and "
                             f"{tuple(x_prime.shape)}")
        rows, rows_prime = (self.vocabulary.rows_of(check_token_ids(name, ids, self.vocabulary))
                            for name, ids in (("x", x), ("x_prime", x_prime)))
        return self.noise.privacy_bound(rows, rows_prime)

    def spend(self, x: torch.Tensor) -> Spend:
        """eta per released token, in eta-tokens."""
        return Spend(self.unit, self.eta * x.numel())


class Text2TextPerturber(TokenLevelBaseline):
    """Token-level Text2Text on Cape's candidate vocabulary; ``epsilon`` is the d_chi level eta."""

    name = "text2text"
    unit = Text2TextMechanism.unit
    guarantee = ("eta * sum_i ||phi(x_i) - phi(x'_i)|| against any prompt of the same length (the same "
                 "non-sensitive tokens in the same places when they are kept); totals are in eta-tokens, eta per "
                 "perturbed token; the token count is revealed")

    def __init__(self, vocabulary: CandidateVocabulary, *, epsilon: float,
                 non_sensitive: NonSensitiveTokens | None = None, generator: torch.Generator | None = None,
                 ledger: Ledger | None = None, principal: str = "local", chunk_size: int = 1024) -> None:
        """``non_sensitive``: tokens kept unchanged (None, the default: every token is perturbed)."""
        super().__init__(vocabulary, epsilon=epsilon, non_sensitive=non_sensitive, generator=generator,
                         ledger=ledger, principal=principal)
        self.mechanism = Text2TextMechanism(vocabulary, self.epsilon, chunk_size)

    @property
    def eta(self) -> float:
        return self.epsilon
