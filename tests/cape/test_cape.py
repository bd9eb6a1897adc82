"""Cape on the real SmolLM2 device model: the utility against its definition, the report, the ledger, randomness."""

from __future__ import annotations

import math

import pytest
import torch

from privlm.accounting import BudgetExhaustedError, Ledger
from privlm.cape import Cape, CapeBucketizedMechanism, CapeConfig, CapeOptions
from privlm.mechanisms import ExponentialMechanism, PrivacyUnit, make_generator
from privlm.models.perturbation import NOTHING_SPENT, TextPerturber, TokenOutcome
from tests.cape.conftest import NEIGHBOUR, PROMPT, B


def reference_utility(lm, text, *, bound, lambda_L=0.5, lambda_D=1.0):
    """u straight from the definition: the full forward pass over [bos] + prompt, one row at a time."""
    cape = Cape(lm, epsilon=1.0, logit_bound=bound)
    prompt = cape._tokenize(text)
    ids = torch.tensor([[lm.tokenizer.bos_token_id, *prompt.ids]])
    with torch.no_grad():
        logits = lm.model(input_ids=ids).logits[0]
    candidates = lm.vocabulary.candidate_ids
    table = lm.vocabulary.candidate_embeddings.double()
    rows = []
    for i in prompt.sensitive_positions:
        logit = logits[i, candidates]  # index i sees bos, t_0 .. t_{i-1}: it predicts t_i
        scaled = (logit.clamp(-bound, bound) + bound) / (2 * bound)
        d = (table - lm.vocabulary.embeddings[prompt.ids[i]].double()).norm(dim=-1)  # exact, not |q|^2 + |c|^2 - 2qc
        s = 1 - (d - d.min()) / (d.max() - d.min())
        rows.append(lambda_L * scaled.double() + lambda_D * s)
    return torch.stack(rows)


def test_utility_follows_its_definition_on_both_paths(smollm2_lm):
    cape = Cape(smollm2_lm, epsilon=1.0, logit_bound=B)
    expected = reference_utility(smollm2_lm, PROMPT, bound=B)
    fused = cape.prepare([PROMPT])[0].utilities  # SmolLM2 ties its head: one product for logits and distances
    assert cape._head is not None
    torch.testing.assert_close(fused.double(), expected, atol=1e-4, rtol=0)
    cape._head = None  # the generic path: the model's own head, then vocabulary.distances
    torch.testing.assert_close(cape.prepare([PROMPT])[0].utilities.double(), expected, atol=1e-4, rtol=0)
    assert fused.min() >= 0 and fused.max() <= cape.config.sensitivity


def test_one_forward_pass_per_batch_and_none_without_logits(smollm2_lm):
    cape = Cape(smollm2_lm, epsilon=2.0, logit_bound=B)
    # needs no B: the device model never runs
    distance_only = Cape(smollm2_lm, epsilon=2.0, options=CapeOptions(lambda_L=0.0))
    calls = []
    hook = smollm2_lm.model.base_model.register_forward_hook(lambda *args: calls.append(1))
    try:
        cape.perturb_batch([PROMPT, NEIGHBOUR, "Bob paid 12 dollars."])
        assert len(calls) == 1
        calls.clear()
        distance_only.perturb_batch([PROMPT, NEIGHBOUR])
        assert calls == []
    finally:
        hook.remove()


def test_causal_context_reaches_later_positions_only(real_pair):
    """Changing one token changes the rows of every later position and of no earlier one."""
    rows, rows_prime = real_pair.prompt.utilities, real_pair.neighbour.utilities
    for row in range(rows.shape[0]):
        same = torch.equal(rows[row], rows_prime[row])
        assert same == (row < real_pair.changed), row


def test_report_of_a_real_prompt(smollm2_lm):
    cape = Cape(smollm2_lm, epsilon=3.0, logit_bound=B, generator=make_generator(1))
    result = cape.perturb(PROMPT)
    report = result.report
    assert isinstance(cape, TextPerturber) and cape.name == report.mechanism == "cape"
    assert report.candidate_set_size == cape.vocabulary.size == len(smollm2_lm.tokenizer) - 17
    assert "".join(t.original for t in report.tokens) == PROMPT
    perturbed = [t for t in report.tokens if t.outcome is TokenOutcome.PERTURBED]
    assert len(perturbed) == report.n_perturbed == 10
    for record in report.tokens:
        if record.outcome is TokenOutcome.NON_SENSITIVE:
            assert record.released_id == record.original_id and record.epsilon is None
        else:
            assert record.epsilon == 3.0 and 1 <= record.non_empty_buckets <= 50
            assert record.eps_prime >= 0
    per_token = 3.0 + math.log(50) + math.log(cape.vocabulary.size)
    assert report.accounting["privlm"] == pytest.approx(10 * per_token)
    assert report.accounting["paper"] == pytest.approx(sum(3.0 + t.eps_prime for t in perturbed))
    assert report.chunks == 1 and report.spent is None and report.notes == ()
    assert result.text == smollm2_lm.tokenizer.decode([t.released_id for t in report.tokens])


def test_non_sensitive_rule_on_real_tokens(smollm2_lm):
    """Stopwords and punctuation kept; " The" of "Themba" and " And" of "Andover" perturbed."""
    cape = Cape(smollm2_lm, epsilon=1.0, logit_bound=B)
    report = cape.perturb("I met Themba and Andover at the doctor.").report
    outcome = {t.original: t.outcome for t in report.tokens}
    assert outcome[" The"] is outcome[" And"] is outcome[" doctor"] is TokenOutcome.PERTURBED
    assert outcome["I"] is outcome[" and"] is outcome[" the"] is outcome["."] is TokenOutcome.NON_SENSITIVE


def test_unbucketed_cape_is_the_exponential_mechanism(smollm2_lm):
    cape = Cape(smollm2_lm, epsilon=2.0, logit_bound=B, options=CapeOptions(n_buckets=None),
                generator=make_generator(2))
    assert isinstance(cape.mechanism(), ExponentialMechanism)
    assert cape.mechanism().sensitivity == cape.config.sensitivity == 1.5
    report = cape.perturb(PROMPT).report
    perturbed = [t for t in report.tokens if t.epsilon is not None]
    assert all(t.eps_prime == 0.0 and t.non_empty_buckets is None for t in perturbed)
    assert report.accounting == {"paper": pytest.approx(2.0 * 10), "privlm": pytest.approx(2.0 * 10)}


def test_mechanism_and_config(smollm2_lm):
    cape = Cape(smollm2_lm, epsilon=2.0, logit_bound=B, options=CapeOptions(lambda_L=0.25, lambda_D=0.75, n_buckets=8))
    mechanism = cape.mechanism()
    assert isinstance(mechanism, CapeBucketizedMechanism)
    assert (mechanism.epsilon, mechanism.sensitivity, mechanism.n_buckets) == (2.0, 1.0, 8)
    assert cape.mechanism(5.0).epsilon == 5.0
    assert isinstance(cape.config, CapeConfig) and cape.config.logit_bound == B
    with pytest.raises(AttributeError):
        cape.config.epsilon = 3.0  # frozen
    assert "epsilon=2" in repr(cape) and "|C|=49135" in repr(cape) and "causal" in repr(cape)


def test_prepare_once_release_at_many_epsilons(real_pair):
    cape, prepared = real_pair.cape, [real_pair.prompt]
    before = prepared[0].utilities.clone()
    for eps in (1.0, 50.0):
        report = cape.release(prepared, epsilon=eps, generator=make_generator(3))[0].report
        assert {t.epsilon for t in report.tokens if t.outcome is TokenOutcome.PERTURBED} == {eps}
    assert torch.equal(prepared[0].utilities, before)
    with pytest.raises(ValueError, match="epsilon"):
        cape.release(prepared, epsilon=0.0)


def test_seeded_generators_replay_and_os_entropy_differs(smollm2_lm, real_pair):
    def release(generator):
        return Cape(smollm2_lm, epsilon=1.0, logit_bound=B, generator=generator).release([real_pair.prompt])[0].text
    assert release(make_generator(11)) == release(make_generator(11))
    assert release(None) != release(None)  # 10 tokens at epsilon 1: equal draws are astronomically unlikely
    cape = real_pair.cape
    assert (cape.release([real_pair.prompt], generator=make_generator(4))[0].text
            == cape.release([real_pair.prompt], generator=make_generator(4))[0].text)


class RecordingLedger(Ledger):
    """Records the generator's state at each spend: it must not have moved yet."""

    def __init__(self, *args, generator, **kwargs):
        super().__init__(*args, **kwargs)
        self.generator, self.states = generator, []

    def spend_all(self, principal, spends, *, note=""):
        self.states.append(self.generator.get_state().clone())
        return super().spend_all(principal, spends, note=note)


def test_ledger_is_charged_before_anything_is_drawn(smollm2_lm, real_pair, tmp_path):
    generator = make_generator(5)
    start = generator.get_state().clone()
    ledger = RecordingLedger(tmp_path / "ledger.db", budgets={PrivacyUnit.EPSILON: 1000.0}, generator=generator)
    cape = Cape(smollm2_lm, epsilon=1.0, logit_bound=B, generator=generator, ledger=ledger, principal="alice")
    report = cape.release([real_pair.prompt])[0].report
    assert torch.equal(ledger.states[0], start)
    assert report.spent == report.accounting["privlm"] == pytest.approx(ledger.spent("alice", PrivacyUnit.EPSILON))


def test_exhausted_budget_releases_nothing(smollm2_lm, real_pair, tmp_path):
    generator = make_generator(6)
    start = generator.get_state().clone()
    ledger = Ledger(tmp_path / "ledger.db", budgets={PrivacyUnit.EPSILON: 200.0})
    cape = Cape(smollm2_lm, epsilon=1.0, logit_bound=B, generator=generator, ledger=ledger)
    cost = cape.release([real_pair.prompt])[0].report.spent  # about 157: one prompt fits, two do not
    drawn = generator.get_state().clone()
    with pytest.raises(BudgetExhaustedError):
        cape.release([real_pair.prompt, real_pair.neighbour])
    assert ledger.spent("local", PrivacyUnit.EPSILON) == pytest.approx(cost)
    assert torch.equal(generator.get_state(), drawn) and not torch.equal(drawn, start)


def test_only_non_sensitive_tokens_spend_nothing(smollm2_lm, tmp_path):
    ledger = Ledger(tmp_path / "ledger.db", budgets={PrivacyUnit.EPSILON: 10.0})
    cape = Cape(smollm2_lm, epsilon=1.0, ledger=ledger)  # uncalibrated: no logit is needed here
    text = "And then, if I was there... what of it?"
    result = cape.perturb(text)
    assert result.text == text
    assert result.report.notes == (NOTHING_SPENT,) and result.report.spent is None
    assert result.report.accounting == {"paper": 0.0, "privlm": 0.0}
    assert ledger.spent("local", PrivacyUnit.EPSILON) == 0.0


def test_batched_rows_match_one_prompt_at_a_time(smollm2_lm):
    """Right padding and the order of rows: a batch gives each prompt the rows it gets alone."""
    cape = Cape(smollm2_lm, epsilon=1.0, logit_bound=B)
    texts = [PROMPT, "Bob paid 12 dollars to Carol."]
    batched = cape.prepare(texts)
    for text, prepared in zip(texts, batched, strict=True):
        torch.testing.assert_close(prepared.utilities, cape.prepare([text])[0].utilities, atol=1e-5, rtol=0)


def test_distance_only_rows_peak_at_the_token_itself(smollm2_lm):
    """lambda_L = 0: u = lambda_D * s, and s = 1 exactly at the original token (its distance to itself is 0)."""
    cape = Cape(smollm2_lm, epsilon=1.0, options=CapeOptions(lambda_L=0.0, lambda_D=2.0))
    prepared = cape.prepare([PROMPT])[0]
    own = cape.vocabulary.candidate_index[torch.tensor([prepared.tokens.ids[i] for i in prepared.positions])]
    peak = prepared.utilities.amax(-1)
    torch.testing.assert_close(prepared.utilities[torch.arange(len(own)), own], peak, atol=0, rtol=0)
    torch.testing.assert_close(peak, torch.full_like(peak, 2.0), atol=1e-6, rtol=0)
    assert (prepared.utilities.amin(-1) == 0).all()
