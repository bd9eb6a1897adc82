import numpy as np
import pytest
import torch
from scipy import stats

from privlm.attacks import AttributeInferenceConfig, attribute_inference, pool_representations
from tests.conftest import P_THRESHOLD


def _split(x, y, n_train):
    return x[:n_train], y[:n_train], x[n_train:], y[n_train:]


@pytest.mark.parametrize("classifier", ["logistic", "mlp"])
def test_representation_that_encodes_the_label_is_fully_attacked(classifier):
    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, 600)
    x = rng.normal(0, 1, (600, 8))
    x[:, 0] += 4 * (2 * y - 1)  # the label sits in one coordinate
    result = attribute_inference(*_split(x, y, 400), seed=1, config=AttributeInferenceConfig(classifier=classifier))
    assert result.trials == 200
    assert result.rate > 0.9
    assert result.details["auc"] > 0.98
    assert result.name == f"attribute-inference-{classifier}"
    assert isinstance(result.details["seconds"], float) and result.details["seconds"] >= 0  # its own cost


def test_pure_noise_gives_the_majority_rate():
    rng = np.random.default_rng(1)
    y = (rng.random(1500) < 0.7).astype(int)  # 70% class 1
    x = rng.normal(0, 1, (1500, 10))
    result = attribute_inference(*_split(x, y, 1000))
    train_majority = 1
    assert result.chance == pytest.approx(float((y[1000:] == train_majority).mean()))
    assert abs(result.rate - result.chance) < 0.05
    assert stats.binomtest(result.successes, result.trials, result.chance).pvalue > P_THRESHOLD
    assert abs(result.details["auc"] - 0.5) < 0.1
    assert result.details["train_majority_class"] == 1


def test_multiclass_labels_and_macro_auc():
    rng = np.random.default_rng(2)
    y = rng.choice(np.array(["a", "b", "c"]), 900)
    centres = {"a": [3, 0], "b": [0, 3], "c": [-3, -3]}
    x = np.array([centres[label] for label in y]) + rng.normal(0, 1, (900, 2))
    result = attribute_inference(*_split(x, y, 600))
    assert result.rate > 0.9
    assert 0.95 < result.details["auc"] <= 1.0
    assert result.details["n_classes"] == 3


def test_masked_mean_pooling_of_token_sequences(generator):
    n, length, d = 300, 6, 4
    y = torch.randint(0, 2, (n,), generator=generator)
    x = torch.randn(n, length, d, generator=generator)
    lengths = torch.randint(2, length + 1, (n,), generator=generator)
    mask = torch.arange(length) < lengths[:, None]
    x[..., 0] += 3 * (2 * y[:, None] - 1).float()
    x[~mask] = 1000 * torch.randn(int((~mask).sum()), d, generator=generator)  # padding garbage
    pooled = pool_representations(x, mask)
    expected = torch.stack([x[i, :lengths[i]].mean(dim=0) for i in range(n)]).double().numpy()
    np.testing.assert_allclose(pooled, expected, atol=1e-5)
    with_mask = attribute_inference(x[:200], y[:200], x[200:], y[200:], train_mask=mask[:200], test_mask=mask[200:])
    without = attribute_inference(x[:200], y[:200], x[200:], y[200:])
    assert with_mask.rate > 0.95
    assert without.rate < with_mask.rate


def test_results_are_reproducible_with_a_seed():
    rng = np.random.default_rng(3)
    x, y = rng.normal(0, 1, (300, 5)), rng.integers(0, 2, 300)
    x[:, 1] += y
    mlp = AttributeInferenceConfig(classifier="mlp")
    first = attribute_inference(*_split(x, y, 200), seed=5, config=mlp)
    second = attribute_inference(*_split(x, y, 200), seed=5, config=mlp)
    assert (first.successes, first.details["auc"]) == (second.successes, second.details["auc"])


def test_auc_is_none_when_the_test_split_has_one_class():
    rng = np.random.default_rng(4)
    x, y = rng.normal(0, 1, (100, 3)), np.array([0, 1] * 40 + [1] * 20)
    assert attribute_inference(*_split(x, y, 80)).details["auc"] is None


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"config": AttributeInferenceConfig(classifier="svm")}, "classifier"),
    ({"test_x": np.zeros((10, 4))}, "test_x"),
    ({"train_y": np.zeros(9)}, "train_y"),
    ({"train_y": np.zeros(20)}, "train_y"),
    ({"test_y": np.zeros((10, 1))}, "test_y"),
    ({"train_x": np.zeros((20, 3)) * np.nan}, "train_x"),
    ({"train_x": np.zeros(20)}, "train_x"),
    ({"train_mask": np.ones((20, 3))}, "train_x"),
    ({"seed": -1}, "seed"),
    ({"config": AttributeInferenceConfig(hidden_size=0)}, "hidden_size"),
])
def test_bad_inputs_are_rejected_by_name(kwargs, match):
    rng = np.random.default_rng(0)
    arguments = {"train_x": rng.normal(0, 1, (20, 3)), "train_y": np.arange(20) % 2,
                 "test_x": rng.normal(0, 1, (10, 3)), "test_y": np.arange(10) % 2}
    arguments.update(kwargs)
    data = [arguments.pop(key) for key in ("train_x", "train_y", "test_x", "test_y")]
    with pytest.raises(ValueError, match=match):
        attribute_inference(*data, **arguments)
