import pytest
from typer.testing import CliRunner

from privlm.cli import app
from privlm.demo import inversion_at, similarity_utility
from privlm.mechanisms import make_generator

runner = CliRunner()


def test_models_lists_the_packaged_defaults():
    result = runner.invoke(app, ["models"])
    assert result.exit_code == 0
    assert "minilm" in result.output and "smollm2" in result.output


@pytest.mark.slow
def test_demo_runs_and_shows_both_regimes():
    result = runner.invoke(app, ["demo", "--seed", "3"])
    assert result.exit_code == 0, result.output
    assert "NN inversion" in result.output and "bucketized EM" in result.output


@pytest.mark.slow
def test_nearest_neighbour_attack_fails_at_strong_and_succeeds_at_weak_eta(minilm):
    sentence = "The quick brown fox jumps over the lazy dog near the river bank."
    generator = make_generator(11)
    strong = [inversion_at(minilm, sentence, 20.0, generator).success_rate for _ in range(5)]
    weak = inversion_at(minilm, sentence, 400.0, generator)
    assert sum(strong) / len(strong) < 0.2
    assert weak.success_rate == 1.0
    assert weak.cosine_to_clean > 0.3


@pytest.mark.slow
def test_similarity_utility_is_normalised_per_token(minilm):
    import torch

    utility = similarity_utility(minilm, torch.tensor([2023, 2154]))
    assert utility.shape == (2, minilm.vocab_size)
    assert torch.allclose(utility.max(dim=-1).values, torch.ones(2))
    assert torch.allclose(utility.min(dim=-1).values, torch.zeros(2))
    assert utility[0, 2023] == 1.0  # a token is most similar to itself
