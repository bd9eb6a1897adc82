"""Downstream utility probes on sentence embeddings.

The SnD paper's probe: two linear layers with a ReLU between them and hidden size = input size,
trained with cross-entropy. A logistic-regression probe is the light alternative. Pair tasks
concatenate the two sentence embeddings. Model selection (early stopping, the logistic C) uses
the validation split only; the test split is touched once, at the end.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import accuracy_score, roc_auc_score
from torch import nn

from privlm.validation import check_choice, check_positive_finite, check_positive_int

ProbeKind = Literal["mlp", "logistic"]
PROBE_KINDS: tuple[ProbeKind, ...] = ("mlp", "logistic")
ArrayLike = np.ndarray | torch.Tensor


def as_numpy(x: ArrayLike, name: str) -> np.ndarray:
    array = x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)
    if array.ndim != 2 or array.shape[0] == 0:
        raise ValueError(f"{name} must be a non-empty 2-D array (n, d), got shape {array.shape}")
    if not np.isfinite(array).all():
        raise ValueError(f"{name} contains NaN or inf")
    return array.astype(np.float32)


def as_labels(y: ArrayLike, n: int, name: str) -> np.ndarray:
    labels = y.detach().cpu().numpy() if isinstance(y, torch.Tensor) else np.asarray(y)
    if labels.shape != (n,) or not np.issubdtype(labels.dtype, np.integer) or labels.min() < 0:
        raise ValueError(f"{name} must be {n} non-negative integer labels, got shape {labels.shape}, "
                         f"dtype {labels.dtype}")
    return labels.astype(np.int64)


def pair_features(first: ArrayLike, second: ArrayLike) -> np.ndarray:
    """Pair tasks: [e(text) ; e(text_pair)]."""
    a, b = as_numpy(first, "first"), as_numpy(second, "second")
    if a.shape != b.shape:
        raise ValueError(f"pair embeddings must have the same shape, got {a.shape} and {b.shape}")
    return np.concatenate([a, b], axis=1)


def classification_metrics(y_true: np.ndarray, probabilities: np.ndarray) -> dict[str, float]:
    """Accuracy of the argmax, and AUC on probabilities (binary, or macro one-vs-rest)."""
    n_classes = probabilities.shape[1]
    accuracy = float(accuracy_score(y_true, probabilities.argmax(axis=1)))
    present = np.unique(y_true)
    if len(present) < 2:
        auc = math.nan  # undefined with a single class in y_true
    elif n_classes == 2:
        auc = float(roc_auc_score(y_true, probabilities[:, 1]))
    else:
        auc = float(roc_auc_score(y_true, probabilities, multi_class="ovr", average="macro",
                                  labels=np.arange(n_classes)))
    return {"accuracy": accuracy, "auc": auc}


def embedding_agreement(reference: ArrayLike, candidate: ArrayLike) -> dict[str, float]:
    """Mean squared error and mean cosine similarity between matching rows of two embedding sets."""
    a, b = as_numpy(reference, "reference"), as_numpy(candidate, "candidate")
    if a.shape != b.shape:
        raise ValueError(f"reference and candidate must have the same shape, got {a.shape} and {b.shape}")
    cosine = (a * b).sum(1) / np.maximum(np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1), 1e-12)
    return {"mse": float(((a - b) ** 2).mean()), "cosine": float(cosine.mean())}


class TwoLayerProbe(nn.Module):
    """Linear(d, d) -> ReLU -> Linear(d, classes), as in the SnD paper."""

    def __init__(self, dim: int, n_classes: int, *, generator: torch.Generator) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, n_classes))
        with torch.no_grad():  # PyTorch's default init, drawn from our generator instead of the global RNG
            for layer in self.net:
                if not isinstance(layer, nn.Linear):
                    continue
                bound = 1 / math.sqrt(layer.in_features)
                layer.weight.uniform_(-bound, bound, generator=generator)
                layer.bias.uniform_(-bound, bound, generator=generator)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


@dataclass(kw_only=True)
class ProbeResult:
    kind: ProbeKind
    accuracy: float
    auc: float
    validation_accuracy: float
    validation_auc: float
    best_epoch: int | None
    n_train: int
    n_validation: int
    n_test: int
    details: dict[str, float] = field(default_factory=dict)


@dataclass(kw_only=True)
class Probe:
    """A probe fitted on train features; standardisation statistics come from train only."""

    kind: ProbeKind = "mlp"
    seed: int = 0
    max_epochs: int = 200
    patience: int = 10
    learning_rate: float = 1e-3
    batch_size: int = 64
    device: str = "cpu"

    def __post_init__(self) -> None:
        check_choice("kind", self.kind, PROBE_KINDS)
        check_positive_int("max_epochs", self.max_epochs)
        check_positive_int("patience", self.patience)
        check_positive_int("batch_size", self.batch_size)
        check_positive_finite("learning_rate", self.learning_rate)
        self.best_epoch: int | None = None

    def fit(self, train_x: ArrayLike, train_y: ArrayLike, val_x: ArrayLike, val_y: ArrayLike) -> Probe:
        x, xv = as_numpy(train_x, "train_x"), as_numpy(val_x, "val_x")
        y, yv = as_labels(train_y, len(x), "train_y"), as_labels(val_y, len(xv), "val_y")
        if x.shape[1] != xv.shape[1]:
            raise ValueError(f"train_x has {x.shape[1]} features but val_x has {xv.shape[1]}")
        self.n_classes = int(max(y.max(), yv.max())) + 1
        if len(np.unique(y)) < 2:
            raise ValueError("train_y must contain at least two classes")
        self.mean, self.std = x.mean(0), x.std(0) + 1e-6
        x, xv = self._standardise(x), self._standardise(xv)
        if self.kind == "logistic":
            self._fit_logistic(x, y, xv, yv)
        else:
            self._fit_mlp(x, y, xv, yv)
        return self

    def predict_proba(self, features: ArrayLike) -> np.ndarray:
        x = self._standardise(as_numpy(features, "features"))
        if self.kind == "logistic":
            proba = np.zeros((len(x), self.n_classes))
            proba[:, self.model.classes_] = self.model.predict_proba(x)
            return proba
        with torch.no_grad():
            logits = self.model(torch.from_numpy(x).to(self.device))
        return torch.softmax(logits, dim=-1).cpu().numpy().astype(np.float64)

    def _standardise(self, x: np.ndarray) -> np.ndarray:
        return ((x - self.mean) / self.std).astype(np.float32)

    def _fit_logistic(self, x: np.ndarray, y: np.ndarray, xv: np.ndarray, yv: np.ndarray) -> None:
        """Choose the inverse regularisation C by validation log-loss."""
        fits = []
        for c in (0.001, 0.01, 0.1, 1.0, 10.0):
            model = LogisticRegression(C=c, max_iter=2000, random_state=self.seed).fit(x, y)
            proba = np.zeros((len(xv), self.n_classes))
            proba[:, model.classes_] = model.predict_proba(xv)
            fits.append((float(-np.log(np.clip(proba[np.arange(len(yv)), yv], 1e-12, 1)).mean()), model))
        self.model = min(fits, key=lambda fit: fit[0])[1]  # the first of equals, as a strict "<" scan

    def _fit_mlp(self, x: np.ndarray, y: np.ndarray, xv: np.ndarray, yv: np.ndarray) -> None:
        """Adam on cross-entropy; keep the weights of the best validation loss; stop after ``patience``."""
        generator = torch.Generator().manual_seed(self.seed)
        model = TwoLayerProbe(x.shape[1], self.n_classes, generator=generator).to(self.device)
        optimiser = torch.optim.Adam(model.parameters(), lr=self.learning_rate)
        xt, yt = torch.from_numpy(x).to(self.device), torch.from_numpy(y).to(self.device)
        xvt, yvt = torch.from_numpy(xv).to(self.device), torch.from_numpy(yv).to(self.device)
        best_loss, best_state, since_best = math.inf, copy.deepcopy(model.state_dict()), 0
        for epoch in range(self.max_epochs):
            model.train()
            for batch in torch.randperm(len(xt), generator=generator).split(self.batch_size):
                loss = nn.functional.cross_entropy(model(xt[batch]), yt[batch])
                optimiser.zero_grad()
                loss.backward()
                optimiser.step()
            model.eval()
            with torch.no_grad():
                val_loss = nn.functional.cross_entropy(model(xvt), yvt).item()
            if val_loss < best_loss - 1e-6:
                best_loss, best_state, since_best = val_loss, copy.deepcopy(model.state_dict()), 0
                self.best_epoch = epoch
            else:
                since_best += 1
                if since_best >= self.patience:
                    break
        model.load_state_dict(best_state)
        self.model = model.eval()


def evaluate_probe(
    train: tuple[ArrayLike, ArrayLike],
    validation: tuple[ArrayLike, ArrayLike],
    test: tuple[ArrayLike, ArrayLike],
    *,
    kind: ProbeKind = "mlp",
    seed: int = 0,
    **probe_options: Any,
) -> ProbeResult:
    """Fit on train, select on validation, then score the test split once; ``probe_options`` go to :class:`Probe`."""
    probe = Probe(kind=kind, seed=seed, **probe_options).fit(*train, *validation)
    val = classification_metrics(as_labels(validation[1], len(as_numpy(validation[0], "val_x")), "val_y"),
                                 probe.predict_proba(validation[0]))
    test_x = as_numpy(test[0], "test_x")
    scores = classification_metrics(as_labels(test[1], len(test_x), "test_y"), probe.predict_proba(test_x))
    return ProbeResult(kind=kind, accuracy=scores["accuracy"], auc=scores["auc"],
                       validation_accuracy=val["accuracy"], validation_auc=val["auc"], best_epoch=probe.best_epoch,
                       n_train=len(as_numpy(train[0], "train_x")), n_validation=len(as_numpy(validation[0], "val_x")),
                       n_test=len(test_x))
