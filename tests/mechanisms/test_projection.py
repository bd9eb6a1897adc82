import pytest
import torch

from privlm.mechanisms import nearest_neighbours, project_to_vocabulary


def test_matches_brute_force_cdist(generator):
    vocab = torch.randn(500, 16, generator=generator, dtype=torch.float64)
    queries = torch.randn(3, 70, 16, generator=generator, dtype=torch.float64)
    ids, dists = nearest_neighbours(queries, vocab, k=5, chunk_size=13)
    full = torch.cdist(queries.reshape(-1, 16), vocab)
    expected_d, expected_ids = full.topk(5, largest=False)
    assert ids.shape == (3, 70, 5)
    assert torch.equal(ids.reshape(-1, 5), expected_ids)
    torch.testing.assert_close(dists.reshape(-1, 5), expected_d)
    assert (dists[..., 1:] >= dists[..., :-1]).all()  # nearest first


def test_chunk_size_does_not_change_the_answer(generator):
    vocab = torch.randn(300, 8, generator=generator)
    queries = torch.randn(101, 8, generator=generator)
    reference = project_to_vocabulary(queries, vocab, chunk_size=1000)
    for chunk in (1, 7, 100):
        assert torch.equal(project_to_vocabulary(queries, vocab, chunk_size=chunk), reference)


def test_a_tie_goes_to_the_lowest_id():
    vocab = torch.tensor([[0.0, 0.0], [1.0, 0.0], [1.0, 0.0], [2.0, 0.0]])  # rows 1 and 2 are the same point
    queries = torch.tensor([[1.0, 0.0], [0.5, 0.0], [1.5, 0.0], [1.0, 5.0]])  # on 1 = 2; 0 | 1 = 2; 1 = 2 | 3; 1 = 2
    for chunk in (1, 4):
        assert project_to_vocabulary(queries, vocab, chunk_size=chunk).tolist() == [1, 0, 1, 1]
    norms = vocab.pow(2).sum(dim=-1)
    assert project_to_vocabulary(queries, vocab, vocabulary_sq_norms=norms).tolist() == [1, 0, 1, 1]


def test_vocabulary_rows_project_to_themselves(generator):
    vocab = torch.randn(1000, 32, generator=generator)
    assert torch.equal(project_to_vocabulary(vocab, vocab), torch.arange(1000))


def test_bad_inputs_are_rejected_by_name():
    vocab = torch.randn(10, 4)
    with pytest.raises(ValueError, match="dimension"):
        nearest_neighbours(torch.randn(2, 3), vocab)
    with pytest.raises(ValueError, match="k"):
        nearest_neighbours(torch.randn(2, 4), vocab, k=11)
    with pytest.raises(ValueError, match="chunk_size"):
        nearest_neighbours(torch.randn(2, 4), vocab, chunk_size=0)
    with pytest.raises(ValueError, match="vocabulary"):
        nearest_neighbours(torch.randn(2, 4), torch.randn(10))
    with pytest.raises(ValueError, match="queries"):
        nearest_neighbours(torch.full((2, 4), float("nan")), vocab)
