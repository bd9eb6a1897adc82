"""The candidate vocabulary of token-level text mechanisms (Cape and its baselines).

Every token-level mechanism replaces a token by a *candidate*: a token id of the device model's
vocabulary that is not a special token. The candidate set is fixed, public, and the same for every
input; mechanisms work on rows indexed by candidate (0 .. |C| - 1) and map back to token ids with
``candidate_ids``. Inputs may be any token id (an unknown-token id included): distances are taken
from the input's embedding row to every candidate row.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import cached_property

import torch
from transformers import PreTrainedTokenizerBase

from privlm.validation import check_float_tensor


def special_token_ids(tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """Every special id: the named ones (bos, eos, pad, unk, mask...) and added tokens marked special."""
    ids = set(tokenizer.all_special_ids)
    ids.update(i for i, added in tokenizer.added_tokens_decoder.items() if added.special)
    return frozenset(ids)


@dataclass(frozen=True, eq=False)
class CandidateVocabulary:
    """A tokenizer, its embedding table, and the candidate ids (every id but the special ones)."""

    tokenizer: PreTrainedTokenizerBase
    embeddings: torch.Tensor  # (n_ids, d): one row per token id, the device model's input embeddings
    candidate_ids: torch.Tensor  # (|C|,) int64, ascending

    @classmethod
    def from_tokenizer(cls, tokenizer: PreTrainedTokenizerBase, embeddings: torch.Tensor) -> CandidateVocabulary:
        check_float_tensor("embeddings", embeddings, ndim=2)
        n_ids = embeddings.shape[0]
        if len(tokenizer) > n_ids:
            raise ValueError(f"the tokenizer has {len(tokenizer)} tokens but the embedding table only {n_ids} rows")
        special = special_token_ids(tokenizer)
        # Rows past len(tokenizer) (padding of the table to a round size) are no token: not candidates.
        ids = [i for i in range(len(tokenizer)) if i not in special]
        return cls(tokenizer=tokenizer, embeddings=embeddings.detach(),
                   candidate_ids=torch.tensor(ids, dtype=torch.long, device=embeddings.device))

    @property
    def size(self) -> int:
        """|C|, the number of candidates."""
        return int(self.candidate_ids.numel())

    @property
    def device(self) -> torch.device:
        return self.embeddings.device

    @cached_property
    def candidate_embeddings(self) -> torch.Tensor:
        """(|C|, d) float32 rows of the candidates."""
        return self.embeddings[self.candidate_ids].float()

    @cached_property
    def candidate_index(self) -> torch.Tensor:
        """(n_ids,) int64: the candidate index of each token id, -1 for non-candidates."""
        index = torch.full((self.embeddings.shape[0],), -1, dtype=torch.long, device=self.device)
        index[self.candidate_ids] = torch.arange(self.size, device=self.device)
        return index

    @cached_property
    def candidate_squared_norms(self) -> torch.Tensor:
        """(|C|,) float32 squared norms of the candidate rows, computed once (a pass over the whole table)."""
        return self.candidate_embeddings.pow(2).sum(-1)

    def rows_of(self, token_ids: torch.Tensor) -> torch.Tensor:
        """(..., d) float32 embedding rows of any token ids."""
        return self.embeddings[token_ids.to(self.device)].float()

    def distances(self, token_ids: torch.Tensor) -> torch.Tensor:
        """(n, |C|) Euclidean distances from each token's row to every candidate row: one matrix product."""
        queries = self.rows_of(token_ids.reshape(-1))
        return self.distances_from_products(token_ids, queries @ self.candidate_embeddings.T)

    def distances_from_products(self, token_ids: torch.Tensor, products: torch.Tensor) -> torch.Tensor:
        """Distances from the (n, |C|) dot products q.c of the tokens' rows with the candidates' (in place):
        sqrt(|q|^2 + |c|^2 - 2 q.c), and exactly 0 from a candidate to itself, where float32 cancellation
        would leave about 1e-3 that varies with the shape of the product."""
        ids = token_ids.reshape(-1).to(self.device)
        query_norms = self.rows_of(ids).pow(2).sum(-1, keepdim=True)
        squared = products.mul_(-2).add_(self.candidate_squared_norms).add_(query_norms)
        distances = squared.clamp_min_(0).sqrt_()
        index = self.candidate_index[ids]
        rows = (index >= 0).nonzero()[:, 0]
        distances[rows, index[rows]] = 0.0
        return distances

    def token_texts(self, token_ids: torch.Tensor | list[int]) -> list[str]:
        """The surface text of each id on its own (the tokenizer's decoding of that one token)."""
        ids = token_ids.tolist() if isinstance(token_ids, torch.Tensor) else list(token_ids)
        return [str(self.tokenizer.decode([i], clean_up_tokenization_spaces=False)) for i in ids]

    @cached_property
    def fingerprint(self) -> str:
        """sha256 over the candidate ids and their rows and texts: equal for equal vocabularies."""
        digest = hashlib.sha256()
        digest.update(self.candidate_ids.cpu().numpy().tobytes())
        digest.update(self.candidate_embeddings.cpu().contiguous().numpy().tobytes())
        digest.update("\x00".join(self.tokenizer.convert_ids_to_tokens(self.candidate_ids.tolist())).encode())
        return digest.hexdigest()

    def __repr__(self) -> str:
        return f"CandidateVocabulary(|C|={self.size}, d={self.embeddings.shape[1]}, device={self.device})"
