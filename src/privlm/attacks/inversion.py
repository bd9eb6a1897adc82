"""Nearest-neighbour inversion of privatized token embeddings (EIA in SAP, the KNN attack in Cape/SANTEXT).

The attacker knows the vocabulary's embedding matrix E (|V| x d). For a privatized vector x~ it
ranks the vocabulary rows by L2 distance ||x~ - E_v|| and guesses the k nearest. The attack
succeeds at a position when the true token id is among those k guesses:

    success_i = [ t_i in argtopk_v -||x~_i - E_v|| ],    rate = (1/n) sum_i success_i.

An attacker who ignores x~ and guesses k distinct tokens succeeds with probability k / |V| on a
uniformly drawn token, which is reported as ``chance`` (on real text, frequent tokens make a
frequency-based guess better than that).

Exact ties between vocabulary rows are broken by ``torch.topk``; a vocabulary with duplicate rows
(identical embeddings for different ids) therefore cannot reach 100% even without noise.

A trainable embedding bottom (SAP, Table 3) is privatized afresh every epoch, so the vendor sees E
independent releases x~_i^(1..E) of every token. :func:`union_inversion` counts a position as
recovered when any epoch's nearest-neighbour guess is right,

    success_i = OR_e [ t_i in argtopk_v -||x~_i^(e) - E_v|| ],

against the initial vocabulary E (the one the attacker knows). This is an upper bound on what one
guess per position achieves (the attacker does not know which epoch is right); its chance level is
that of min(E k, |V|) distinct guesses, min(E k, |V|) / |V|.

Every result records the attack's wall time in ``details["seconds"]``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import torch

from privlm.attacks._checks import check_ids, check_mask
from privlm.attacks.results import AttackResult
from privlm.mechanisms import nearest_neighbours
from privlm.validation import check_float_tensor, check_positive_int

KNN_TOP_K = 10  # the KNN attack of the Cape and SANTEXT papers: success if the original is in the top 10


def nearest_neighbour_inversion(
    privatized: torch.Tensor,
    true_ids: torch.Tensor,
    vocabulary: torch.Tensor,
    *,
    mask: torch.Tensor | None = None,
    k: int = 1,
    chunk_size: int = 1024,
    name: str | None = None,
) -> AttackResult:
    """Share of positions whose true token is among the ``k`` vocabulary rows nearest (L2) to ``privatized``.

    ``privatized`` has shape (..., d), ``true_ids`` the batch shape (...), ``vocabulary`` (|V|, d).
    ``mask`` (bool, shape of ``true_ids``) selects the positions that count, e.g. the attention mask
    without the special tokens; by default every position counts. ``chance`` = k / |V|.
    ``details["rank_counts"][r]`` is how often the true token was the (r+1)-th nearest.
    """
    start = time.perf_counter()
    hits, vocab_size = _nn_hits(privatized, true_ids, vocabulary, mask=mask, k=k, chunk_size=chunk_size)
    return AttackResult(
        name=name or f"nn-inversion-top{k}",
        successes=int(hits.sum()),
        trials=int(hits.shape[0]),
        chance=k / vocab_size,
        details={"k": k, "vocab_size": vocab_size, "metric": "l2", "rank_counts": hits.sum(dim=0).tolist(),
                 "seconds": time.perf_counter() - start},
    )


def _nn_hits(privatized: torch.Tensor, true_ids: torch.Tensor, vocabulary: torch.Tensor, *,
             mask: torch.Tensor | None, k: int, chunk_size: int, name: str = "privatized"
             ) -> tuple[torch.Tensor, int]:
    """(n, k) booleans: whether the r-th nearest row is the true id, for the n positions ``mask`` selects."""
    check_float_tensor(name, privatized)
    check_float_tensor("vocabulary", vocabulary, ndim=2)
    k = check_positive_int("k", k)
    vocab_size = vocabulary.shape[0]
    if k > vocab_size:
        raise ValueError(f"k must be <= the vocabulary size {vocab_size}, got {k}")
    if privatized.shape[-1] != vocabulary.shape[-1]:
        raise ValueError(f"{name} has dimension {privatized.shape[-1]} but vocabulary rows have "
                         f"{vocabulary.shape[-1]}")
    true_ids = check_ids("true_ids", true_ids, shape=privatized.shape[:-1], vocab_size=vocab_size)
    if mask is not None:
        mask = check_mask("mask", mask, shape=true_ids.shape)
        privatized, true_ids = privatized[mask.to(privatized.device)], true_ids[mask.to(true_ids.device)]
    guesses, _ = nearest_neighbours(privatized.reshape(-1, privatized.shape[-1]), vocabulary, k=k,
                                    chunk_size=chunk_size)
    return guesses == true_ids.reshape(-1, 1).to(guesses.device), vocab_size


def union_inversion(
    observations: Sequence[torch.Tensor],
    true_ids: torch.Tensor,
    vocabulary: torch.Tensor,
    *,
    mask: torch.Tensor | None = None,
    k: int = 1,
    chunk_size: int = 1024,
) -> AttackResult:
    """Share of positions that at least one epoch's release gives away: the SAP paper's Table 3 attack.

    ``observations`` holds E privatized versions of the same tokens (one per epoch of a trainable bottom), each
    (..., d) with the batch shape of ``true_ids``; ``vocabulary`` is the initial (|V|, d) word-embedding table.
    A position counts as recovered when its true id is among the ``k`` nearest rows in any epoch.
    ``details["epoch_rates"]`` holds each epoch's own rate; ``chance`` = min(E k, |V|) / |V|.
    """
    start = time.perf_counter()
    if isinstance(observations, torch.Tensor) or not isinstance(observations, Sequence) or not observations:
        raise ValueError("observations must be a non-empty sequence of tensors (one per epoch), got "
                         f"{type(observations).__name__}")
    union: torch.Tensor | None = None
    epoch_rates = []
    vocab_size = 0
    for epoch, observed in enumerate(observations):
        hits, vocab_size = _nn_hits(observed, true_ids, vocabulary, mask=mask, k=k, chunk_size=chunk_size,
                                    name=f"observations[{epoch}]")
        recovered = hits.any(dim=1)
        epoch_rates.append(float(recovered.float().mean()))
        union = recovered if union is None else union | recovered
    assert union is not None  # observations is non-empty
    epochs = len(observations)
    return AttackResult(
        name="nn-inversion-union",
        successes=int(union.sum()),
        trials=int(union.shape[0]),
        chance=min(epochs * k, vocab_size) / vocab_size,
        details={"k": k, "vocab_size": vocab_size, "metric": "l2", "epochs": epochs, "epoch_rates": epoch_rates,
                 "seconds": time.perf_counter() - start},
    )


def knn_attack(
    privatized: torch.Tensor,
    true_ids: torch.Tensor,
    vocabulary: torch.Tensor,
    *,
    mask: torch.Tensor | None = None,
    k: int = KNN_TOP_K,
    chunk_size: int = 1024,
) -> AttackResult:
    """The KNN attack of Cape/SANTEXT (Song & Raghunathan 2020): :func:`nearest_neighbour_inversion` with k = 10.

    For a text-to-text mechanism, whose output is a token id, use :func:`token_id_inversion` with k = 10.
    """
    return nearest_neighbour_inversion(privatized, true_ids, vocabulary, mask=mask, k=k, chunk_size=chunk_size,
                                       name=f"knn-top{k}")


def token_id_inversion(
    released_ids: torch.Tensor,
    true_ids: torch.Tensor,
    vocabulary: torch.Tensor,
    *,
    k: int = 1,
    mask: torch.Tensor | None = None,
    chunk_size: int = 1024,
) -> AttackResult:
    """Nearest-neighbour inversion of released token ids (text-to-text mechanisms: Text2Text, SANTEXT, Cape).

    The released id r is embedded as E_r and attacked like a privatized vector: success when the
    true id is among the ``k`` vocabulary rows nearest to E_r. With k = 1 and no duplicate rows
    this is the retention ratio (E_r's nearest row is r itself); k = 10 is the KNN attack.
    """
    check_float_tensor("vocabulary", vocabulary, ndim=2)
    released_ids = check_ids("released_ids", released_ids, vocab_size=vocabulary.shape[0])
    check_ids("true_ids", true_ids, shape=released_ids.shape)
    embedded = vocabulary[released_ids.to(vocabulary.device)]
    return nearest_neighbour_inversion(embedded, true_ids, vocabulary, mask=mask, k=k, chunk_size=chunk_size,
                                       name=f"token-id-inversion-top{k}")


def undo_clip_scale(clipped: torch.Tensor, *, eta: float, clip_norm: float, vocabulary: torch.Tensor) -> torch.Tensor:
    """An attacker's best guess at x + z from the clipped release (x + z) * C / ||x + z||.

    Clipping keeps the direction; the attacker knows eta and C, and ||x + z|| concentrates near
    sqrt(E||x||^2 + E||z||^2) with E||z||^2 = d (d + 1) / eta^2 (Gamma(d, 1/eta) second moment).
    """
    d = clipped.shape[-1]
    mean_sq = vocabulary.float().pow(2).sum(-1).mean().item()
    return clipped * (math.sqrt(mean_sq + d * (d + 1) / eta**2) / clip_norm)
