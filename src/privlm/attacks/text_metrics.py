"""Token-level metrics of text-to-text privatization: Rouge-L F1, token accuracy, retention, mapping-set size.

Rouge-L (Lin 2004) on token sequences r (reference, length m) and h (hypothesis, length n):

    P = LCS(r, h) / n,   R = LCS(r, h) / m,   F1 = 2 P R / (P + R)   (0 when LCS = 0),

where LCS is the length of the longest common subsequence (tokens in order, gaps allowed). On text, the tokens
are Rouge's own words (:func:`rouge_words`, rouge-score's default tokenisation).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Hashable, Sequence

import numpy as np
import torch

from privlm.validation import check_positive_int

MAPPING_SET_SAMPLES = 1000  # Cape: 1,000 perturbations of each token

TokenSequence = Sequence[Hashable] | torch.Tensor | np.ndarray


def _as_list(name: str, value: object) -> list:
    if isinstance(value, torch.Tensor | np.ndarray):
        if value.ndim != 1:
            raise ValueError(f"{name} must be one-dimensional, got shape {tuple(value.shape)}")
        return value.tolist()
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise ValueError(f"{name} must be a sequence of tokens (a list, 1-D tensor or array), got "
                         f"{type(value).__name__}")
    return list(value)


def lcs_length(reference: TokenSequence, hypothesis: TokenSequence) -> int:
    """Length of the longest common subsequence, by dynamic programming in O(m n) time and O(n) memory."""
    ref, hyp = _as_list("reference", reference), _as_list("hypothesis", hypothesis)
    if len(hyp) > len(ref):
        ref, hyp = hyp, ref
    previous = [0] * (len(hyp) + 1)
    for token in ref:
        current = [0]
        for j, other in enumerate(hyp):
            current.append(previous[j] + 1 if token == other else max(previous[j + 1], current[j]))
        previous = current
    return previous[-1]


def rouge_l_f1(reference: TokenSequence, hypothesis: TokenSequence) -> float:
    """Rouge-L F1 = 2 P R / (P + R) with P = LCS / len(hypothesis), R = LCS / len(reference).

    Two empty sequences score 1.0; an empty sequence against a non-empty one scores 0.0.
    """
    ref, hyp = _as_list("reference", reference), _as_list("hypothesis", hypothesis)
    if not ref and not hyp:
        return 1.0
    lcs = lcs_length(ref, hyp)
    if lcs == 0:
        return 0.0
    precision, recall = lcs / len(hyp), lcs / len(ref)
    return 2 * precision * recall / (precision + recall)


def rouge_words(text: str) -> list[str]:
    """Rouge's words (rouge-score's default tokenisation): lower case, each maximal run of [a-z0-9] one word."""
    return re.findall(r"[a-z0-9]+", text.lower())


def _rectangular(name: str, value: object) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    try:
        return np.asarray(value)
    except ValueError as error:  # ragged nested lists
        raise ValueError(f"{name} must be rectangular (a tensor, an array or equal-length lists)") from error


def _flat_pairs(first: str, a: object, second: str, b: object, mask: object | None) -> tuple[np.ndarray, np.ndarray]:
    """Flatten two equally shaped id collections (tensors, arrays, or nested equal-length lists) and apply mask."""
    x, y = _rectangular(first, a), _rectangular(second, b)
    m = None if mask is None else _rectangular("mask", mask)
    if x.shape != y.shape:
        raise ValueError(f"{second} has shape {y.shape} but {first} has shape {x.shape}")
    if x.size == 0:
        raise ValueError(f"{first} must not be empty")
    if m is not None:
        if m.dtype != np.bool_ or m.shape != x.shape:
            raise ValueError(f"mask must be boolean with shape {x.shape}, got {m.dtype} {m.shape}")
        if not m.any():
            raise ValueError("mask selects no positions")
        return x[m], y[m]
    return x.reshape(-1), y.reshape(-1)


def token_accuracy(reference: object, hypothesis: object, *, mask: object | None = None) -> float:
    """Share of aligned positions where ``hypothesis`` equals ``reference`` (over ``mask`` if given)."""
    ref, hyp = _flat_pairs("reference", reference, "hypothesis", hypothesis, mask)
    return float((ref == hyp).mean())


def retention_ratio(original_ids: object, released_ids: object, *, mask: object | None = None) -> float:
    """Share of tokens released unchanged, (1/n) sum_i [released_i == original_i], over ``mask`` if given.

    Inputs are tensors, arrays or equal-length nested lists of the same shape.
    """
    original, released = _flat_pairs("original_ids", original_ids, "released_ids", released_ids, mask)
    return float((original == released).mean())


def effective_mapping_set_size(
    samples: Callable[[int], Sequence[int] | torch.Tensor] | Sequence[int] | torch.Tensor | np.ndarray,
    *,
    n: int = MAPPING_SET_SAMPLES,
) -> int:
    """N_w: the number of distinct outputs among perturbations of one token w (Cape, Section 5).

    ``samples`` is either the released outputs themselves, or a sampler ``f(n)`` returning ``n``
    perturbations of w (then ``n``, 1000 by default as in Cape, samples are drawn). N_w <= min(n, |V|).
    """
    n = check_positive_int("n", n)
    if callable(samples):
        drawn = samples(n)
        values = drawn.reshape(-1).tolist() if isinstance(drawn, torch.Tensor | np.ndarray) else list(drawn)
        if len(values) != n:
            raise ValueError(f"samples(n) returned {len(values)} outputs, expected n={n}")
    else:
        values = _as_list("samples", samples)
    if not values:
        raise ValueError("samples must not be empty")
    return len(set(values))
