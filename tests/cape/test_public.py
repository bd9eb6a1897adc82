"""cape-public against the math: the decode's distributions, the exact per-position and whole-release losses, the
sampler (chi-square), the auditor through the mechanism protocol, and the ledger charged n x eps before any draw.

The fast tests run on a tiny random Llama (tests/models/tiny.py); the exactness tests on SmolLM2 with the real
pair of neighbouring prompts of tests/cape/conftest.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from privlm.accounting import BudgetExhaustedError, Ledger
from privlm.attacks import audit_mechanism
from privlm.cape.public import PublicContextCape, PublicContextOptions, public_base, run_rounds
from privlm.cape.utility import Query, device_logits
from privlm.mechanisms import BaseMeasureExponentialMechanism, PrivacyUnit, exact_privacy_loss, make_generator
from privlm.models.perturbation import TokenOutcome
from privlm.models.text_mechanisms import MechanismContext, build_mechanism
from tests.cape.conftest import NEIGHBOUR, PROMPT
from tests.conftest import assert_draws_follow, spy_on_forward
from tests.models.tiny import tiny_causal_lm

TEXTS = ["the cat sat on the mat", "a dog w5 w6 w7 . the cat", "w1 w2", "the . on", " ".join(["w9"] * 70)]


@pytest.fixture(scope="module")
def tiny() -> PublicContextCape:
    return PublicContextCape(tiny_causal_lm(), epsilon=2.0, generator=make_generator(0))


class Recording(PublicContextCape):
    """Keeps the logits every decode step gave the mechanism."""

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.seen: list[torch.Tensor] = []

    def mechanism(self, logits: torch.Tensor) -> BaseMeasureExponentialMechanism:
        self.seen.append(logits.clone())
        return super().mechanism(logits)


def test_the_batched_decode_reads_exactly_the_released_prefix():
    """Every decode step's logits (KV cache, rows padded on the left, prompts of several lengths, a prompt in two
    chunks) are the logits of one forward pass over [bos] + that row's released prefix."""
    cape = Recording(tiny_causal_lm(), epsilon=2.0, options=PublicContextOptions(batch_size=8),
                     generator=make_generator(1))
    released = cape.perturb_batch(TEXTS)
    per_step = cape.seen
    room = cape.room
    rows = []  # (prompt, chunk offset, local positions, released ids of the chunk), in the decode's row order
    for text, out in zip(TEXTS, released, strict=True):
        prompt, ids = cape.tokenize(text), [t.released_id for t in out.report.tokens]
        for offset in range(0, len(prompt), room):
            local = [i - offset for i in prompt.sensitive_positions if offset <= i < offset + room]
            rows.append((local, ids[offset:offset + room]))
    for row, (local, ids) in enumerate(rows):
        if not local:
            continue
        expected = device_logits(cape.device_model, [Query(ids=tuple(ids), positions=tuple(local))])
        active_at = [[j for j, (p, _) in enumerate(rows) if step < len(p)] for step in range(len(local))]
        got = torch.stack([per_step[step][active_at[step].index(row)] for step in range(len(local))])
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_every_token_is_reported_and_the_spend_is_exactly_n_times_epsilon(tiny):
    for text, out in zip(TEXTS, tiny.perturb_batch(TEXTS), strict=True):
        prompt, report = tiny.tokenize(text), out.report
        assert [t.original_id for t in report.tokens] == list(prompt.ids)  # no token dropped or added
        for token, kept in zip(report.tokens, prompt.non_sensitive, strict=True):
            assert token.outcome is (TokenOutcome.NON_SENSITIVE if kept else TokenOutcome.PERTURBED)
            assert (token.released_id == token.original_id) if kept else token.epsilon == 2.0
        n = len(prompt.sensitive_positions)
        assert report.n_perturbed == n and report.accounting == {"privlm": n * 2.0}
        assert report.spent is None  # no ledger
        assert report.chunks == math.ceil(len(prompt) / tiny.room)
        assert out.text == tiny.vocabulary.tokenizer.decode([t.released_id for t in report.tokens],
                                                            clean_up_tokenization_spaces=False)


def test_the_ledger_is_charged_n_times_epsilon_before_any_draw(tmp_path):
    ledger = Ledger(tmp_path / "ledger.sqlite", budgets={PrivacyUnit.EPSILON: 20.0})
    cape = PublicContextCape(tiny_causal_lm(), epsilon=2.0, ledger=ledger, principal="alice")
    calls = spy_on_forward(cape.device_model.model, lambda: ledger.spent("alice", PrivacyUnit.EPSILON))
    out = cape.perturb_batch(["the cat sat on the mat", "a dog w5"])  # 3 + 2 perturbed tokens
    assert [o.report.spent for o in out] == [6.0, 4.0]
    assert calls and set(calls) == {10.0}  # charged whole before the first decode step
    with pytest.raises(BudgetExhaustedError):
        cape.perturb_batch(["w1 w2 w3 w4 w5 w6"])  # 12 > the 10 left: refused whole, nothing drawn
    assert len(calls) == 3 and ledger.spent("alice", PrivacyUnit.EPSILON) == 10.0
    assert cape.perturb_batch(["the . on"])[0].report.spent is None  # nothing sensitive: nothing charged


def test_a_masked_device_model_is_refused(tiny_masked_lm):
    with pytest.raises(ValueError, match="masked LM cannot do"):
        PublicContextCape(tiny_masked_lm, epsilon=1.0)


@pytest.mark.parametrize("bad", [{"epsilon": 0.0}, {"epsilon": math.inf}, {"tau": -1.0}, {"top_p": 0.0},
                                 {"top_p": 1.5}, {"batch_size": 0}, {"rounds": 0}, {"rounds": 1.5},
                                 {"rounds": 2, "placeholder": "w90 w91"}])
def test_bad_settings_are_refused(bad):
    options = dict(bad)
    epsilon = options.pop("epsilon", 1.0)
    with pytest.raises(ValueError):
        PublicContextCape(tiny_causal_lm(), epsilon=epsilon, options=PublicContextOptions(**options))


# --- rounds: at most k forward passes ---------------------------------------------------------------------------
PLACEHOLDER = "w90"


def test_without_a_one_token_blank_the_placeholder_is_the_unknown_token():
    lm = tiny_causal_lm()  # WordPiece splits " ___" into three "_", each unknown; " _" is one (unknown) token
    cape = PublicContextCape(lm, epsilon=1.0, options=PublicContextOptions(rounds=2))
    assert cape.placeholder_id == lm.tokenizer.unk_token_id


def test_a_positions_round_is_its_index_in_its_run_capped():
    assert run_rounds([0, 1, 2, 3, 5, 6, 9], 2) == [0, 1, 1, 1, 0, 1, 0]
    assert run_rounds([0, 1, 2, 3, 5, 6, 9], 3) == [0, 1, 2, 2, 0, 1, 0]
    assert run_rounds([4, 6, 8], 1) == [0, 0, 0] and run_rounds([], 2) == []


def test_each_round_reads_the_released_tokens_of_earlier_rounds_and_placeholders_elsewhere():
    """Every round's logits are those of one forward pass over [bos] + the chunk with the positions of earlier
    rounds as released, and a placeholder at every position of this round or a later one; and a batch takes one
    forward pass per round, however many tokens are perturbed."""
    cape = Recording(tiny_causal_lm(), epsilon=2.0,
                     options=PublicContextOptions(batch_size=8, rounds=2, placeholder=PLACEHOLDER),
                     generator=make_generator(7))
    forwards = spy_on_forward(cape.device_model.model, lambda: None)
    released = cape.perturb_batch(TEXTS)
    assert len(forwards) == 2 == len(cape.seen)  # 2 rounds, whatever the number of perturbed tokens
    placeholder = cape.device_model.tokenizer.convert_tokens_to_ids(PLACEHOLDER)
    expected: list[list[Query]] = [[], []]
    for text, out in zip(TEXTS, released, strict=True):
        prompt, ids = cape.tokenize(text), [t.released_id for t in out.report.tokens]
        for offset in range(0, len(prompt), cape.room):
            chunk = ids[offset:offset + cape.room]
            local = [i - offset for i in prompt.sensitive_positions if offset <= i < offset + cape.room]
            first = [p for p in local if p - 1 not in local]  # a run's first token: round 0
            for round_, drawn in enumerate([first, [p for p in local if p not in first]]):
                later = [p for p in local if p not in first] if round_ == 1 else local
                context = [placeholder if p in later else t for p, t in enumerate(chunk)]
                if drawn:
                    expected[round_].append(Query(ids=tuple(context), positions=tuple(drawn)))
    for round_, seen in enumerate(cape.seen):
        torch.testing.assert_close(seen, device_logits(cape.device_model, expected[round_]), atol=1e-4, rtol=1e-4)


def test_in_rounds_the_sampler_follows_the_exact_law():
    """Chi-square at p = 1e-6 on 10,000 releases of a three-token run in two rounds, top-p 0.9: the first token
    against its law on the skeleton; the third, among releases with the most frequent first token, against its law
    given that token and a placeholder at the second."""
    # top-p < 1: the sampler's truncation
    options = PublicContextOptions(tau=0.7, top_p=0.9, rounds=2, placeholder=PLACEHOLDER, batch_size=4096)
    cape = PublicContextCape(tiny_causal_lm(), epsilon=3.0, options=options, generator=make_generator(8))
    text = "w1 w2 w3"
    assert run_rounds(cape.tokenize(text).sensitive_positions, 2) == [0, 1, 1]  # the third shares the second's round
    releases = torch.tensor([[t.released_id for t in out.report.tokens]
                             for out in cape.perturb_batch([text] * 10_000)])
    index = cape.vocabulary.candidate_index
    _, law = cape.position_log_probabilities(text, releases[0].tolist())
    assert_draws_follow(index[releases[:, 0]], law[0].exp())
    top = int(torch.mode(releases[:, 0]).values)
    _, given_top = cape.position_log_probabilities(text, [top, 0, 0])
    assert_draws_follow(index[releases[:, 2]][releases[:, 0] == top], given_top[2].exp())


@pytest.mark.parametrize("rounds", [None, 2])
def test_the_exact_loss_of_a_whole_release_over_every_outcome_is_at_most_n_eps(rounds):
    """The joint law of a two-token release, enumerated over every outcome (r_0, r_1) for two prompts that differ in
    both tokens: max over r of |ln P(r | x) - ln P(r | x')| is at most 2 eps, and positive."""
    options = PublicContextOptions(tau=0.8, top_p=0.9, rounds=rounds, placeholder=PLACEHOLDER)
    cape = PublicContextCape(tiny_causal_lm(), epsilon=1.5, options=options)
    x, x_prime = "w1 w2", "w3 w4"
    candidates = cape.vocabulary.candidate_ids.tolist()
    worst = 0.0
    for r0 in candidates:  # position 1's law depends on r_0 only
        _, law = cape.position_log_probabilities(x, [r0, 0])
        _, law_prime = cape.position_log_probabilities(x_prime, [r0, 0])
        first = cape.vocabulary.candidate_index[r0]
        support = torch.isfinite(law[1])  # outside top-p: impossible under both (the support is public)
        assert torch.equal(support, torch.isfinite(law_prime[1]))
        if not torch.isfinite(law[0, first]):
            continue
        joint = (law[0, first] - law_prime[0, first]) + (law[1] - law_prime[1])[support]  # every r_1 at once
        worst = max(worst, float(joint.abs().max()))
    assert 0 < worst <= 2 * 1.5 + 1e-9


def test_the_base_measure_is_tau_log_pi_on_the_top_p_set():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    pi = torch.softmax(logits.double(), dim=-1)
    full = public_base(logits, tau=0.5, top_p=1.0)
    torch.testing.assert_close(full, 0.5 * pi.log())
    cut = public_base(logits, tau=1.0, top_p=0.7)  # pi = .64, .24, .09, .03: the first two reach 0.7
    assert torch.isneginf(cut[0, 2:]).all() and torch.isfinite(cut[0, :2]).all()
    assert torch.isfinite(public_base(logits, tau=1.0, top_p=0.5)[0]).sum() == 1  # at least the top one
    torch.testing.assert_close(public_base(logits, tau=0.0, top_p=1.0), torch.zeros(1, 4, dtype=torch.float64))


def test_the_sampler_follows_the_exact_law_at_the_first_and_the_second_position():
    """Chi-square at p = 1e-6 on 10,000 releases of a two-token prompt: the first token against its exact law
    given [bos]; the second, among releases whose first token was the most frequent one, against its exact law
    given that first token."""
    cape = PublicContextCape(tiny_causal_lm(), epsilon=3.0, options=PublicContextOptions(tau=0.7, batch_size=4096),
                             generator=make_generator(2))
    text = "w1 w2"
    releases = torch.tensor([[t.released_id for t in out.report.tokens]
                             for out in cape.perturb_batch([text] * 10_000)])
    index = cape.vocabulary.candidate_index
    first, second = index[releases[:, 0]], index[releases[:, 1]]
    _, law = cape.position_log_probabilities(text, releases[0].tolist())
    assert_draws_follow(first, law[0].exp())
    top = int(torch.mode(releases[:, 0]).values)
    _, given_top = cape.position_log_probabilities(text, [top, 0])
    assert_draws_follow(second[releases[:, 0] == top], given_top[1].exp())


# --- SmolLM2: the exact losses of real neighbouring prompts -------------------------------------------------------
@pytest.fixture(scope="module")
def smol_public(smollm2_lm) -> PublicContextCape:
    return PublicContextCape(smollm2_lm, epsilon=8.0, options=PublicContextOptions(tau=0.5, top_p=0.9),
                             generator=make_generator(3))


@pytest.mark.parametrize("epsilon", [0.5, 4.0, 16.0])
@pytest.mark.parametrize(("tau", "top_p", "rounds"), [(1.0, 1.0, None), (0.5, 0.95, None), (2.0, 1.0, None),
                                                     (2.0, 1.0, 2)])  # (2, 1): the shipped defaults
def test_exact_loss_per_position_and_of_the_release_given_a_shared_prefix(smollm2_lm, epsilon, tau, top_p, rounds):
    """For a release r of PROMPT: at every perturbed position, max_y |ln P(y | x_i, r_<i) / P(y | x'_i, r_<i)| <= eps
    (NEIGHBOUR differs in one name; with rounds, given what the position's round reads of r); the whole release's
    exact loss is at most the sum, n eps, and the ledger's total is n eps."""
    options = PublicContextOptions(tau=tau, top_p=top_p, rounds=rounds)
    cape = PublicContextCape(smollm2_lm, epsilon=epsilon, options=options, generator=make_generator(4))
    out = cape.perturb(PROMPT)
    released = [t.released_id for t in out.report.tokens]
    positions, law = cape.position_log_probabilities(PROMPT, released)
    positions_prime, law_prime = cape.position_log_probabilities(NEIGHBOUR, released)
    assert positions == positions_prime and len(positions) == out.report.n_perturbed
    per_position = exact_privacy_loss(law, law_prime)
    assert (per_position <= epsilon + 1e-9).all()
    changed = [j for j, i in enumerate(positions) if cape.tokenize(PROMPT).ids[i] != cape.tokenize(NEIGHBOUR).ids[i]]
    assert len(changed) == 1 and per_position[changed[0]] > 0  # the name's position loses something
    assert (per_position[[j for j in range(len(positions)) if j != changed[0]]] == 0).all()  # no other does
    drawn = cape.vocabulary.candidate_index[torch.tensor([released[i] for i in positions])]
    whole = (law.gather(1, drawn[:, None]) - law_prime.gather(1, drawn[:, None])).sum().abs().item()
    assert whole <= float(per_position.sum()) + 1e-9 <= len(positions) * epsilon + 1e-9
    assert out.report.accounting["privlm"] == len(positions) * epsilon


def test_the_auditor_through_the_mechanism_protocol(smol_public):
    """The mechanism at the name's position, given a real released prefix, audited on the two names' similarity
    rows: the audit's lower bound stays below eps, and finds real loss."""
    prompt, neighbour = smol_public.tokenize(PROMPT), smol_public.tokenize(NEIGHBOUR)
    at = next(i for i in prompt.sensitive_positions if prompt.ids[i] != neighbour.ids[i])
    prefix = smol_public.perturb(PROMPT).report.tokens[:at]
    logits = device_logits(smol_public.device_model,
                           [Query(ids=(*[t.released_id for t in prefix], 0), positions=(at,))])
    mechanism = smol_public.mechanism(logits[0])
    s, s_prime = smol_public.similarity([prompt.ids[at], neighbour.ids[at]])
    result = audit_mechanism(mechanism, s, s_prime, n_samples=200_000, generator=make_generator(5))
    assert result.claimed_epsilon == 8.0
    assert result.exact_epsilon <= 8.0 + 1e-9
    assert 0 < result.eps_lower <= result.exact_epsilon


def test_registered_by_name_and_built_on_the_shared_context(smollm2_lm):
    perturber = build_mechanism("cape-public", MechanismContext(smollm2_lm), epsilon=2.0, generator=make_generator(6))
    assert isinstance(perturber, PublicContextCape) and perturber.unit is PrivacyUnit.EPSILON
    out = perturber.perturb("My name is Alice Smith and I live in Boston.")
    assert out.report.mechanism == "cape-public"
    assert out.report.accounting["privlm"] == 2.0 * out.report.n_perturbed
    fast = build_mechanism("cape-public-fast", MechanismContext(smollm2_lm), epsilon=2.0, generator=make_generator(9))
    assert isinstance(fast, PublicContextCape) and fast.rounds == 2 and fast.name == "cape-public-fast"
    assert fast.perturb("My name is Alice Smith.").report.mechanism == "cape-public-fast"
    assert fast.device_model.tokenizer.decode([fast.placeholder_id]) == " ___"  # the first default: one token here
    assert "given the released prefix" in out.report.guarantee
    assert "released in earlier rounds" in fast.perturb("Alice").report.guarantee
