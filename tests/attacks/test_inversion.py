import pytest
import torch
from scipy import stats

from privlm.attacks import knn_attack, nearest_neighbour_inversion, retention_ratio, token_id_inversion
from tests.conftest import P_THRESHOLD

V, D = 1000, 16


@pytest.fixture
def vocab(generator):
    return torch.randn(V, D, generator=generator)


def test_no_noise_gives_full_inversion(vocab, generator):
    true_ids = torch.randint(0, V, (4, 25), generator=generator)
    result = nearest_neighbour_inversion(vocab[true_ids], true_ids, vocab)
    assert (result.successes, result.trials) == (100, 100)
    assert result.rate == 1.0 and result.empirical_privacy == 0.0
    assert result.chance == 1 / V
    assert result.details["rank_counts"] == [100]


def test_pure_noise_gives_chance_level(vocab, generator):
    """Vectors unrelated to the true ids: P(hit) = 1/V exactly when the true ids are uniform."""
    n = 5000
    true_ids = torch.randint(0, V, (n,), generator=generator)
    privatized = 50 * torch.randn(n, D, generator=generator)
    result = nearest_neighbour_inversion(privatized, true_ids, vocab)
    assert result.rate < 0.005
    assert stats.binomtest(result.successes, n, 1 / V).pvalue > P_THRESHOLD
    top10 = knn_attack(privatized, true_ids, vocab)
    assert top10.chance == 10 / V
    assert stats.binomtest(top10.successes, n, 10 / V).pvalue > P_THRESHOLD


def test_top_k_hits_are_nested_and_rates_grow_with_k(vocab, generator):
    true_ids = torch.randint(0, V, (2000,), generator=generator)
    privatized = vocab[true_ids] + 1.2 * torch.randn(2000, D, generator=generator)
    rates = [nearest_neighbour_inversion(privatized, true_ids, vocab, k=k).rate for k in (1, 5, 10)]
    knn = knn_attack(privatized, true_ids, vocab)
    assert knn.name == "knn-top10" and knn.details["k"] == 10
    assert knn.rate == rates[2]
    assert 0.05 < rates[0] < rates[1] < rates[2] < 1.0
    counts = knn.details["rank_counts"]
    assert len(counts) == 10 and sum(counts) == knn.successes
    assert counts[0] == nearest_neighbour_inversion(privatized, true_ids, vocab).successes


def test_mask_selects_the_positions_that_count(vocab, generator):
    true_ids = torch.randint(0, V, (3, 10), generator=generator)
    privatized = vocab[true_ids].clone()
    noisy = torch.zeros(3, 10, dtype=torch.bool)
    noisy[:, 7:] = True  # e.g. padding: garbage vectors that must not count
    privatized[noisy] = 100 * torch.randn(int(noisy.sum()), D, generator=generator)
    result = nearest_neighbour_inversion(privatized, true_ids, vocab, mask=~noisy)
    assert (result.successes, result.trials) == (21, 21)
    assert nearest_neighbour_inversion(privatized, true_ids, vocab).trials == 30


def test_chunk_size_does_not_change_the_result(vocab, generator):
    true_ids = torch.randint(0, V, (300,), generator=generator)
    privatized = vocab[true_ids] + torch.randn(300, D, generator=generator)
    results = {nearest_neighbour_inversion(privatized, true_ids, vocab, k=3, chunk_size=c).successes
               for c in (1, 17, 4096)}
    assert len(results) == 1


def test_token_id_inversion(vocab, generator):
    true_ids = torch.randint(0, V, (500,), generator=generator)
    assert token_id_inversion(true_ids, true_ids, vocab).rate == 1.0
    # Release the true token's nearest other row half of the time, a random token otherwise.
    distances = torch.cdist(vocab, vocab)
    second = distances.topk(2, largest=False).indices[:, 1]
    use_neighbour = torch.rand(500, generator=generator) < 0.5
    released = torch.where(use_neighbour, second[true_ids], torch.randint(0, V, (500,), generator=generator))
    top1 = token_id_inversion(released, true_ids, vocab)
    top10 = token_id_inversion(released, true_ids, vocab, k=10)
    assert top1.rate == pytest.approx(retention_ratio(true_ids, released))  # k = 1: the released token itself
    brute = (distances[released].topk(10, largest=False).indices == true_ids[:, None]).any(dim=-1)
    assert top10.successes == int(brute.sum())
    assert top10.rate > 0.3 > top1.rate
    assert top10.name == "token-id-inversion-top10"


def test_token_id_inversion_in_the_neighbour_set_is_exact(generator):
    """On a line, token i's 3 nearest rows are i and its two neighbours."""
    vocab = torch.arange(50, dtype=torch.float32).unsqueeze(-1)
    true_ids = torch.arange(1, 45)
    assert token_id_inversion(true_ids + 1, true_ids, vocab, k=3).rate == 1.0
    assert token_id_inversion(true_ids + 1, true_ids, vocab, k=1).rate == 0.0
    assert token_id_inversion(true_ids + 2, true_ids, vocab, k=3).rate == 0.0


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"true_ids": torch.zeros(4, dtype=torch.long)}, "true_ids"),
    ({"true_ids": torch.zeros(3)}, "true_ids"),
    ({"true_ids": torch.full((3,), V)}, "true_ids"),
    ({"true_ids": torch.full((3,), -1)}, "true_ids"),
    ({"k": 0}, "k"),
    ({"k": V + 1}, "k"),
    ({"k": 1.5}, "k"),
    ({"mask": torch.ones(3)}, "mask"),
    ({"mask": torch.ones(4, dtype=torch.bool)}, "mask"),
    ({"mask": torch.zeros(3, dtype=torch.bool)}, "mask"),
    ({"privatized": torch.zeros(3, D + 1)}, "dimension"),
    ({"privatized": torch.zeros(3, D, dtype=torch.long)}, "privatized"),
    ({"privatized": torch.full((3, D), float("nan"))}, "privatized"),
    ({"vocabulary": torch.zeros(V)}, "vocabulary"),
    ({"chunk_size": 0}, "chunk_size"),
])
def test_bad_inputs_are_rejected_by_name(kwargs, match):
    arguments = {"privatized": torch.zeros(3, D), "true_ids": torch.zeros(3, dtype=torch.long),
                 "vocabulary": torch.randn(V, D)}
    arguments.update(kwargs)
    privatized, true_ids, vocabulary = (arguments.pop(key) for key in ("privatized", "true_ids", "vocabulary"))
    with pytest.raises(ValueError, match=match):
        nearest_neighbour_inversion(privatized, true_ids, vocabulary, **arguments)


def test_token_id_inversion_rejects_bad_ids():
    vocab = torch.randn(10, 4)
    with pytest.raises(ValueError, match="released_ids"):
        token_id_inversion(torch.tensor([10]), torch.tensor([1]), vocab)
    with pytest.raises(ValueError, match="released_ids"):
        token_id_inversion(torch.tensor([1.0]), torch.tensor([1]), vocab)
    with pytest.raises(ValueError, match="true_ids"):
        token_id_inversion(torch.tensor([1, 2]), torch.tensor([1]), vocab)


@pytest.mark.slow
def test_minilm_vocabulary_has_no_duplicate_rows_and_inverts_exactly(minilm, generator):
    vocab = minilm.embedding_matrix
    assert torch.unique(vocab, dim=0).shape[0] == vocab.shape[0]  # so 100% inversion without noise is possible
    true_ids = torch.randint(0, vocab.shape[0], (2000,), generator=generator)
    assert nearest_neighbour_inversion(vocab[true_ids], true_ids, vocab).rate == 1.0


def test_undo_clip_scale_restores_the_noisy_norm():
    from privlm.attacks import undo_clip_scale
    from privlm.mechanisms import clip_to_norm, make_generator, sample_dchi_noise

    vocabulary = torch.randn(500, 64, generator=torch.Generator().manual_seed(0)) * 0.2
    x = vocabulary[:200]
    noisy = x + sample_dchi_noise(x.shape, eta=10.0, generator=make_generator(1))
    clipped = clip_to_norm(noisy, max_norm=2.0)
    restored = undo_clip_scale(clipped, eta=10.0, clip_norm=2.0, vocabulary=vocabulary)
    ratio = restored.norm(dim=-1) / noisy.norm(dim=-1)
    assert abs(ratio.mean().item() - 1) < 0.05
    torch.testing.assert_close(torch.nn.functional.normalize(restored, dim=-1),
                               torch.nn.functional.normalize(noisy, dim=-1))
