"""CUSTEXT and CUSTEXT+: the output sets (Algorithm 1) and their cache, the exact law, the guarantee, the report."""

from __future__ import annotations

import math
import os
import pickle
from pathlib import Path

import pytest
import torch
from transformers import BertTokenizerFast

from privlm.attacks import audit_mechanism
from privlm.baselines.custext import Custext, CustextMechanism, CustextOptions, CustextPlus
from privlm.baselines.neighbours import (
    build_output_sets,
    check_partition,
    load_output_sets,
    nearest_candidates,
    output_sets_path,
    read_output_sets,
    write_output_sets,
)
from privlm.mechanisms import DiscreteMechanism, PrivacyUnit, exact_privacy_loss, make_generator
from privlm.models.language import LanguageModel
from privlm.models.perturbation import TextPerturber, TokenOutcome
from privlm.models.prompts import NonSensitiveTokens, tokenize_prompt
from privlm.models.vocabulary import CandidateVocabulary
from tests.conftest import BAD_POSITIVE_REALS, assert_draws_follow
from tests.models.tiny import VOCAB, WORDS

PROMPT = "My friend Alice Johnson lives at 42 Baker Street, and she works for the bank."


@pytest.fixture(scope="session")
def smollm2_vocabulary(smollm2_lm: LanguageModel) -> CandidateVocabulary:
    return smollm2_lm.vocabulary


@pytest.fixture(scope="module")
def smollm2_sets(smollm2_vocabulary, tmp_path_factory):
    return load_output_sets(smollm2_vocabulary, 20, root=tmp_path_factory.mktemp("neighbours"))


def small_vocabulary(table: torch.Tensor) -> CandidateVocabulary:
    """94 candidates (WordPiece ids 5..98; ids 0..4 are special) with the given (99, d) embedding rows."""
    words = WORDS + [f"w{i}" for i in range(VOCAB - len(WORDS))]
    return CandidateVocabulary.from_tokenizer(BertTokenizerFast(vocab={w: i for i, w in enumerate(words)}), table)


@pytest.fixture(scope="module")
def small() -> CandidateVocabulary:
    return small_vocabulary(torch.randn(VOCAB, 8, generator=torch.Generator().manual_seed(3)))


@pytest.fixture(scope="module")
def tight() -> CandidateVocabulary:
    """One candidate at the origin, the 93 others in a tight cluster at distance about 1 (d = 2)."""
    table = torch.zeros(VOCAB, 2)
    table[6:, 0] = 1 + 0.02 * torch.arange(VOCAB - 6) / (VOCAB - 6)
    table[:5] = torch.tensor([5.0, 5.0])  # special rows, far away
    return small_vocabulary(table)


def algorithm_1(table: torch.Tensor, k: int) -> list[list[int]]:
    """CUSTEXT's Algorithm 1 by brute force: the full float64 distance matrix and a Python loop."""
    distance = torch.cdist(table.double(), table.double())
    unassigned = list(range(len(table)))
    groups = []
    while unassigned:
        founder = unassigned[0]
        group = sorted(sorted(unassigned, key=lambda j: (distance[founder, j].item(), j))[:k])
        groups.append(group)
        unassigned = [j for j in unassigned if j not in group]
    return groups


def pairwise_loss(log_p: torch.Tensor) -> torch.Tensor:
    """(n, n) exact privacy loss between every two rows of log-probabilities over one output set."""
    n, size = log_p.shape
    return exact_privacy_loss(log_p[:, None, :].expand(n, n, size), log_p[None, :, :].expand(n, n, size))


def listed(members: torch.Tensor) -> list[list[int]]:
    return [[m for m in row if m >= 0] for row in members.tolist()]


# --- the output sets -----------------------------------------------------------------------------

@pytest.mark.parametrize("k", [1, 7, 20, 94])
def test_output_sets_are_algorithm_1(small, k):
    sets = build_output_sets(small, k)
    assert listed(sets.members) == algorithm_1(small.candidate_embeddings, k)
    check_partition(sets.members, sets.group_of, small.size, k)
    assert sets.sizes.tolist() == [k] * (small.size // k) + ([small.size % k] if small.size % k else [])


def test_nearest_candidates_are_a_brute_force_top_k(small):
    ids = torch.tensor([0, 1, 5, 17, 98])  # special ids too: any token id may be asked
    index, distance = nearest_candidates(small, ids, 6)
    brute = torch.cdist(small.rows_of(ids).double(), small.candidate_embeddings.double())
    expected = brute.topk(6, largest=False)
    assert torch.equal(index, expected.indices)
    torch.testing.assert_close(distance.double(), expected.values, atol=1e-5, rtol=1e-5)


def test_smollm2_output_sets_partition_the_candidates_by_algorithm_1(smollm2_vocabulary, smollm2_sets):
    sets, table = smollm2_sets, smollm2_vocabulary.candidate_embeddings
    assert smollm2_vocabulary.size == 49135 and sets.n_groups == math.ceil(49135 / 20)
    check_partition(sets.members, sets.group_of, smollm2_vocabulary.size, 20)
    assert sets.sizes[-1] == 49135 % 20 and bool((sets.sizes[:-1] == 20).all())
    for g in [0, 1, 1000, sets.n_groups - 2, sets.n_groups - 1]:  # group g: searched among groups >= g
        unassigned = (sets.group_of >= g).nonzero().squeeze(1)
        founder = int(unassigned[0])
        distance = (table[unassigned] - table[founder]).norm(dim=-1)  # directly, not by the GEMM identity
        nearest = unassigned[distance.topk(min(20, unassigned.numel()), largest=False).indices]
        assert sorted(nearest.tolist()) == listed(sets.members[g : g + 1])[0]


# --- the cache -----------------------------------------------------------------------------------

def test_the_cache_is_written_atomically_and_hit_on_the_second_load(small, tmp_path, monkeypatch):
    first = load_output_sets(small, 7, root=tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == [output_sets_path(small, 7, root=tmp_path).name]

    def no_build(*args: object) -> None:
        raise AssertionError("the cache was not used")

    monkeypatch.setattr("privlm.baselines.neighbours.build_output_sets", no_build)
    second = load_output_sets(small, 7, root=tmp_path)
    assert torch.equal(first.members, second.members) and torch.equal(first.group_of, second.group_of)


def test_the_cache_is_keyed_by_the_vocabulary_and_k(small, tmp_path):
    other = small_vocabulary(small.embeddings.flip(0))  # same tokenizer, rows permuted
    assert output_sets_path(other, 7, root=tmp_path) != output_sets_path(small, 7, root=tmp_path)
    assert output_sets_path(small, 8, root=tmp_path) != output_sets_path(small, 7, root=tmp_path)
    load_output_sets(small, 7, root=tmp_path)
    theirs = load_output_sets(other, 7, root=tmp_path)
    assert listed(theirs.members) == algorithm_1(other.candidate_embeddings, 7)
    assert len(list(tmp_path.iterdir())) == 2


def test_a_file_of_another_vocabulary_is_rebuilt_with_a_warning(small, tmp_path):
    other = small_vocabulary(small.embeddings.flip(0))
    path = output_sets_path(small, 7, root=tmp_path)
    write_output_sets(path, build_output_sets(other, 7), other)  # the wrong vocabulary's sets, under small's key
    with pytest.warns(UserWarning, match="fingerprint"):
        sets = load_output_sets(small, 7, root=tmp_path)
    assert listed(sets.members) == algorithm_1(small.candidate_embeddings, 7)
    read_output_sets(path, small, 7)  # the rebuilt file is valid


@pytest.mark.parametrize("content", [b"", b"not a safetensors file", b"\xff" * 64])
def test_a_corrupted_file_is_rebuilt_with_a_warning(small, tmp_path, content):
    path = output_sets_path(small, 7, root=tmp_path)
    path.write_bytes(content)
    with pytest.warns(UserWarning, match="not a readable safetensors file"):
        sets = load_output_sets(small, 7, root=tmp_path)
    assert listed(sets.members) == algorithm_1(small.candidate_embeddings, 7)


def test_a_tampered_partition_is_refused(small, tmp_path):
    sets = build_output_sets(small, 7)
    members = sets.members.clone()
    members[0, 1] = members[1, 1]  # one candidate in two groups
    path = output_sets_path(small, 7, root=tmp_path)
    write_output_sets(path, type(sets)(members=members, group_of=sets.group_of, k=7, fingerprint=sets.fingerprint),
                      small)
    with pytest.raises(ValueError, match="exactly once"):
        read_output_sets(path, small, 7)
    with pytest.warns(UserWarning, match="exactly once"):
        assert torch.equal(load_output_sets(small, 7, root=tmp_path).members, sets.members)


def test_an_unwritable_cache_warns_and_still_gives_the_sets(small, tmp_path):
    root = tmp_path / "a-file"
    root.write_text("not a folder")
    with pytest.warns(UserWarning, match="could not cache"):
        sets = load_output_sets(small, 7, root=root)
    assert listed(sets.members) == algorithm_1(small.candidate_embeddings, 7)


class _Trap:
    """Unpickling this would create a folder: the cache must never unpickle."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.makedirs, (str(self.marker),)


def test_a_pickle_in_the_cache_is_never_unpickled(small, tmp_path):
    marker = tmp_path / "unpickled"
    path = output_sets_path(small, 7, root=tmp_path / "cache")
    path.parent.mkdir()
    path.write_bytes(pickle.dumps(_Trap(marker)))
    with pytest.warns(UserWarning, match="rebuilding"):
        load_output_sets(small, 7, root=tmp_path / "cache")
    assert not marker.exists()


# --- the mechanism: exact law and guarantee --------------------------------------------------------

def test_the_exact_log_ratio_within_an_output_set_is_at_most_eps_and_reaches_near_it(tight):
    sets = build_output_sets(tight, tight.size)  # one group: every pair shares its output set
    mechanism = CustextMechanism(tight, sets, epsilon=2.0)
    assert isinstance(mechanism, DiscreteMechanism)
    _, log_p = mechanism.set_log_probabilities(tight.candidate_ids)
    assert pairwise_loss(log_p).max() <= 2.0 + 1e-9
    origin, far = torch.tensor(5), torch.tensor(VOCAB - 1)
    loss = exact_privacy_loss(mechanism.log_probabilities(origin), mechanism.log_probabilities(far)).item()
    assert 0.95 * 2.0 < loss <= 2.0 + 1e-9
    assert mechanism.privacy_bound(origin, far) == 2.0 and mechanism.privacy_bound(origin, origin) == 0.0


def test_smollm2_pairs_sharing_an_output_set_lose_at_most_eps(smollm2_vocabulary, smollm2_sets):
    mechanism = CustextMechanism(smollm2_vocabulary, smollm2_sets, epsilon=3.0)
    for g in [0, 500, 2000, smollm2_sets.n_groups - 1]:
        ids = smollm2_vocabulary.candidate_ids[smollm2_sets.members[g][smollm2_sets.members[g] >= 0]]
        members, log_p = mechanism.set_log_probabilities(ids)
        assert bool((members == members[0]).all())  # the same output set for every member
        assert pairwise_loss(log_p).max() <= 3.0 + 1e-9
        full = mechanism.log_probabilities(ids[:2])
        assert torch.allclose(full.exp().sum(-1), torch.ones(2, dtype=torch.float64))
        assert int(torch.isfinite(full).sum(-1).max()) == ids.numel()


def test_inputs_with_different_output_sets_have_disjoint_supports(smollm2_vocabulary, smollm2_sets):
    mechanism = CustextMechanism(smollm2_vocabulary, smollm2_sets, epsilon=3.0)
    x, x_prime = smollm2_vocabulary.candidate_ids[smollm2_sets.members[[0, 1], 0]]
    log_p, log_q = mechanism.log_probabilities(x), mechanism.log_probabilities(x_prime)
    assert not bool((torch.isfinite(log_p) & torch.isfinite(log_q)).any())
    assert exact_privacy_loss(log_p, log_q).item() == math.inf
    with pytest.raises(ValueError, match="different output sets"):
        mechanism.privacy_bound(x, x_prime)


def test_samples_follow_the_exact_distribution(smollm2_vocabulary, smollm2_sets, generator):
    mechanism = CustextMechanism(smollm2_vocabulary, smollm2_sets, epsilon=4.0)
    unknown = 0  # <|endoftext|>, a special id: not a candidate
    ids = torch.tensor([*smollm2_vocabulary.tokenizer.encode(" Alice Baker"), unknown])
    draws = mechanism.sample(ids, num_samples=20_000, generator=generator)
    assert draws.shape == (20_000, ids.numel())
    members, log_p = mechanism.set_log_probabilities(ids)
    for i in range(ids.numel()):
        slots = (draws[:, i, None] == members[i]).long()
        assert bool((slots.sum(-1) == 1).all())  # every draw lies in the output set
        assert_draws_follow(slots.argmax(-1), log_p[i].exp())


def test_a_non_candidate_takes_the_output_set_of_its_nearest_candidate(small):
    sets = build_output_sets(small, 7)
    mechanism = CustextMechanism(small, sets, epsilon=1.0)
    specials = torch.tensor([0, 1, 2, 3, 4])
    nearest = torch.cdist(small.rows_of(specials).double(), small.candidate_embeddings.double()).argmin(-1)
    assert torch.equal(mechanism.groups(specials), sets.group_of[nearest])
    assert mechanism.privacy_bound(specials[:1], small.candidate_ids[nearest[:1]]) == 1.0


def test_the_auditor_stays_below_the_claim(smollm2_vocabulary, smollm2_sets, tight):
    members = smollm2_vocabulary.candidate_ids[smollm2_sets.members[7]]
    mechanism = CustextMechanism(smollm2_vocabulary, smollm2_sets, epsilon=2.0)
    result = audit_mechanism(mechanism, members[0], members[-1], n_samples=40_000, generator=make_generator(11))
    assert result.claimed_epsilon == 2.0 and result.exact_epsilon <= 2.0 + 1e-9
    assert not result.exceeds_claim and result.eps_lower <= 2.0
    # Where the loss is near eps, the auditor sees most of it.
    mechanism = CustextMechanism(tight, build_output_sets(tight, tight.size), epsilon=2.0)
    result = audit_mechanism(mechanism, torch.tensor(5), torch.tensor(VOCAB - 1), n_samples=40_000,
                             generator=make_generator(12))
    assert 1.0 < result.eps_lower <= 2.0 and result.exact_epsilon > 1.9


def test_spend_is_eps_per_token(small):
    mechanism = CustextMechanism(small, build_output_sets(small, 7), epsilon=1.5)
    spend = mechanism.spend(torch.tensor([5, 6, 7]))
    assert spend.unit is PrivacyUnit.EPSILON and spend.amount == 4.5


# --- the perturbers ------------------------------------------------------------------------------

def test_custext_perturbs_every_token_within_its_output_set(smollm2_vocabulary, smollm2_sets):
    custext = Custext(smollm2_vocabulary, epsilon=1.0, output_sets=smollm2_sets, generator=make_generator(5))
    assert isinstance(custext, TextPerturber) and custext.name == "custext"
    result = custext.perturb(PROMPT)
    prompt = tokenize_prompt(smollm2_vocabulary.tokenizer, PROMPT)
    report = result.report
    assert [t.original_id for t in report.tokens] == list(prompt.ids)
    assert {t.outcome for t in report.tokens} == {TokenOutcome.PERTURBED}
    original = torch.tensor([t.original_id for t in report.tokens])
    released = torch.tensor([t.released_id for t in report.tokens])
    assert bool((smollm2_vocabulary.candidate_index[released] >= 0).all())
    assert torch.equal(custext.mechanism.groups(released), custext.mechanism.groups(original))
    assert report.accounting == {"paper": len(prompt), "privlm": len(prompt)}
    assert report.candidate_set_size == 49135 and result.text != PROMPT


def test_custext_plus_keeps_the_non_sensitive_tokens(smollm2_vocabulary, smollm2_sets):
    plus = CustextPlus(smollm2_vocabulary, epsilon=2.0, output_sets=smollm2_sets, generator=make_generator(6))
    assert plus.name == "custext+"
    report = plus.perturb(PROMPT).report
    prompt = tokenize_prompt(smollm2_vocabulary.tokenizer, PROMPT, NonSensitiveTokens.english())
    kept = [t for t in report.tokens if t.outcome is TokenOutcome.NON_SENSITIVE]
    assert [t.position for t in kept] == [i for i, flag in enumerate(prompt.non_sensitive) if flag]
    assert {t.original.strip() for t in kept} >= {"at", "and", "for", "the", ",", "."}
    assert all(t.released_id == t.original_id and t.epsilon is None for t in kept)
    assert report.n_perturbed == len(prompt) - len(kept) > 0
    assert report.accounting["privlm"] == 2.0 * report.n_perturbed


def test_a_seeded_generator_reproduces_the_release(smollm2_vocabulary, smollm2_sets):
    def run(seed: int) -> list[str]:
        custext = Custext(smollm2_vocabulary, epsilon=0.5, output_sets=smollm2_sets, generator=make_generator(seed))
        return [p.text for p in custext.perturb_batch([PROMPT, "Call me at noon."])]

    assert run(3) == run(3) != run(4)


def test_the_ledger_is_charged_eps_per_perturbed_token(smollm2_vocabulary, smollm2_sets, tmp_path):
    from privlm.accounting import Ledger

    ledger = Ledger(tmp_path / "ledger.db", budgets={PrivacyUnit.EPSILON: 100.0})
    plus = CustextPlus(smollm2_vocabulary, epsilon=1.5, output_sets=smollm2_sets, ledger=ledger, principal="bob")
    report = plus.perturb(PROMPT).report
    assert report.spent == ledger.spent("bob", PrivacyUnit.EPSILON) == 1.5 * report.n_perturbed


def test_custext_loads_its_output_sets_from_the_cache(small, tmp_path):
    custext = Custext(small, epsilon=1.0, generator=make_generator(0), options=CustextOptions(k=7, cache_root=tmp_path))
    assert output_sets_path(small, 7, root=tmp_path).exists()
    assert listed(custext.mechanism.output_sets.members) == algorithm_1(small.candidate_embeddings, 7)
    report = custext.perturb("the cat sat on zebra").report  # "zebra" is WordPiece's [UNK] here
    assert [t.outcome for t in report.tokens][-1] is TokenOutcome.UNKNOWN and report.n_perturbed == 5
    released = torch.tensor([t.released_id for t in report.tokens])
    assert torch.equal(custext.mechanism.groups(released), custext.mechanism.groups(torch.tensor([5, 6, 7, 8, 1])))


# --- bad input -----------------------------------------------------------------------------------

@pytest.mark.parametrize("epsilon", BAD_POSITIVE_REALS)
def test_bad_epsilon_is_refused(small, epsilon):
    sets = build_output_sets(small, 7)
    with pytest.raises(ValueError, match="epsilon"):
        Custext(small, epsilon=epsilon, output_sets=sets, options=CustextOptions(k=7))
    with pytest.raises(ValueError, match="epsilon"):
        CustextMechanism(small, sets, epsilon=epsilon)


@pytest.mark.parametrize("k", [0, -1, 95, 2.5, True, "20"])
def test_bad_k_is_refused(small, tmp_path, k):
    with pytest.raises(ValueError, match="k must"):
        build_output_sets(small, k)
    with pytest.raises(ValueError, match="k must"):
        Custext(small, epsilon=1.0, options=CustextOptions(k=k, cache_root=tmp_path))


def test_output_sets_of_another_k_or_vocabulary_are_refused(small, tight):
    with pytest.raises(ValueError, match="k=7"):
        Custext(small, epsilon=1.0, output_sets=build_output_sets(small, 7), options=CustextOptions(k=8))
    with pytest.raises(ValueError, match="another vocabulary"):
        CustextMechanism(small, build_output_sets(tight, 7), epsilon=1.0)


@pytest.mark.parametrize("texts", [[""], ["  "], []])
def test_empty_texts_are_refused(small, texts):
    with pytest.raises(ValueError, match="texts"):
        custext = Custext(small, epsilon=1.0, output_sets=build_output_sets(small, 7), options=CustextOptions(k=7))
        custext.perturb_batch(texts)


@pytest.mark.parametrize("x", [torch.tensor([0.5]), torch.tensor([VOCAB]), torch.tensor([-1]), [5]])
def test_bad_token_ids_are_refused(small, x):
    mechanism = CustextMechanism(small, build_output_sets(small, 7), epsilon=1.0)
    with pytest.raises(ValueError, match="x must"):
        mechanism.sample(x)
