"""Nearest-neighbour projection onto a vocabulary (Text2Text, the SAP privatizer, inversion attacks).

Squared distances come from one matrix product per chunk of query vectors:
    ||x - e||^2 = ||x||^2 - 2 x.e + ||e||^2
so memory is bounded by ``chunk_size x |V|`` and there is no Python loop over tokens.
"""

from __future__ import annotations

import torch

from privlm._validation import check_float_tensor, check_positive_int


def squared_distances(queries: torch.Tensor, vocabulary: torch.Tensor,
                      vocabulary_sq_norms: torch.Tensor | None = None) -> torch.Tensor:
    """(n, |V|) squared L2 distances between query rows and vocabulary rows, clamped at 0."""
    if vocabulary_sq_norms is None:
        vocabulary_sq_norms = vocabulary.pow(2).sum(dim=-1)
    cross = queries @ vocabulary.T
    return (queries.pow(2).sum(dim=-1, keepdim=True) - 2 * cross + vocabulary_sq_norms).clamp_min(0)


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
    check_float_tensor("queries", queries)
    check_float_tensor("vocabulary", vocabulary, ndim=2)
    k = check_positive_int("k", k)
    chunk_size = check_positive_int("chunk_size", chunk_size)
    if queries.shape[-1] != vocabulary.shape[-1]:
        raise ValueError(f"queries have dimension {queries.shape[-1]} but vocabulary rows have "
                         f"{vocabulary.shape[-1]}")
    if k > vocabulary.shape[0]:
        raise ValueError(f"k must be <= the vocabulary size {vocabulary.shape[0]}, got {k}")
    vocabulary = vocabulary.to(device=queries.device, dtype=queries.dtype)
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


def project_to_vocabulary(queries: torch.Tensor, vocabulary: torch.Tensor, *,
                          chunk_size: int = 1024) -> torch.Tensor:
    """Id of the nearest vocabulary row for each query vector (shape ``queries.shape[:-1]``)."""
    ids, _ = nearest_neighbours(queries, vocabulary, k=1, chunk_size=chunk_size)
    return ids.squeeze(-1)
