"""Label inference from the gradients the customer returns to the vendor (SAP, split learning).

Softmax cross-entropy over a batch of B examples, logits u = W h + b, p = softmax(u):

    L = -(1/B) sum_j ln p_{j, y_j},       dL/du_j = (p_j - onehot(y_j)) / B.

**Head at the vendor** (Algorithm 1): the customer returns dL/du. Its entries are (p_c - [c = y]) / B,
positive for every c != y and p_y - 1 < 0 at the label, so the label is the one negative entry:

    y^ = argmin_c (dL/du)_c,

which is exact whenever p_y < 1 (always, in floating point, unless the loss has underflowed to 0).
:func:`label_inference_from_logit_gradients` reports it; its ``chance`` is the majority class's share.

**Head at the customer**: the customer returns the gradient at the pooled representation h,

    g = dL/dh = W^T (p - onehot(y)) / B = (1/B) sum_c (p_c - [c = y]) w_c.

With two classes p_0 - [y = 0] = -(p_1 - [y = 1]), so g = (p_1 - y)(w_1 - w_0) / B: every gradient is
collinear with w_1 - w_0 and its sign is the label (negative for y = 1, positive for y = 0). With C
classes the coefficient vector p - onehot(y) lies in the cone spanned by {e_c - e_y : c != y}; the C
cones are disjoint, so normalised gradients cluster by label. The attack
(:func:`label_inference_from_representation_gradients`) normalises the rows (cosine geometry), splits
them into C clusters with k-means (10 restarts, seeded), and names each cluster by the majority label
of the ``known`` labelled examples the attacker holds that fall into it (a cluster with none gets the
known examples' overall majority). It is scored on the other rows only; ``chance`` is the share of those
rows that the known examples' majority label gets right, the best an attacker ignoring the gradients does.
For two classes k-means on the normalised rows is exactly the sign split along w_1 - w_0.

``details["norm_auc"]`` (two classes) is the AUC of ||g|| as a score for label 1, the norm attack of
Li et al. (2022, "Label leakage and protection in two-party split learning"): ||g|| = |p_1 - y| ||w_1 - w_0|| / B
is large for examples the model gets wrong, which leaks the label when one class is rare or poorly fitted.
An AUC far from 0.5 on either side leaks. :func:`label_inference_by_norm` turns that score into an attack: it
thresholds ||g|| (the exact 2-means split of the norms, or the split that best separates the known rows) and names
the two sides by the known labels, scored like the clustering attack on the other rows.

Every result records the attack's wall time in ``details["seconds"]``.
"""

from __future__ import annotations

import time
import warnings
from typing import Any

import numpy as np
import torch
from sklearn.cluster import KMeans
from sklearn.exceptions import ConvergenceWarning
from sklearn.metrics import roc_auc_score

from privlm.attacks.results import AttackResult
from privlm.validation import check_positive_int

ArrayLike = np.ndarray | torch.Tensor
KMEANS_RESTARTS = 10


def _matrix(name: str, value: object) -> np.ndarray:
    """A non-empty, finite (n, C) float64 array from a tensor or an array."""
    array = value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
    if array.dtype.kind not in "fiu" or array.ndim != 2 or array.size == 0:
        raise ValueError(f"{name} must be a non-empty numeric array of shape (n, dim), got {array.dtype} "
                         f"{array.shape}")
    array = array.astype(np.float64)
    if not np.isfinite(array).all():
        raise ValueError(f"{name} contains NaN or inf")
    return array


def _labels(name: str, value: object, n: int, n_classes: int) -> np.ndarray:
    """1-D integer labels, one per row, in [0, n_classes)."""
    labels = value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
    if labels.dtype.kind not in "iu" or labels.ndim != 1 or labels.shape[0] != n:
        raise ValueError(f"{name} must be 1-D integer labels, one per row ({n}), got {labels.dtype} {labels.shape}")
    if labels.min() < 0 or labels.max() >= n_classes:
        raise ValueError(f"{name} must lie in [0, {n_classes}), got values in [{labels.min()}, {labels.max()}]")
    return labels.astype(np.int64)


def label_inference_from_logit_gradients(gradients: ArrayLike, true_labels: ArrayLike) -> AttackResult:
    """Guess each label as the one negative entry of dL/dlogits (n, C): argmin per row (head at the vendor)."""
    start = time.perf_counter()
    grads = _matrix("gradients", gradients)
    n, n_classes = grads.shape
    if n_classes < 2:
        raise ValueError(f"gradients must have at least 2 columns (classes), got {n_classes}")
    labels = _labels("true_labels", true_labels, n, n_classes)
    hits = grads.argmin(axis=1) == labels
    return AttackResult(
        name="label-inference-logit-gradient", successes=int(hits.sum()), trials=n,
        chance=float(np.bincount(labels, minlength=n_classes).max() / n),
        details={"method": "argmin", "n_classes": n_classes, "seconds": time.perf_counter() - start},
    )


def _cluster_names(clusters: np.ndarray, known_labels: np.ndarray, n_clusters: int, n_classes: int) -> np.ndarray:
    """The label of each cluster: the majority of its known rows, else the known rows' overall majority."""
    fallback = int(np.bincount(known_labels, minlength=n_classes).argmax())
    names = np.full(n_clusters, fallback, dtype=np.int64)
    for cluster in np.unique(clusters):
        inside = known_labels[clusters == cluster]
        names[cluster] = int(np.bincount(inside, minlength=n_classes).argmax())
    return names


def _norm_auc(grads: np.ndarray, labels: np.ndarray, n_classes: int) -> float | None:
    """AUC of the gradient norm as a score for label 1 (two classes, both present), else None."""
    if n_classes != 2 or np.unique(labels).size < 2:
        return None
    return float(roc_auc_score(labels, np.linalg.norm(grads, axis=1)))


def label_inference_from_representation_gradients(
    gradients: ArrayLike,
    true_labels: ArrayLike,
    *,
    n_classes: int,
    known: int = 20,
    seed: int = 0,
) -> AttackResult:
    """Guess labels from dL/dh (n, D) by clustering the normalised gradients (head at the customer).

    The attacker holds the labels of ``known`` rows (the first ``known`` of a permutation seeded by ``seed``)
    and uses them only to name the clusters; it is scored on the remaining n - known rows.
    """
    start = time.perf_counter()
    grads = _matrix("gradients", gradients)
    if isinstance(n_classes, bool) or not isinstance(n_classes, int) or n_classes < 2:
        raise ValueError(f"n_classes must be an integer of at least 2, got {n_classes!r}")
    known = check_positive_int("known", known)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    n = grads.shape[0]
    if n < known + 1:
        raise ValueError(f"gradients must have at least known + 1 = {known + 1} rows, got {n}")
    if n < n_classes:
        raise ValueError(f"gradients must have at least n_classes = {n_classes} rows to cluster, got {n}")
    labels = _labels("true_labels", true_labels, n, n_classes)
    norms = np.linalg.norm(grads, axis=1, keepdims=True)
    unit = grads / np.maximum(norms, np.finfo(np.float64).tiny)
    with warnings.catch_warnings():  # fewer distinct directions than clusters (e.g. 2 classes): harmless
        warnings.simplefilter("ignore", ConvergenceWarning)
        clusters = KMeans(n_clusters=n_classes, n_init=KMEANS_RESTARTS, random_state=seed).fit_predict(unit)
    order = np.random.default_rng(seed).permutation(n)
    known_rows, scored_rows = order[:known], order[known:]
    names = _cluster_names(clusters[known_rows], labels[known_rows], n_classes, n_classes)
    hits = names[clusters[scored_rows]] == labels[scored_rows]
    majority = int(np.bincount(labels[known_rows], minlength=n_classes).argmax())
    details: dict[str, Any] = {"method": "kmeans-cosine", "known": known, "n_classes": n_classes,
                               "cluster_labels": names.tolist(), "norm_auc": _norm_auc(grads, labels, n_classes),
                               "seconds": time.perf_counter() - start}
    return AttackResult(name="label-inference-representation-gradient", successes=int(hits.sum()),
                        trials=int(hits.size), chance=float(np.mean(labels[scored_rows] == majority)), details=details)


def _two_means_threshold(norms: np.ndarray) -> float:
    """The split of sorted 1-D values that minimises the within-group sum of squares (exact 2-means), as a midpoint."""
    values = np.sort(norms)
    if values[0] == values[-1]:
        return float(values[0])
    n = values.size
    prefix, prefix_sq = np.cumsum(values), np.cumsum(values ** 2)
    left = np.arange(1, n)  # sizes of the low group
    low_ss = prefix_sq[:-1] - prefix[:-1] ** 2 / left
    high_ss = (prefix_sq[-1] - prefix_sq[:-1]) - (prefix[-1] - prefix[:-1]) ** 2 / (n - left)
    cut = int(np.argmin(low_ss + high_ss))
    return float((values[cut] + values[cut + 1]) / 2)


def _known_threshold(norms: np.ndarray, labels: np.ndarray) -> float:
    """The midpoint between consecutive known norms that best separates the known labels (either orientation)."""
    order = np.argsort(norms)
    values, ordered = norms[order], labels[order]
    candidates = np.concatenate([[values[0] - 1.0], (values[:-1] + values[1:]) / 2, [values[-1] + 1.0]])
    ones_below = np.concatenate([[0], np.cumsum(ordered)])  # label-1 rows at or below each candidate
    below = np.arange(values.size + 1)
    high_is_one = (below - ones_below) + (ordered.sum() - ones_below)  # 0 below, 1 above: right guesses
    score = np.maximum(high_is_one, values.size - high_is_one)
    return float(candidates[int(np.argmax(score))])


def label_inference_by_norm(
    gradients: ArrayLike,
    true_labels: ArrayLike,
    *,
    known: int = 20,
    split: str = "two-means",
    seed: int = 0,
) -> AttackResult:
    """Guess two-class labels from ||dL/dh|| alone: threshold the norms, name each side from the known labels.

    With g = (p_1 - y)(w_1 - w_0) / B, ||g|| = (1 - p_y) ||w_1 - w_0|| / B: a class the model fits worse has larger
    norms. The threshold is the exact 2-means split of all the norms (``split="two-means"``, no label used), or the
    one that best separates the known rows (``split="known"``). Each side is named by the majority label of the
    known rows on it; a side with none gets the other class than the opposite side (both empty cannot happen).
    The known rows are the first ``known`` of a permutation seeded by ``seed``; scored on the others only, with
    ``chance`` the share of them the known rows' majority label gets right.
    """
    start = time.perf_counter()
    grads = _matrix("gradients", gradients)
    known = check_positive_int("known", known)
    if split not in ("two-means", "known"):
        raise ValueError(f"split must be 'two-means' or 'known', got {split!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    n = grads.shape[0]
    if n < known + 1:
        raise ValueError(f"gradients must have at least known + 1 = {known + 1} rows, got {n}")
    labels = _labels("true_labels", true_labels, n, 2)
    norms = np.linalg.norm(grads, axis=1)
    order = np.random.default_rng(seed).permutation(n)
    known_rows, scored_rows = order[:known], order[known:]
    threshold = _two_means_threshold(norms) if split == "two-means" else \
        _known_threshold(norms[known_rows], labels[known_rows])
    side = (norms > threshold).astype(np.int64)  # 1: the high side
    names = np.full(2, -1, dtype=np.int64)
    for s in (0, 1):
        inside = labels[known_rows][side[known_rows] == s]
        if inside.size:
            names[s] = int(np.bincount(inside, minlength=2).argmax())
    for s in (0, 1):
        if names[s] < 0:
            names[s] = 1 - names[1 - s]
    hits = names[side[scored_rows]] == labels[scored_rows]
    majority = int(np.bincount(labels[known_rows], minlength=2).argmax())
    details: dict[str, Any] = {"method": f"norm-threshold ({split})", "known": known, "threshold": threshold,
                               "side_labels": {"low": int(names[0]), "high": int(names[1])},
                               "norm_auc": _norm_auc(grads, labels, 2), "seconds": time.perf_counter() - start}
    return AttackResult(name="label-inference-gradient-norm", successes=int(hits.sum()), trials=int(hits.size),
                        chance=float(np.mean(labels[scored_rows] == majority)), details=details)
