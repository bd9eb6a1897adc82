import itertools

import numpy as np
import pytest
import torch

from privlm.attacks import effective_mapping_set_size, lcs_length, retention_ratio, rouge_l_f1, token_accuracy
from privlm.attacks.text_metrics import rouge_words


def _brute_force_lcs(a, b):
    """Longest common subsequence by enumerating the subsequences of the shorter sequence."""
    short, long_ = (a, b) if len(a) <= len(b) else (b, a)
    for size in range(len(short), 0, -1):
        for combo in itertools.combinations(short, size):
            it = iter(long_)
            if all(token in it for token in combo):
                return size
    return 0


def test_lcs_of_handworked_examples():
    assert lcs_length(list("ABCBDAB"), list("BDCABA")) == 4  # "BCBA" (CLRS)
    assert lcs_length(list("AGGTAB"), list("GXTXAYB")) == 4  # "GTAB"
    assert lcs_length([1, 2, 3], [4, 5]) == 0
    assert lcs_length([], [1]) == 0


def test_lcs_matches_brute_force():
    rng = np.random.default_rng(5)
    for _ in range(60):
        a = rng.integers(0, 4, size=rng.integers(0, 9)).tolist()
        b = rng.integers(0, 4, size=rng.integers(0, 9)).tolist()
        assert lcs_length(a, b) == _brute_force_lcs(a, b), (a, b)


def test_rouge_l_f1_handworked():
    reference = ["the", "cat", "sat", "on", "the", "mat"]
    # LCS = 5 ("the cat on the mat"): P = 5/5, R = 5/6, F1 = 2PR / (P + R) = 10/11
    assert rouge_l_f1(reference, ["the", "cat", "on", "the", "mat"]) == pytest.approx(10 / 11)
    # LCS = 2 ("the mat"): P = 2/3, R = 2/6, F1 = 4/9
    assert rouge_l_f1(reference, ["the", "big", "mat"]) == pytest.approx(4 / 9)
    assert rouge_l_f1(reference, reference) == 1.0
    assert rouge_l_f1(reference, ["dog"]) == 0.0
    assert rouge_l_f1([], []) == 1.0
    assert rouge_l_f1([], ["a"]) == 0.0


def test_rouge_l_f1_is_symmetric_and_accepts_tensors():
    a, b = [5, 1, 2, 7, 3], [1, 9, 2, 3]
    assert rouge_l_f1(a, b) == pytest.approx(rouge_l_f1(b, a))
    assert rouge_l_f1(torch.tensor(a), np.array(b)) == pytest.approx(rouge_l_f1(a, b))


def test_rouge_l_rejects_non_sequences():
    with pytest.raises(ValueError, match="reference"):
        rouge_l_f1("a string", ["a"])
    with pytest.raises(ValueError, match="hypothesis"):
        rouge_l_f1(["a"], torch.zeros(2, 2))


def test_token_accuracy_and_retention_ratio():
    original = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    released = torch.tensor([[1, 9, 3, 9], [5, 6, 9, 9]])
    assert token_accuracy(original, released) == 4 / 8
    assert retention_ratio(original, released) == 4 / 8
    mask = torch.tensor([[True, True, True, False], [True, True, False, False]])
    assert retention_ratio(original, released, mask=mask) == 4 / 5
    assert retention_ratio([[1, 2], [3, 4]], [[1, 2], [3, 0]]) == 3 / 4
    assert token_accuracy(list("abc"), list("abd")) == pytest.approx(2 / 3)


@pytest.mark.parametrize(("b", "mask", "match"), [
    (torch.tensor([1, 2]), None, "released_ids"),
    (torch.tensor([1, 2, 3]), torch.tensor([1, 0, 1]), "mask"),
    (torch.tensor([1, 2, 3]), torch.zeros(3, dtype=torch.bool), "mask"),
])
def test_retention_ratio_rejects_bad_input(b, mask, match):
    with pytest.raises(ValueError, match=match):
        retention_ratio(torch.tensor([1, 2, 3]), b, mask=mask)


def test_effective_mapping_set_size_from_a_sampler_and_from_samples():
    rng = np.random.default_rng(0)
    calls = []

    def sampler(n):
        calls.append(n)
        return rng.integers(0, 5, size=n)  # 5 possible outputs; all appear in 1000 draws

    assert effective_mapping_set_size(sampler) == 5
    assert calls == [1000]
    assert effective_mapping_set_size(lambda n: [7] * n) == 1
    assert effective_mapping_set_size([3, 3, 4, 9]) == 3
    assert effective_mapping_set_size(torch.tensor([1, 1, 2])) == 2
    assert effective_mapping_set_size(lambda n: torch.arange(n), n=50) == 50


def test_effective_mapping_set_size_rejects_bad_input():
    with pytest.raises(ValueError, match="n="):
        effective_mapping_set_size(lambda n: [1, 2])
    with pytest.raises(ValueError, match="n"):
        effective_mapping_set_size(lambda n: [1] * n, n=0)
    with pytest.raises(ValueError, match="samples"):
        effective_mapping_set_size([])


def test_rouge_words_are_rouge_scores_tokenisation():
    assert rouge_words("Ask for Maria Novak, @United's 4068-6580!") == ["ask", "for", "maria", "novak", "united", "s",
                                                                         "4068", "6580"]
    assert rouge_words(" ,!? ") == []
