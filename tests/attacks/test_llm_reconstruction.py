"""The LM reconstruction attack: its ranking is the whole-sequence log-likelihood, the released token is always a
candidate, and on SmolLM2 it restores text that was left as it is and names the context makes likely."""

from __future__ import annotations

import pytest
import torch

from privlm.attacks import llm_reconstruction, rank_candidates
from tests.models.tiny import tiny_causal_lm, tiny_model


def test_the_ranking_is_the_whole_sequence_log_likelihood_and_keeps_the_released_token():
    lm = tiny_causal_lm()
    sequence = lm.tokenizer("the cat sat on the mat w5 w6", add_special_tokens=False)["input_ids"]
    ids, scores = rank_candidates(lm.model, sequence, [1, 6], start_id=2, excluded=frozenset({0, 1, 2, 3, 4}),
                                  shortlist=8)
    assert ids.shape == scores.shape == (2, 8)
    assert (scores[:, :-1] >= scores[:, 1:]).all()  # best first
    for row, i in enumerate([1, 6]):
        assert sequence[i] in ids[row].tolist()  # the released token is always a candidate
        assert not set(ids[row].tolist()) & {0, 1, 2, 3, 4}  # no special token is guessed
        for y, score in zip(ids[row].tolist(), scores[row].tolist(), strict=True):
            with torch.no_grad():
                row_ids = torch.tensor([[2, *sequence[:i], y, *sequence[i + 1:]]])
                log_p = lm.model(input_ids=row_ids).logits[0, :-1].log_softmax(-1)
            expected = log_p.gather(-1, row_ids[0, 1:, None]).sum()
            assert score == pytest.approx(float(expected), abs=1e-4)


def _whole_rows(model: torch.nn.Module, rows: torch.Tensor) -> torch.Tensor:
    """The reference: sum_t log p(s_t | s_<t) of each whole row s, from scratch (no cache), in one pass."""
    with torch.no_grad():
        log_p = model(input_ids=rows).logits[:, :-1].log_softmax(-1)
    return log_p.gather(-1, rows[:, 1:, None]).squeeze(-1).sum(-1)


@pytest.mark.parametrize("family", ["llama", "gpt2"])  # rotary and learned absolute positions
def test_the_scores_reusing_the_prefix_cache_equal_whole_rows_scored_from_scratch(family):
    """rank_candidates scores a candidate's right context on the key/value cache of its left context: the score is
    still the log-likelihood of the whole row, at the first, middle, next-to-last and last positions, whether the
    released token is a candidate or not and however the rows are split into passes."""
    model = tiny_causal_lm().model if family == "llama" else tiny_model("gpt2")
    sequence, positions, special = [5, 6, 7, 8, 5, 9, 40, 41], [0, 1, 4, 6, 7], frozenset({0, 1, 2, 3, 4})
    for include_released, max_batch_tokens in [(True, 4096), (True, 1), (False, 4096)]:
        ids, scores = rank_candidates(model, sequence, positions, start_id=2, excluded=special, shortlist=6,
                                      include_released=include_released, max_batch_tokens=max_batch_tokens)
        assert ids.shape == scores.shape == (len(positions), 6)
        rows = torch.tensor([2, *sequence]).repeat(ids.numel(), 1)
        rows[torch.arange(ids.numel()), torch.tensor(positions).repeat_interleave(6) + 1] = ids.reshape(-1)
        expected = _whole_rows(model, rows).reshape(ids.shape)
        torch.testing.assert_close(scores, expected, atol=1e-4, rtol=0)
        assert (expected[:, :-1] >= expected[:, 1:] - 1e-4).all()  # best first by the reference too


def test_refusals():
    lm = tiny_causal_lm()
    with pytest.raises(ValueError, match="top"):
        llm_reconstruction([[5, 6]], [[5, 6]], [[1]], lm.model, start_id=2, shortlist=4, top=10)
    with pytest.raises(ValueError, match="tokens"):
        llm_reconstruction([[5, 6]], [[5]], [[0]], lm.model, start_id=2)


def test_on_smollm2_text_left_as_it_is_is_restored_and_context_names_the_missing_city(smollm2_lm):
    tokenizer = smollm2_lm.tokenizer
    text = "The capital of France is Paris, and the capital of Italy is Rome."
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    city = next(i for i, t in enumerate(ids) if tokenizer.decode([t]).strip() == "Paris")
    attacked = [1, 3, city, len(ids) - 2]  # capital, France, Paris, Rome
    common = {"start_id": tokenizer.bos_token_id, "excluded": frozenset(tokenizer.all_special_ids), "shortlist": 16}
    kept = llm_reconstruction([ids], [ids], [attacked], smollm2_lm.model, **common)
    assert kept.top1.successes == 4  # released as they are: the released token wins on both sides' context
    noise = list(ids)
    noise[city] = tokenizer(" banana", add_special_tokens=False)["input_ids"][0]
    restored = llm_reconstruction([ids], [noise], [[city]], smollm2_lm.model, **common)
    assert restored.topk.successes == 1  # the context alone puts " Paris" among the ten best
    assert tokenizer.decode([int(restored.restored[0][0])]).strip() != "banana"
