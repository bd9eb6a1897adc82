"""Attribute inference (AIA): predict a private label from privatized representations.

The attacker trains a classifier on (representation, label) pairs it holds (the train split) and
predicts the labels of the test split. The success rate is the test accuracy; ``chance`` is the
accuracy of always guessing the train split's majority class, the best an attacker can do
without the representations. The macro one-vs-rest AUC, computed on predicted probabilities, is
in ``details["auc"]``.

Nothing is selected on the test split: the logistic model has fixed hyper-parameters, and the
MLP stops early on a validation split carved out of the training data.

Sequences of token representations (n, L, d) are reduced to one vector per example by masked
mean pooling, x = sum_l m_l x_l / sum_l m_l, with the attention mask m (n, L) (all ones when no
mask is given).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from sklearn.base import ClassifierMixin
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import roc_auc_score
from sklearn.neural_network import MLPClassifier
from sklearn.pipeline import Pipeline, make_pipeline
from sklearn.preprocessing import StandardScaler

from privlm.attacks.results import AttackResult
from privlm.validation import check_choice, check_positive_int

CLASSIFIERS = ("logistic", "mlp")
# MLP early stopping: sklearn scores the held-out 10% by accuracy, which plateaus for many epochs at
# the start; small batches and a patience of 20 epochs keep it from stopping before it has learnt.
MLP_BATCH_SIZE = 32
MLP_PATIENCE = 20
ArrayLike = np.ndarray | torch.Tensor


def _to_numpy(value: object) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    return np.asarray(value)


def pool_representations(x: ArrayLike, mask: ArrayLike | None = None, *, name: str = "x") -> np.ndarray:
    """(n, d) float64 features: 2-D input as is, 3-D (n, L, d) mean-pooled over the positions where mask is true."""
    array = _to_numpy(x)
    if array.dtype.kind not in "fiu" or array.ndim not in (2, 3) or array.size == 0:
        raise ValueError(f"{name} must be a non-empty numeric array of shape (n, d) or (n, L, d), "
                         f"got {array.dtype} {array.shape}")
    array = array.astype(np.float64)
    if not np.isfinite(array).all():
        raise ValueError(f"{name} contains NaN or inf")
    if array.ndim == 2:
        if mask is not None:
            raise ValueError(f"a mask for {name} only applies to 3-D input (n, L, d)")
        return array
    weights = np.ones(array.shape[:2]) if mask is None else _to_numpy(mask).astype(np.float64)
    if weights.shape != array.shape[:2]:
        raise ValueError(f"the mask of {name} has shape {weights.shape}, expected {array.shape[:2]}")
    counts = weights.sum(axis=1, keepdims=True)
    if (counts <= 0).any():
        raise ValueError(f"the mask of {name} selects no position for some examples")
    return (array * weights[..., None]).sum(axis=1) / counts


def _labels(name: str, value: object, n: int) -> np.ndarray:
    labels = _to_numpy(value)
    if labels.ndim != 1 or labels.shape[0] != n:
        raise ValueError(f"{name} must be 1-D with {n} labels (one per example), got shape {labels.shape}")
    return labels


def _make_classifier(kind: str, *, dim: int, seed: int, hidden_size: int | None, max_iter: int) -> Pipeline:
    """Standardisation + logistic regression, or + a one-hidden-layer ReLU MLP (hidden size = d by default)."""
    model: ClassifierMixin
    if kind == "logistic":
        model = LogisticRegression(max_iter=max_iter, random_state=seed)
    else:
        model = MLPClassifier(hidden_layer_sizes=(hidden_size or dim,), early_stopping=True, validation_fraction=0.1,
                              n_iter_no_change=MLP_PATIENCE, batch_size=MLP_BATCH_SIZE, max_iter=max_iter,
                              random_state=seed)
    return make_pipeline(StandardScaler(), model)


def _macro_auc(test_y: np.ndarray, probabilities: np.ndarray, classes: np.ndarray) -> float | None:
    """Macro one-vs-rest AUC on probabilities; None when undefined (one test class, or unseen classes)."""
    present = np.unique(test_y)
    if present.size < 2 or not np.isin(present, classes).all():
        return None
    if classes.size == 2:
        return float(roc_auc_score(test_y == classes[1], probabilities[:, 1]))
    return float(roc_auc_score(test_y, probabilities, multi_class="ovr", average="macro", labels=classes))


@dataclass(frozen=True, kw_only=True)
class AttributeInferenceConfig:
    """The attacker's classifier in :func:`attribute_inference`."""

    classifier: Literal["logistic", "mlp"] = "logistic"
    hidden_size: int | None = None  # the MLP's hidden layer; None: the representations' dimension d
    max_iter: int = 1000  # sklearn's iteration budget for either classifier


def attribute_inference(
    train_x: ArrayLike,
    train_y: ArrayLike,
    test_x: ArrayLike,
    test_y: ArrayLike,
    *,
    train_mask: ArrayLike | None = None,
    test_mask: ArrayLike | None = None,
    seed: int = 0,
    config: AttributeInferenceConfig = AttributeInferenceConfig(),
) -> AttackResult:
    """Accuracy of a classifier trained on (train_x, train_y) at predicting test_y from test_x.

    ``train_x``/``test_x`` are (n, d) representations, or (n, L, d) token representations that are
    mean-pooled over ``train_mask``/``test_mask`` (n, L). ``seed`` fixes the classifier's own
    randomness (sklearn ``random_state``); ``config`` chooses the classifier. ``chance`` = share of test
    labels equal to the train majority class; ``details`` hold the macro OvR ``auc`` (None when undefined),
    the classifier and the attack's wall time (``seconds``).
    """
    start = time.perf_counter()
    classifier = config.classifier
    check_choice("classifier", classifier, CLASSIFIERS)
    max_iter = check_positive_int("max_iter", config.max_iter)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    if config.hidden_size is not None:
        check_positive_int("hidden_size", config.hidden_size)
    x_train = pool_representations(train_x, train_mask, name="train_x")
    x_test = pool_representations(test_x, test_mask, name="test_x")
    if x_train.shape[1] != x_test.shape[1]:
        raise ValueError(f"test_x has dimension {x_test.shape[1]} but train_x has {x_train.shape[1]}")
    y_train, y_test = _labels("train_y", train_y, x_train.shape[0]), _labels("test_y", test_y, x_test.shape[0])
    classes, counts = np.unique(y_train, return_counts=True)
    if classes.size < 2:
        raise ValueError("train_y must contain at least two classes")
    pipeline = _make_classifier(classifier, dim=x_train.shape[1], seed=seed, hidden_size=config.hidden_size,
                                max_iter=max_iter)
    pipeline.fit(x_train, y_train)
    predictions = pipeline.predict(x_test)
    majority = classes[np.argmax(counts)]
    details: dict[str, Any] = {
        "classifier": classifier,
        "auc": _macro_auc(y_test, pipeline.predict_proba(x_test), pipeline.classes_),
        "n_train": int(x_train.shape[0]),
        "n_classes": int(classes.size),
        "train_majority_class": majority.item() if hasattr(majority, "item") else majority,
        "seconds": time.perf_counter() - start,
    }
    return AttackResult(name=f"attribute-inference-{classifier}", successes=int((predictions == y_test).sum()),
                        trials=int(y_test.shape[0]), chance=float((y_test == majority).mean()), details=details)
