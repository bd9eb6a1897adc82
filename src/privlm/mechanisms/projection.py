"""Nearest-neighbour projection onto a vocabulary (Text2Text, the SAP privatizer, inversion attacks).

Squared distances come from one matrix product per chunk of query vectors:
    ||x - e||^2 = ||x||^2 - 2 x.e + ||e||^2
so memory is bounded by ``chunk_size x |V|`` and there is no Python loop over tokens.
"""

from __future__ import annotations

import torch

from privlm.validation import check_float_tensor, check_positive_int


def squared_distances(queries: torch.Tensor, vocabulary: torch.Tensor,
                      vocabulary_sq_norms: torch.Tensor | None = None) -> torch.Tensor:
    """(n, |V|) squared L2 distances between query rows and vocabulary rows, clamped at 0."""
    if vocabulary_sq_norms is None:
        vocabulary_sq_norms = vocabulary.pow(2).sum(dim=-1)
    # In place on the one (n, |V|) product, in the order ||x||^2 - 2 x.e + ||e||^2 (the same floats as out of place).
    return (queries @ vocabulary.T).mul_(-2).add_(queries.pow(2).sum(dim=-1, keepdim=True)).add_(
        vocabulary_sq_norms).clamp_min_(0)


def nearest_neighbours(
    queries: torch.Tensor,
    vocabulary: torch.Tensor,
    *,
    k: int = 1,
    chunk_size: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices and L2 distances of the ``k`` nearest vocabulary rows to each query vector.

    ``queries`` has shape (..., d); the result has shape (..., k), nearest first.
    """
    vocabulary = _checked_vocabulary(queries, vocabulary)
    k = check_positive_int("k", k)
    chunk_size = check_positive_int("chunk_size", chunk_size)
    if k > vocabulary.shape[0]:
        raise ValueError(f"k must be <= the vocabulary size {vocabulary.shape[0]}, got {k}")
    flat = queries.reshape(-1, queries.shape[-1])
    vocabulary_sq_norms = vocabulary.pow(2).sum(dim=-1)
    ids, dists = [], []
    for chunk in flat.split(chunk_size):
        sq = squared_distances(chunk, vocabulary, vocabulary_sq_norms)
        best_sq, best_ids = torch.topk(sq, k, dim=-1, largest=False, sorted=True)
        ids.append(best_ids)
        dists.append(best_sq.sqrt())
    batch_shape = queries.shape[:-1]
    return torch.cat(ids).reshape(*batch_shape, k), torch.cat(dists).reshape(*batch_shape, k)


def project_to_vocabulary(queries: torch.Tensor, vocabulary: torch.Tensor, *, chunk_size: int = 1024,
                          vocabulary_sq_norms: torch.Tensor | None = None) -> torch.Tensor:
    """Id of the nearest vocabulary row for each query vector (shape ``queries.shape[:-1]``); a tie goes to the
    lowest id. ``vocabulary_sq_norms``, computed once by a caller that projects often, saves a pass per call."""
    vocabulary = _checked_vocabulary(queries, vocabulary)
    chunk_size = check_positive_int("chunk_size", chunk_size)
    norms = vocabulary.pow(2).sum(dim=-1) if vocabulary_sq_norms is None else vocabulary_sq_norms.to(vocabulary)
    flat = queries.reshape(-1, queries.shape[-1])
    nearest = [squared_distances(chunk, vocabulary, norms).argmin(dim=-1) for chunk in flat.split(chunk_size)]
    return torch.cat(nearest).reshape(queries.shape[:-1])


def _checked_vocabulary(queries: torch.Tensor, vocabulary: torch.Tensor) -> torch.Tensor:
    """``vocabulary`` on the queries' device and dtype, once both are checked to be finite rows of one width."""
    check_float_tensor("queries", queries)
    check_float_tensor("vocabulary", vocabulary, ndim=2)
    if queries.shape[-1] != vocabulary.shape[-1]:
        raise ValueError(f"queries have dimension {queries.shape[-1]} but vocabulary rows have "
                         f"{vocabulary.shape[-1]}")
    return vocabulary.to(device=queries.device, dtype=queries.dtype)
