"""DP-Prompt against the math: each step is the exponential mechanism on clipped logits at T = 2 (b_hi - b_lo) / eps
(exact law, exact loss between two documents, chi-square of the sampler), the ledger is charged
max_new_tokens x eps before any draw, and the report says what was generated."""

from __future__ import annotations

import math

import pytest
import torch

from privlm.accounting import BudgetExhaustedError, Ledger
from privlm.baselines.dp_prompt import DPPrompt
from privlm.mechanisms import PrivacyUnit, exact_privacy_loss, make_generator
from privlm.models.perturbation import TokenOutcome
from privlm.models.text_mechanisms import MechanismContext, build_mechanism
from tests.conftest import assert_draws_follow, spy_on_forward
from tests.models.tiny import tiny_causal_lm


def first_step_logits(dp: DPPrompt, text: str) -> torch.Tensor:
    """The device model's logits over the whole vocabulary for the paraphrase's first token."""
    ids = dp.chat.prompt_ids([{"role": "user", "content": dp.instruction + text}])
    with torch.no_grad():
        return dp.device_model.model(input_ids=torch.tensor([ids])).logits[0, -1].float()


def test_each_step_is_the_exponential_mechanism_at_the_stated_temperature():
    dp = DPPrompt(tiny_causal_lm(), epsilon=4.0, logit_range=(-0.05, 0.05))
    logits = first_step_logits(dp, "the cat sat on the mat")
    temperature = 2 * 0.1 / 4.0
    expected = torch.log_softmax(logits.double().clamp(-0.05, 0.05) / temperature, dim=-1)
    torch.testing.assert_close(dp.mechanism.log_probabilities(logits.clamp(-0.05, 0.05)), expected)


def test_the_exact_loss_between_two_documents_is_at_most_epsilon_per_token(smollm2_lm):
    """Two unrelated prompts (the relation is document-level): the first token's exact loss is positive and at most
    eps, at every level."""
    for epsilon in (1.0, 8.0, 64.0):
        dp = DPPrompt(smollm2_lm, epsilon=epsilon, logit_range=(-10.0, 10.0))
        a, b = (first_step_logits(dp, t) for t in ("My friend Alice lives in Paris.", "Bob's cat is called Tom."))
        loss = exact_privacy_loss(dp.mechanism.log_probabilities(a.clamp(-10, 10)),
                                  dp.mechanism.log_probabilities(b.clamp(-10, 10)))
        assert 0 < float(loss) <= epsilon + 1e-9


def test_every_step_of_a_transcript_costs_at_most_epsilon_and_the_transcript_at_most_k_epsilon(smollm2_lm):
    """A paraphrase drawn through the KV-cache decode, teacher-forced under two unrelated documents: each step's exact
    loss (over every possible token, given the same prefix of the transcript) is at most eps, the transcript's own
    loss at most k x eps, and the clip is active (some logits lie outside the range)."""
    epsilon, bound = 8.0, (-10.0, 10.0)
    dp = DPPrompt(smollm2_lm, epsilon=epsilon, logit_range=bound, generator=make_generator(11))
    first, second = "My friend Alice lives in Paris.", "Bob's cat is called Tom."
    transcript = dp._paraphrase(first, 6)
    prompts = [dp.chat.prompt_ids([{"role": "user", "content": dp.instruction + t}]) for t in (first, second)]
    total, clipped = 0.0, False
    for step, token in enumerate(transcript):
        with torch.no_grad():
            logits = [smollm2_lm.model(input_ids=torch.tensor([ids + transcript[:step]])).logits[0, -1].float()
                      for ids in prompts]
        clipped |= any(bool((row.abs() > bound[1]).any()) for row in logits)
        laws = [dp.mechanism.log_probabilities(row.clamp(*bound)) for row in logits]
        assert float(exact_privacy_loss(*laws)) <= epsilon + 1e-9
        total += float(laws[0][token] - laws[1][token])
    assert clipped
    assert abs(total) <= len(transcript) * epsilon + 1e-9


def test_the_sampler_follows_the_exact_law():
    dp = DPPrompt(tiny_causal_lm(), epsilon=2.0, logit_range=(-0.1, 0.1), generator=make_generator(7))
    law = dp.mechanism.probabilities(first_step_logits(dp, "a dog w5").clamp(-0.1, 0.1))
    draws = torch.tensor([dp._paraphrase("a dog w5", 1)[0] for _ in range(2000)])
    assert_draws_follow(draws, law)


def test_the_ledger_is_charged_the_longest_paraphrase_before_any_draw(tmp_path):
    ledger = Ledger(tmp_path / "ledger.sqlite", budgets={PrivacyUnit.EPSILON: 100.0})
    dp = DPPrompt(tiny_causal_lm(), epsilon=2.0, logit_range=(-1.0, 1.0), ledger=ledger, principal="bob",
                  generator=make_generator(8))
    calls = spy_on_forward(dp.device_model.model, lambda: ledger.spent("bob", PrivacyUnit.EPSILON))
    out = dp.perturb("the cat sat on the mat w7")  # 7 tokens: at most ceil(1.5 x 7) + 4 = 15 generated
    report = out.report
    assert dp.max_new_tokens(7) == 15 and report.accounting["privlm"] == 30.0 == report.spent
    assert set(calls) == {30.0} and 1 <= len(calls) <= 15  # charged whole before the first step
    assert report.accounting["transcript"] == 2.0 * len(calls)  # one step per generated token
    assert all(t.outcome is TokenOutcome.REWRITTEN and t.released_id == -1 for t in report.tokens)
    assert report.n_perturbed == report.n_tokens == 7
    steps = len(calls)
    with pytest.raises(BudgetExhaustedError):  # 21 tokens: at most 36 generated, 72 > the 70 left
        dp.perturb_batch(["w1 w2 w3 w4 w5 w6 w7 w8 w9 w10 w11 w12 w13 w14 w15 w16 w17 w18 w19 w20 w21"])
    assert ledger.spent("bob", PrivacyUnit.EPSILON) == 30.0 and len(calls) == steps  # refused whole, nothing drawn


def test_refusals(tiny_masked_lm):
    with pytest.raises(ValueError, match="causal"):
        DPPrompt(tiny_masked_lm, epsilon=1.0, logit_range=(-1.0, 1.0))
    for bad in [(1.0, 1.0), (2.0, -2.0), (-math.inf, 1.0)]:
        with pytest.raises(ValueError, match="logit_range"):
            DPPrompt(tiny_causal_lm(), epsilon=1.0, logit_range=bad)
    with pytest.raises(ValueError, match="logit bound B"):
        build_mechanism("dp-prompt", MechanismContext(tiny_causal_lm()), epsilon=1.0)


def test_registered_on_cape_s_bound_and_reads_as_text_at_a_high_epsilon(smollm2_lm):
    dp = build_mechanism("dp-prompt", MechanismContext(smollm2_lm, logit_bound=30.0), epsilon=2000.0,
                         generator=make_generator(9))
    assert isinstance(dp, DPPrompt) and dp.logit_range == (-30.0, 30.0)
    out = dp.perturb("My neighbour Alice asked me what the capital of France is.")
    assert out.report.mechanism == "dp-prompt" and out.text and "temperature 0.06" in out.report.notes[0]
