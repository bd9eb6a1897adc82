"""Contributing token identification (CTI, SAP paper section 4.4): which tokens the customer leaves un-noised.

**Utility importance.** With Laplace-smoothed class-conditional token frequencies

    p(t_m | c) = (n_mc + alpha) / (N_c + alpha |V|)

(``n_mc``: occurrences of token m in the training texts of class c, ``N_c``: all counted positions of class c),
the utility importance of token m to class c is

    UI[m, c] = sum_{c' != c} ln( p(t_m | c) / p(t_m | c') ) = C ln p(t_m | c) - sum_{c'} ln p(t_m | c').

**The k rule.** Each class's contributing tokens are its top-k tokens by UI (ties go to the lower token id;
only tokens that occur in the training data are ranked, so a token seen nowhere is never exempt). k is the
largest value for which the union of the per-class top-k sets covers at most ``share`` (default 1%) of the
counted training token positions. Coverage never decreases with k, so one pass over the ranks finds it; k may be
0, and then nothing is exempt.

**What CTI gives up.** Exempted tokens reach the vendor exactly: with no noise (the default) the vendor reads
them off by nearest neighbour, and with the larger-eta option they get only the weaker noise. The exempt list is
itself a function of the customer's labelled data, a data-dependent choice that is not privatized: the list
stays at the customer, but which positions arrive un-noised reveals it (and, through UI, which words go with
which label). Report both (:class:`CtiReport` lists the exempt tokens and the share of positions they cover).

The public reimplementation of SAP ranks tokens by frequency, not UI, and has an epsilon typo (``1e10 - 5``).
privlm does not copy either: it ranks by UI as the paper defines it, with Laplace smoothing ``alpha``.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from privlm.validation import check_in_interval, check_positive_finite, check_positive_int


@dataclass(frozen=True)
class CtiReport:
    """The customer's CTI result: the exempt tokens, per class and in union, and the positions they cover."""

    exempt_ids: tuple[int, ...]  # sorted token ids exempted (union over classes)
    per_class: dict[int, tuple[int, ...]]  # class id -> its top-k token ids, in decreasing UI order
    k: int  # the chosen k
    share_limit: float  # the requested max share
    covered_positions: int  # training token positions whose token is exempt
    total_positions: int  # all counted training token positions

    @property
    def covered_share(self) -> float:
        """Share of the counted training positions whose token is exempt (at most ``share_limit``)."""
        return self.covered_positions / self.total_positions if self.total_positions else 0.0

    def to_dict(self, *, vocabulary: Sequence[str] | None = None) -> dict[str, Any]:
        """Plain JSON values (class ids become string keys); with ``vocabulary``, the token strings too."""
        out: dict[str, Any] = {
            "k": self.k,
            "share_limit": self.share_limit,
            "covered_positions": self.covered_positions,
            "total_positions": self.total_positions,
            "covered_share": self.covered_share,
            "exempt_ids": list(self.exempt_ids),
            "per_class": {str(c): list(ids) for c, ids in self.per_class.items()},
        }
        if vocabulary is not None:
            out["exempt_tokens"] = [vocabulary[i] for i in self.exempt_ids]
            out["per_class_tokens"] = {str(c): [vocabulary[i] for i in ids] for c, ids in self.per_class.items()}
        return out


def utility_importance(token_ids: Sequence[Sequence[int]], labels: Sequence[int] | np.ndarray, *, vocab_size: int,
                       n_classes: int, alpha: float = 1.0) -> np.ndarray:
    """UI (|V|, C) float64: UI[m, c] = sum_{c' != c} ln(p(t_m|c) / p(t_m|c')).

    p(t|c) = (n_tc + alpha) / (N_c + alpha |V|), Laplace smoothing. Every position counts here;
    :func:`contributing_tokens` drops ignored ids before computing it.
    """
    alpha = check_positive_finite("alpha", alpha)
    ids, pos_labels = _positions(token_ids, labels, vocab_size=vocab_size, n_classes=n_classes)
    return _ui_from_counts(_counts(ids, pos_labels, vocab_size, n_classes), alpha)


def contributing_tokens(token_ids: Sequence[Sequence[int]], labels: Sequence[int] | np.ndarray, *, vocab_size: int,
                        n_classes: int, share: float = 0.01, alpha: float = 1.0,
                        ignore_ids: Collection[int] = ()) -> CtiReport:
    """Per-class top-k tokens by UI, k the largest whose union covers at most ``share`` of the training positions.

    ``token_ids``: the training texts as token-id lists, without padding. ``ignore_ids`` (special tokens, ...)
    are dropped before anything is counted: they are neither positions nor candidates for exemption.
    """
    share = check_in_interval("share", share, 0, 1, low_open=True, high_open=True)
    alpha = check_positive_finite("alpha", alpha)
    ids, pos_labels = _positions(token_ids, labels, vocab_size=vocab_size, n_classes=n_classes)
    ignored = _check_ignore_ids(ignore_ids, vocab_size)
    if ignored.size:
        keep = ~np.isin(ids, ignored)
        ids, pos_labels = ids[keep], pos_labels[keep]
    if ids.size == 0:
        raise ValueError("token_ids has no token positions left to count (all texts empty or ignored)")
    counts = _counts(ids, pos_labels, vocab_size, n_classes)
    ui = _ui_from_counts(counts, alpha)
    frequency = counts.sum(axis=1)
    candidates = np.flatnonzero(frequency)  # only tokens seen in the data can be exempt
    orders = [candidates[np.lexsort((candidates, -ui[candidates, c]))] for c in range(n_classes)]
    k, covered = _choose_k(orders, frequency, share)
    exempt = np.unique(np.concatenate([order[:k] for order in orders]))
    return CtiReport(exempt_ids=tuple(int(i) for i in exempt),
                     per_class={c: tuple(int(i) for i in order[:k]) for c, order in enumerate(orders)},
                     k=k, share_limit=share, covered_positions=covered, total_positions=int(ids.size))


def _choose_k(orders: list[np.ndarray], frequency: np.ndarray, share: float) -> tuple[int, int]:
    """The largest k whose union of per-class top-k covers at most ``share`` of the positions, and its coverage.

    A token joins the union at k = 1 + its best rank over the classes, so coverage(k) is a cumulative sum of
    frequencies grouped by that entry rank: one pass, exact, no search over k.
    """
    n_candidates = len(orders[0])
    ranks = np.empty((len(orders), frequency.size), dtype=np.int64)
    for c, order in enumerate(orders):
        ranks[c, order] = np.arange(n_candidates)
    entry = ranks[:, orders[0]].min(axis=0)  # best rank of each candidate over the classes
    added = np.bincount(entry, weights=frequency[orders[0]], minlength=n_candidates)
    coverage = np.concatenate([[0], np.cumsum(added)]).round().astype(np.int64)  # coverage[k], k = 0..n
    total = int(frequency.sum())
    k = int(np.searchsorted(coverage / total, share, side="right")) - 1  # ratio vs share: no rounding trap
    return k, int(coverage[k])


def _ui_from_counts(counts: np.ndarray, alpha: float) -> np.ndarray:
    """UI from the (|V|, C) count matrix; the sum over c' != c is C ln p(.|c) - sum_c' ln p(.|c')."""
    vocab_size, n_classes = counts.shape
    log_p = np.log(counts + alpha) - np.log(counts.sum(axis=0) + alpha * vocab_size)
    return n_classes * log_p - log_p.sum(axis=1, keepdims=True)


def _counts(ids: np.ndarray, pos_labels: np.ndarray, vocab_size: int, n_classes: int) -> np.ndarray:
    """n[m, c]: occurrences of token m in class c, as float64 (|V|, C)."""
    flat = np.bincount(pos_labels * vocab_size + ids, minlength=n_classes * vocab_size)
    return flat.reshape(n_classes, vocab_size).T.astype(np.float64)


def _positions(token_ids: Sequence[Sequence[int]], labels: Sequence[int] | np.ndarray, *, vocab_size: int,
               n_classes: int) -> tuple[np.ndarray, np.ndarray]:
    """Validate the dataset; return every position's token id and its text's label (both int64, flat)."""
    vocab_size = check_positive_int("vocab_size", vocab_size)
    if isinstance(n_classes, bool) or not isinstance(n_classes, int) or n_classes < 2:
        raise ValueError(f"n_classes must be an integer >= 2, got {n_classes!r}")
    if isinstance(token_ids, str | bytes) or not isinstance(token_ids, Sequence | np.ndarray):
        raise ValueError(f"token_ids must be a sequence of token-id lists, got {type(token_ids).__name__}")
    if len(token_ids) == 0:
        raise ValueError("token_ids is empty: CTI needs a non-empty training set")
    label_array = _check_labels(labels, len(token_ids), n_classes)
    try:
        lengths = np.fromiter((len(text) for text in token_ids), dtype=np.int64, count=len(token_ids))
    except TypeError as error:
        raise ValueError("token_ids must be a sequence of token-id lists") from error
    ids = np.asarray(list(itertools.chain.from_iterable(token_ids)))
    if ids.size and (ids.ndim != 1 or ids.dtype.kind not in "iu"):
        raise ValueError(f"token_ids must hold integer token ids, got {ids.dtype} values")
    ids = ids.astype(np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        bad = int(ids[(ids < 0) | (ids >= vocab_size)][0])
        raise ValueError(f"token_ids must be ids in [0, vocab_size={vocab_size}), got {bad}")
    return ids, np.repeat(label_array, lengths)


def _check_labels(labels: Sequence[int] | np.ndarray, n_texts: int, n_classes: int) -> np.ndarray:
    array = np.asarray(labels)
    if array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
        raise ValueError(f"labels must be a 1-D sequence of integer class ids, got {array.dtype} of shape "
                         f"{array.shape}")
    if len(array) != n_texts:
        raise ValueError(f"labels has {len(array)} entries for {n_texts} texts in token_ids")
    array = array.astype(np.int64)
    if array.min() < 0 or array.max() >= n_classes:
        raise ValueError(f"labels must be class ids in [0, n_classes={n_classes}), got {int(array.min())}.."
                         f"{int(array.max())}")
    missing = np.flatnonzero(np.bincount(array, minlength=n_classes) == 0)
    if missing.size:
        raise ValueError(f"labels: class {int(missing[0])} has no examples: CTI needs every class")
    return array


def _check_ignore_ids(ignore_ids: Collection[int], vocab_size: int) -> np.ndarray:
    values = list(ignore_ids)
    if any(isinstance(i, bool) or not isinstance(i, int | np.integer) for i in values):
        raise ValueError(f"ignore_ids must hold integer token ids, got {values!r}")
    array = np.asarray(values, dtype=np.int64)
    if array.size and (array.min() < 0 or array.max() >= vocab_size):
        raise ValueError(f"ignore_ids must be ids in [0, vocab_size={vocab_size}), got {values!r}")
    return array
