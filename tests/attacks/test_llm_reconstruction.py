"""The LM reconstruction attack: its ranking is the whole-sequence log-likelihood, the released token is always a
candidate, and on SmolLM2 it restores text that was left as it is and names the context makes likely."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import pytest
import torch

from privlm.attacks import (
    REWRITE_INSTRUCTION,
    LLMReconstructionConfig,
    chat_rewriter,
    fit_released_log_odds,
    llm_reconstruction,
    prompt_restoration,
    rank_candidates,
    rouge_l_f1,
)
from privlm.models.chat import ChatModel, ChatRequestError, ContextLengthError
from tests.models.tiny import tiny_causal_lm, tiny_model


def test_the_ranking_is_the_whole_sequence_log_likelihood_and_keeps_the_released_token():
    lm = tiny_causal_lm()
    sequence = lm.tokenizer("the cat sat on the mat w5 w6", add_special_tokens=False)["input_ids"]
    ids, scores = rank_candidates(lm.model, sequence, [1, 6], start_id=2, excluded=frozenset({0, 1, 2, 3, 4}),
                                  config=LLMReconstructionConfig(shortlist=8))
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


def _keep_mostly(texts: Sequence[list[int]], keep: float, vocab: int, seed: int) -> tuple[list[list[int]],
                                                                                       list[list[int]]]:
    """A toy word-level mechanism: each token released as itself with probability ``keep``, else a random id."""
    generator = torch.Generator().manual_seed(seed)
    released, positions = [], []
    for text in texts:
        out = [t if float(torch.rand(1, generator=generator)) < keep
               else int(torch.randint(5, vocab, (1,), generator=generator)) for t in text]
        released.append(out)
        positions.append(list(range(len(text))))
    return released, positions


def test_knowing_the_mechanism_beats_the_lm_alone_when_the_release_keeps_most_tokens():
    """Fitted on the attacker's own releases, the released token's log-odds make the attack at least as good as
    reading the release, on fresh releases of the same law; the LM alone (b = 0, a random tiny model) is not."""
    lm = tiny_causal_lm()
    vocab = lm.model.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    texts = [torch.randint(5, vocab, (12,), generator=generator).tolist() for _ in range(16)]
    own, own_positions = _keep_mostly(texts[:8], 0.8, vocab, seed=1)
    kwargs = {"start_id": 2, "excluded": frozenset({0, 1, 2, 3, 4})}
    config = LLMReconstructionConfig(shortlist=8, top=1)
    b = fit_released_log_odds(texts[:8], own, own_positions, lm.model, **kwargs, config=config)
    assert b > 0
    fresh, positions = _keep_mostly(texts[8:], 0.8, vocab, seed=2)
    aware = llm_reconstruction(texts[8:], fresh, positions, lm.model, **kwargs,
                               config=replace(config, released_log_odds=b))
    alone = llm_reconstruction(texts[8:], fresh, positions, lm.model, **kwargs, config=config)
    kept = sum(r == t for f, x in zip(fresh, texts[8:], strict=True) for r, t in zip(f, x, strict=True))
    assert aware.top1.name == "llm-reconstruction-aware-top1" and alone.top1.name == "llm-reconstruction-top1"
    assert aware.top1.successes >= kept  # at least the retention
    assert aware.top1.ci_low > alone.top1.ci_high
    reading = llm_reconstruction(texts[8:], fresh, positions, lm.model, **kwargs,
                                 config=replace(config, released_log_odds=1e4))
    assert reading.top1.successes == kept  # b = +inf reads the release as it is
    with pytest.raises(ValueError, match="grid"):
        fit_released_log_odds(texts[:1], own[:1], own_positions[:1], lm.model, grid=(), **kwargs, config=config)


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
        ids, scores = rank_candidates(model, sequence, positions, start_id=2, excluded=special,
                                      include_released=include_released,
                                      config=LLMReconstructionConfig(shortlist=6, max_batch_tokens=max_batch_tokens))
        assert ids.shape == scores.shape == (len(positions), 6)
        rows = torch.tensor([2, *sequence]).repeat(ids.numel(), 1)
        rows[torch.arange(ids.numel()), torch.tensor(positions).repeat_interleave(6) + 1] = ids.reshape(-1)
        expected = _whole_rows(model, rows).reshape(ids.shape)
        torch.testing.assert_close(scores, expected, atol=1e-4, rtol=0)
        assert (expected[:, :-1] >= expected[:, 1:] - 1e-4).all()  # best first by the reference too


def test_refusals():
    lm = tiny_causal_lm()
    with pytest.raises(ValueError, match="top"):
        llm_reconstruction([[5, 6]], [[5, 6]], [[1]], lm.model, start_id=2,
                           config=LLMReconstructionConfig(shortlist=4, top=10))
    with pytest.raises(ValueError, match="tokens"):
        llm_reconstruction([[5, 6]], [[5]], [[0]], lm.model, start_id=2)


def test_on_smollm2_text_left_as_it_is_is_restored_and_context_names_the_missing_city(smollm2_lm):
    tokenizer = smollm2_lm.tokenizer
    text = "The capital of France is Paris, and the capital of Italy is Rome."
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    city = next(i for i, t in enumerate(ids) if tokenizer.decode([t]).strip() == "Paris")
    attacked = [1, 3, city, len(ids) - 2]  # capital, France, Paris, Rome
    common = {"start_id": tokenizer.bos_token_id, "excluded": frozenset(tokenizer.all_special_ids),
              "config": LLMReconstructionConfig(shortlist=16)}
    kept = llm_reconstruction([ids], [ids], [attacked], smollm2_lm.model, **common)
    assert kept.top1.successes == 4  # released as they are: the released token wins on both sides' context
    noise = list(ids)
    noise[city] = tokenizer(" banana", add_special_tokens=False)["input_ids"][0]
    restored = llm_reconstruction([ids], [noise], [[city]], smollm2_lm.model, **common)
    assert restored.topk.successes == 1  # the context alone puts " Paris" among the ten best
    assert tokenizer.decode([int(restored.restored[0][0])]).strip() != "banana"


def test_prompt_restoration_scores_each_rewrite_and_each_release_by_rouge_l_against_its_original():
    originals = ["my card is 4068 6580", "ask for maria novak", "the flight was late"]
    released = ["my hat is 1111 6580", "ask for x y", "the flight was late"]
    asked: list[str] = []

    def stub(messages: Sequence[str]) -> list[str]:  # restores the first prompt whole, the second half, the third not
        asked.extend(messages)
        texts = [m.split("\n\n", 1)[1] for m in messages]
        return [{released[0]: "My card is 4068 6580.", released[1]: "ask maria"}.get(t, "nothing here") for t in texts]

    result = prompt_restoration(originals, released, stub, seed=3)
    assert asked == [REWRITE_INSTRUCTION.replace("{text}", r) for r in released]  # the fixed instruction, filled in
    assert result.rewrites == ("My card is 4068 6580.", "ask maria", "nothing here")
    restored = [1.0, rouge_l_f1(["ask", "for", "maria", "novak"], ["ask", "maria"]), 0.0]  # 2/3: P = 1, R = 1/2
    assert restored[1] == pytest.approx(2 / 3)
    assert result.restored.mean == pytest.approx(sum(restored) / 3)
    assert result.restored.n == 3 and result.restored.ci_low <= result.restored.mean <= result.restored.ci_high
    assert result.released.mean == pytest.approx((0.6 + 0.5 + 1.0) / 3)  # LCS 3 of 5, 2 of 4, all
    assert prompt_restoration(originals, released, stub, seed=3).restored == result.restored  # seeded bootstrap
    with pytest.raises(ValueError, match="one released text per original"):
        prompt_restoration(originals, released[:2], stub)
    with pytest.raises(ValueError, match="text"):
        prompt_restoration(originals, released, stub, instruction="Rewrite it.")


def test_the_chat_rewriter_answers_what_greedy_chat_generation_answers_one_message_at_a_time():
    """Batched, left-padded decoding changes nothing: each answer is ChatModel.generate's at temperature 0."""
    chat = ChatModel(tiny_causal_lm())
    messages = [REWRITE_INSTRUCTION.replace("{text}", t) for t in ("the cat sat", "w5", "the cat sat on the mat w6")]
    alone = [chat.generate([{"role": "user", "content": m}], max_tokens=6, temperature=0.0).text for m in messages]
    assert chat_rewriter(chat, max_tokens=6, batch_size=2)(messages) == alone
    assert all(len(chat.language_model.tokenizer(a, add_special_tokens=False)["input_ids"]) <= 6 for a in alone)
    result = prompt_restoration(["the cat sat on the mat"], ["the w5 sat on the w6"], chat_rewriter(chat, max_tokens=6))
    assert 0.0 <= result.restored.mean <= 1.0 and result.released.mean == pytest.approx(4 / 6)  # LCS 4 of 6 both ways
    with pytest.raises(ValueError, match="max_tokens"):
        chat_rewriter(chat, max_tokens=0)


def test_the_chat_rewriter_refuses_what_chat_generation_refuses():
    """max_tokens must leave room for a prompt, and a prompt must leave max_tokens places: ChatModel's own checks."""
    chat = ChatModel(tiny_causal_lm())
    with pytest.raises(ChatRequestError, match="max_tokens"):
        chat_rewriter(chat, max_tokens=chat.context_length)
    long = " ".join(["w5"] * chat.context_length)
    with pytest.raises(ContextLengthError) as refused:
        chat.generate([{"role": "user", "content": long}], max_tokens=6)
    with pytest.raises(ContextLengthError) as caught:
        chat_rewriter(chat, max_tokens=6)(["w6", long])
    assert str(caught.value) == str(refused.value)


def test_on_smollm2_batched_rewrites_stop_where_greedy_chat_generation_stops(smollm2_lm):
    """Rows of one batch end at different times: each is cut at its own end token, as ChatModel.generate ends it."""
    chat = ChatModel(smollm2_lm)
    messages = ["Say hi.", REWRITE_INSTRUCTION.replace("{text}", "the flight to boston was delayed again @united")]
    alone = [chat.generate([{"role": "user", "content": m}], max_tokens=40, temperature=0.0) for m in messages]
    assert any(g.finish_reason == "stop" for g in alone)  # at least one ends before the bound
    assert chat_rewriter(chat, max_tokens=40)(messages) == [g.text for g in alone]
