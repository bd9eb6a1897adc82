import math

import numpy as np
import pytest
import torch
from sklearn.metrics import roc_auc_score

from privlm_bench.harness.probes import (
    Probe,
    classification_metrics,
    embedding_agreement,
    evaluate_probe,
    pair_features,
)


def _splits(rng: np.random.Generator, dim: int = 16, classes: int = 2, sizes=(600, 200, 400)):
    """Gaussian blobs around shared class centres, split three ways."""
    centres = rng.normal(size=(classes, dim)) * 3
    splits = []
    for n in sizes:
        y = rng.integers(0, classes, size=n)
        splits.append(((centres[y] + rng.normal(size=(n, dim))).astype(np.float32), y))
    return splits


@pytest.mark.parametrize("kind", ["mlp", "logistic"])
def test_separable_data_is_learned(kind):
    result = evaluate_probe(*_splits(np.random.default_rng(0)), kind=kind)
    assert result.accuracy > 0.95 and result.auc > 0.98
    assert (result.n_train, result.n_validation, result.n_test) == (600, 200, 400)


@pytest.mark.parametrize("kind", ["mlp", "logistic"])
def test_pure_noise_gives_chance(kind):
    rng = np.random.default_rng(1)
    splits = [(rng.normal(size=(n, 16)).astype(np.float32), rng.integers(0, 2, size=n)) for n in (600, 200, 2000)]
    result = evaluate_probe(*splits, kind=kind)
    assert abs(result.auc - 0.5) < 0.06


def test_multiclass_auc_is_macro_one_vs_rest():
    rng = np.random.default_rng(2)
    y = rng.integers(0, 3, size=300)
    proba = rng.dirichlet(np.ones(3), size=300)
    expected = roc_auc_score(y, proba, multi_class="ovr", average="macro")
    assert classification_metrics(y, proba)["auc"] == pytest.approx(expected)
    # AUC uses probabilities, not argmax labels: a monotone score beats its own argmax.
    binary_y = np.array([0, 0, 1, 1])
    binary_p = np.array([[0.9, 0.1], [0.6, 0.4], [0.55, 0.45], [0.2, 0.8]])
    metrics = classification_metrics(binary_y, binary_p)
    assert metrics["auc"] == 1.0 and metrics["accuracy"] == 0.75


def test_fit_is_reproducible_and_stops_early_on_validation():
    rng = np.random.default_rng(3)  # random labels: the validation loss soon rises, so training stops
    train, val, test = [(rng.normal(size=(n, 16)).astype(np.float32), rng.integers(0, 2, size=n))
                        for n in (60, 200, 50)]
    probe_a = Probe(kind="mlp", seed=5, patience=5).fit(*train, *val)
    probe_b = Probe(kind="mlp", seed=5, patience=5).fit(*train, *val)
    np.testing.assert_allclose(probe_a.predict_proba(test[0]), probe_b.predict_proba(test[0]))
    assert probe_a.best_epoch is not None and probe_a.best_epoch < probe_a.max_epochs - 5


def test_mlp_shape_follows_the_paper():
    train, val = _splits(np.random.default_rng(4), dim=8, sizes=(100, 50))
    probe = Probe(kind="mlp").fit(*train, *val)
    layers = [m for m in probe.model.modules() if isinstance(m, torch.nn.Linear)]
    assert [(layer.in_features, layer.out_features) for layer in layers] == [(8, 8), (8, 2)]
    assert any(isinstance(m, torch.nn.ReLU) for m in probe.model.modules())


def test_pair_features_concatenate():
    a, b = np.ones((3, 4)), np.zeros((3, 4))
    assert pair_features(a, b).shape == (3, 8)
    with pytest.raises(ValueError, match="same shape"):
        pair_features(a, np.zeros((2, 4)))


def test_embedding_agreement():
    a = np.array([[1.0, 0.0], [0.0, 2.0]])
    b = np.array([[1.0, 0.0], [0.0, -2.0]])
    result = embedding_agreement(a, b)
    assert result["cosine"] == pytest.approx(0.0)
    assert result["mse"] == pytest.approx(16 / 4)


def test_single_class_test_split_has_undefined_auc():
    assert math.isnan(classification_metrics(np.array([1, 1]), np.array([[0.2, 0.8], [0.4, 0.6]]))["auc"])


def test_bad_inputs_are_rejected_by_name():
    ((x, y),) = _splits(np.random.default_rng(6), sizes=(50,))
    with pytest.raises(ValueError, match="kind"):
        Probe(kind="svm")
    with pytest.raises(ValueError, match="learning_rate"):
        Probe(learning_rate=float("nan"))
    with pytest.raises(ValueError, match="train_x"):
        Probe().fit(np.full((50, 16), np.nan), y, x, y)
    with pytest.raises(ValueError, match="train_y"):
        Probe().fit(x, y[:10], x, y)
    with pytest.raises(ValueError, match="two classes"):
        Probe().fit(x, np.zeros(50, dtype=int), x, y)
