"""The SAP privatizers against the math.

Hidden states (k >= 1): h + z with z ~ d_chi(eta), so ||release - h|| ~ Gamma(d, 1/eta) and the direction is
uniform on the sphere (KS tests at the project's threshold). Embedding rows (k = 0): d_chi noise then the nearest
vocabulary row; its law has no closed form in d > 1, so it is compared (two-sample chi-square) with an independent
Monte Carlo of the same math written here in numpy. Both claims are checked by the auditor, which must also catch
a privatizer with 4x too little noise (so these audits can fail).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import ClassVar

import numpy as np
import pytest
import torch
from scipy import stats

import privlm.sap.privatizer as privatizer_module
from privlm.attacks import audit_mechanism
from privlm.mechanisms import DChiLaplace, PrivacyUnit, make_generator, squared_distances
from privlm.sap import EmbeddingPrivatizer, HiddenStatePrivatizer, Release
from tests.conftest import BAD_POSITIVE_REALS, P_THRESHOLD

BAD_LEVELS = [value for value in BAD_POSITIVE_REALS if value is not None]  # None is "no noise", a valid level

# A 6-row vocabulary in d = 2: rows 0..3 the corners of a unit square, 4 a special token, 5 a CTI-exempt one.
SQUARE = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [5.0, 5.0], [-3.0, 0.5]],
                      dtype=torch.float64)
SPECIAL, EXEMPT = 4, 5


def ones_mask(ids: torch.Tensor) -> torch.Tensor:
    return torch.ones_like(ids)


def padded_mask(batch: int, length: int) -> torch.Tensor:
    """Row b has length - (b % 3) real positions, then padding."""
    mask = torch.ones(batch, length, dtype=torch.long)
    for b in range(batch):
        mask[b, length - b % 3:] = 0
    return mask


def ids_of(values: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """The vocabulary id of every row of ``values`` (..., d); fails unless each equals exactly one row."""
    matches = (values.unsqueeze(-2) == table).all(dim=-1)
    assert bool((matches.sum(dim=-1) == 1).all()), "a release is not exactly one vocabulary row"
    return matches.long().argmax(dim=-1)


def reference_release(rows: torch.Tensor, eta: float, table: torch.Tensor, seed: int) -> torch.Tensor:
    """Independent d_chi + nearest projection: Gamma(d, 1/eta) radius, normalised Gaussian direction (numpy)."""
    rng = np.random.default_rng(seed)
    n, d = rows.shape
    radius = rng.gamma(d, 1 / eta, size=(n, 1))
    direction = rng.standard_normal((n, d))
    noisy = rows.double() + torch.from_numpy(radius * direction / np.linalg.norm(direction, axis=1, keepdims=True))
    return torch.cdist(noisy, table.double()).argmin(dim=-1)


def assert_same_law(draws: torch.Tensor, reference: torch.Tensor, size: int) -> None:
    """Two-sample chi-square (homogeneity) that two id samples share one law; rare cells are pooled."""
    counts = np.stack([np.bincount(draws.numpy(), minlength=size), np.bincount(reference.numpy(), minlength=size)])
    rare = counts.sum(axis=0) < 10
    table = counts[:, ~rare]
    if rare.any():
        table = np.concatenate([table, counts[:, rare].sum(axis=1, keepdims=True)], axis=1)
    table = table[:, table.sum(axis=0) > 0]
    if table.shape[1] < 2:  # both samples sit on one output: identical laws
        return
    assert stats.chi2_contingency(table).pvalue > P_THRESHOLD


# --- hidden states (k >= 1) -------------------------------------------------------------------------

def hidden_release(privatizer: HiddenStatePrivatizer, h: torch.Tensor, mask: torch.Tensor, seed: int) -> Release:
    ids = torch.zeros(mask.shape, dtype=torch.long)
    return privatizer.privatize(h, ids, mask, generator=make_generator(seed))


@pytest.mark.parametrize(("d", "eta"), [(3, 0.5), (32, 4.0)])
def test_hidden_noise_norms_follow_gamma_d_over_eta(d, eta):
    h = torch.randn(1000, 12, d, generator=make_generator(1), dtype=torch.float64) * 3
    mask = padded_mask(1000, 12)
    release = hidden_release(HiddenStatePrivatizer(eta=eta), h, mask, seed=2)
    real = mask.bool()
    norms = (release.values - h)[real].norm(dim=-1).numpy()
    assert norms.size == int(real.sum()) > 10_000
    assert stats.kstest(norms, "gamma", args=(d, 0, 1 / eta)).pvalue > P_THRESHOLD
    z_score = (norms.mean() - d / eta) / (math.sqrt(d) / eta / math.sqrt(norms.size))  # E||z|| = d / eta
    assert 2 * stats.norm.sf(abs(z_score)) > P_THRESHOLD


@pytest.mark.parametrize("d", [2, 16])
def test_hidden_noise_directions_are_uniform_on_the_sphere(d):
    h = torch.randn(2000, 10, d, generator=make_generator(3), dtype=torch.float64)
    release = hidden_release(HiddenStatePrivatizer(eta=1.5), h, torch.ones(2000, 10, dtype=torch.long), seed=4)
    z = (release.values - h).reshape(-1, d)
    v = z / z.norm(dim=-1, keepdim=True)
    u = torch.randn(d, generator=make_generator(5), dtype=torch.float64)
    u = u / u.norm()
    projection = (v @ u).numpy()
    # v uniform on S^{d-1}: <v, u>^2 ~ Beta(1/2, (d-1)/2) for any fixed unit u, and its sign is a fair coin.
    assert stats.kstest(projection**2, "beta", args=(0.5, (d - 1) / 2)).pvalue > P_THRESHOLD
    assert stats.binomtest(int((projection > 0).sum()), projection.size).pvalue > P_THRESHOLD
    n = v.shape[0]  # Cov(v) = I/d: n d ||mean v||^2 is about chi-square(d)
    assert stats.chi2.sf(n * d * v.mean(dim=0).pow(2).sum().item(), d) > P_THRESHOLD


def test_hidden_release_masks_padding_and_charges_eta_per_real_position():
    h = torch.randn(5, 7, 4, generator=make_generator(6)) + 10  # padding rows are far from zero before release
    mask = padded_mask(5, 7)
    release = hidden_release(HiddenStatePrivatizer(eta=2.5), h, mask, seed=7)
    real = mask.bool()
    assert bool((release.values[~real] == 0).all()) and int((~real).sum()) > 0
    assert bool((release.values[real] != h[real]).any(dim=-1).all())  # every real row is noised
    assert torch.equal(release.released, real) and torch.equal(release.noised, real)
    assert not bool(release.exempt.any()) and not bool(release.exact.any())
    assert release.spend.unit is PrivacyUnit.ETA_HIDDEN_STATE
    assert release.spend.amount == pytest.approx(2.5 * int(real.sum()))
    assert HiddenStatePrivatizer(eta=2.5).spend_of(torch.zeros_like(mask), mask) == release.spend


def test_hidden_eta_none_releases_h_exactly_at_no_cost():
    h = torch.randn(4, 6, 8, generator=make_generator(8))
    mask = padded_mask(4, 6)
    release = hidden_release(HiddenStatePrivatizer(eta=None), h, mask, seed=9)
    real = mask.bool()
    assert torch.equal(release.values[real], h[real]) and bool((release.values[~real] == 0).all())
    assert not bool(release.noised.any()) and torch.equal(release.exact, real)
    assert release.spend.amount == 0.0


def test_hidden_clip_norm_clips_before_the_noise():
    clip = 2.0
    h = torch.randn(300, 5, 6, generator=make_generator(10), dtype=torch.float64)
    h[::2] *= 3  # some rows above the clip, some below
    mask = torch.ones(300, 5, dtype=torch.long)
    norms = h.norm(dim=-1, keepdim=True)
    clipped = h * torch.clamp(clip / norms, max=1.0)  # the clip, written out here
    assert bool((norms > clip).any()) and bool((norms < clip).any())

    exact = hidden_release(HiddenStatePrivatizer(eta=None, clip_norm=clip), h, mask, seed=11).values
    assert bool((exact.norm(dim=-1) <= clip * (1 + 1e-12)).all())
    inside = norms.squeeze(-1) <= clip
    assert torch.equal(exact[inside], h[inside])  # short rows untouched
    assert torch.allclose(exact[~inside].norm(dim=-1), torch.full_like(exact[~inside][:, 0], clip))
    cosine = torch.nn.functional.cosine_similarity(exact[~inside], h[~inside], dim=-1)
    assert torch.allclose(cosine, torch.ones_like(cosine))  # direction kept

    noisy = hidden_release(HiddenStatePrivatizer(eta=3.0, clip_norm=clip), h, mask, seed=12).values
    unclipped = hidden_release(HiddenStatePrivatizer(eta=3.0), clipped, mask, seed=12).values
    assert torch.allclose(noisy, unclipped)  # same noise, added to the clipped rows
    assert bool((noisy.norm(dim=-1) > clip).any())  # the noise itself is not clipped
    z_norms = (noisy - clipped).norm(dim=-1).flatten().numpy()
    assert stats.kstest(z_norms, "gamma", args=(6, 0, 1 / 3.0)).pvalue > P_THRESHOLD


def test_hidden_release_is_reproducible_from_a_seed():
    h = torch.randn(3, 4, 5, generator=make_generator(13))
    mask = ones_mask(torch.zeros(3, 4, dtype=torch.long))
    privatizer = HiddenStatePrivatizer(eta=1.0)
    assert torch.equal(hidden_release(privatizer, h, mask, 14).values, hidden_release(privatizer, h, mask, 14).values)
    assert not torch.equal(hidden_release(privatizer, h, mask, 14).values,
                           hidden_release(privatizer, h, mask, 15).values)


def one_hidden_row(privatizer: HiddenStatePrivatizer) -> Callable[[torch.Tensor, int, torch.Generator], torch.Tensor]:
    """n releases of one hidden-state row (a one-token sentence) through the privatizer."""
    def sample(point: torch.Tensor, n: int, generator: torch.Generator) -> torch.Tensor:
        cut = point.reshape(1, 1, -1).expand(n, 1, -1).clone()
        ids = torch.zeros(n, 1, dtype=torch.long)
        return privatizer.privatize(cut, ids, ones_mask(ids), generator=generator).values[:, 0, :]
    return sample


def test_hidden_audit_stays_below_eta_times_distance_and_catches_too_little_noise():
    eta, x, x_prime = 2.0, torch.zeros(2, dtype=torch.float64), torch.tensor([0.6, 0.8], dtype=torch.float64)
    claim = eta * (x - x_prime).norm().item()  # = 2
    result = audit_mechanism(one_hidden_row(HiddenStatePrivatizer(eta=eta)), x, x_prime, kind="continuous",
                             n_samples=20_000, claimed_epsilon=claim, generator=make_generator(16))
    assert not result.exceeds_claim and result.eps_lower <= claim
    assert result.eps_lower > 0.5 * claim  # the loss is detectable: the audit has power here
    weak = audit_mechanism(one_hidden_row(HiddenStatePrivatizer(eta=4 * eta)), x, x_prime, kind="continuous",
                           n_samples=20_000, claimed_epsilon=claim, generator=make_generator(17))
    assert weak.exceeds_claim  # 4x too little noise for the claim would be caught


# --- embedding rows (k = 0) -------------------------------------------------------------------------

def embedding_release(privatizer: EmbeddingPrivatizer, ids: torch.Tensor, mask: torch.Tensor, seed: int,
                      table: torch.Tensor = SQUARE) -> Release:
    return privatizer.privatize(table[ids], ids, mask, generator=make_generator(seed))


def test_every_noised_release_is_a_vocabulary_row_and_exact_positions_are_untouched():
    ids = torch.randint(0, 6, (200, 9), generator=make_generator(18))
    ids[:, 0] = SPECIAL
    mask = padded_mask(200, 9)
    privatizer = EmbeddingPrivatizer(SQUARE, eta=1.0, exempt_ids=[EXEMPT], special_ids=[SPECIAL])
    cut = SQUARE[ids] + 0.01  # the cut is what is released exactly, whatever its rows
    release = privatizer.privatize(cut, ids, mask, generator=make_generator(19))
    real = mask.bool()
    special, exempt = real & (ids == SPECIAL), real & (ids == EXEMPT)
    assert torch.equal(release.released, real) and torch.equal(release.exempt, exempt)
    assert torch.equal(release.noised, real & ~special & ~exempt) and torch.equal(release.exact, special | exempt)
    ids_of(release.values[release.noised], SQUARE)  # each noised release is exactly one row
    assert torch.equal(release.values[special | exempt], cut[special | exempt])
    assert bool((release.values[~real] == 0).all()) and int((~real).sum()) > 0
    assert release.spend.unit is PrivacyUnit.ETA_TOKEN
    assert release.spend.amount == pytest.approx(1.0 * int(release.noised.sum()))  # neither special nor exempt
    released_ids = ids_of(release.values[release.noised], SQUARE)
    assert (released_ids != ids[release.noised]).float().mean() > 0.2  # the noise does move tokens


class _Recorded(DChiLaplace):
    """The real d_chi noise, each noisy batch kept in ``drawn``."""

    drawn: ClassVar[list[torch.Tensor]] = []

    def sample(self, x: torch.Tensor, **options: object) -> torch.Tensor:
        self.drawn.append(super().sample(x, **options))  # type: ignore[arg-type]
        return self.drawn[-1]


def test_the_projection_is_the_nearest_row_chunk_by_chunk_to_the_bit(monkeypatch):
    """Over 1024 noised positions (two chunks of squared distances): every release is the row argmin picks over
    ||x||^2 - 2 x.e + ||e||^2 per chunk of 1024, as SAP's privatizer always projected (so releases stay the same)."""
    monkeypatch.setattr(privatizer_module, "DChiLaplace", _Recorded)
    _Recorded.drawn.clear()
    table = torch.randn(50, 8, generator=make_generator(30))
    ids = torch.randint(0, 50, (30, 40), generator=make_generator(31))
    release = embedding_release(EmbeddingPrivatizer(table, eta=2.0), ids, ones_mask(ids), seed=32, table=table)
    (noisy,) = _Recorded.drawn
    assert noisy.shape[0] > 1024
    norms = table.pow(2).sum(dim=-1)
    expected = torch.cat([squared_distances(chunk, table, norms).argmin(dim=-1) for chunk in noisy.split(1024)])
    assert torch.equal(ids_of(release.values[release.noised], table), expected)


def test_a_tie_goes_to_the_lowest_id(monkeypatch):
    """Noise that lands on the square's centre is equally far from its four corners: the release is row 0."""
    centre = torch.tensor([0.5, 0.5], dtype=SQUARE.dtype)
    landing = type("Landing", (DChiLaplace,), {"sample": lambda self, x, generator: centre.expand_as(x).clone()})
    monkeypatch.setattr(privatizer_module, "DChiLaplace", landing)
    ids = torch.tensor([[3, 2, 1]])
    release = embedding_release(EmbeddingPrivatizer(SQUARE, eta=1.0), ids, ones_mask(ids), seed=33)
    assert ids_of(release.values[0], SQUARE).tolist() == [0, 0, 0]


def test_exempt_eta_noises_exempt_positions_at_their_own_level_and_charges_it():
    ids = torch.tensor([[SPECIAL, 0, EXEMPT, 1, EXEMPT, SPECIAL, 2]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 0]])
    privatizer = EmbeddingPrivatizer(SQUARE, eta=0.5, exempt_ids=[EXEMPT], exempt_eta=3.0, special_ids=[SPECIAL])
    release = embedding_release(privatizer, ids, mask, seed=20)
    assert release.noised.tolist() == [[False, True, True, True, True, False, False]]
    assert release.exempt.tolist() == [[False, False, True, False, True, False, False]]
    assert release.spend.amount == pytest.approx(0.5 * 2 + 3.0 * 2)
    assert privatizer.spend_of(ids, mask) == release.spend
    assert EmbeddingPrivatizer(SQUARE, eta=None, exempt_eta=3.0, exempt_ids=[EXEMPT]).spend_of(ids, mask).amount == 0


def test_a_batch_with_nothing_to_noise_is_released_exactly():
    ids = torch.tensor([[SPECIAL, EXEMPT, SPECIAL, 0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    privatizer = EmbeddingPrivatizer(SQUARE, eta=1.0, exempt_ids=[EXEMPT], special_ids=[SPECIAL])
    release = embedding_release(privatizer, ids, mask, seed=21)
    assert torch.equal(release.values[0, :3], SQUARE[ids[0, :3]]) and bool((release.values[0, 3] == 0).all())
    assert not bool(release.noised.any()) and release.spend.amount == 0.0


def test_the_released_token_law_matches_an_independent_monte_carlo():
    n, eta = 10_000, 1.5
    table = SQUARE[:4]
    ids = torch.arange(4).repeat(n, 1)  # every token of the 4-row vocabulary, n times
    release = embedding_release(EmbeddingPrivatizer(table, eta=eta), ids, ones_mask(ids), seed=22, table=table)
    released = ids_of(release.values, table)
    for token in range(4):
        reference = reference_release(table[token].expand(n, 2), eta, table, seed=100 + token)
        assert_same_law(released[:, token], reference, 4)
        assert 0.3 < (released[:, token] == token).float().mean() < 0.95  # informative: neither fixed nor uniform


def test_exempt_eta_keeps_exempt_tokens_much_more_often_as_the_math_says():
    # Rows 0 and 1 alone near the origin; 2 and 3 far away: at eta = 0.5 a token often crosses the gap,
    # at exempt_eta = 8 it almost never leaves its own cell.
    table = torch.tensor([[0.0, 0.0], [0.0, 1.0], [6.0, 0.0], [6.0, 1.0]], dtype=torch.float64)
    n, eta, exempt_eta = 10_000, 0.5, 8.0
    ids = torch.tensor([0, 1]).repeat(n, 1)  # 0 at eta, 1 exempt at exempt_eta
    privatizer = EmbeddingPrivatizer(table, eta=eta, exempt_ids=[1], exempt_eta=exempt_eta)
    release = embedding_release(privatizer, ids, ones_mask(ids), seed=23, table=table)
    released = ids_of(release.values, table)
    for column, (token, level) in enumerate([(0, eta), (1, exempt_eta)]):
        assert_same_law(released[:, column], reference_release(table[token].expand(n, 2), level, table, 200), 4)
    kept_at_eta = (released[:, 0] == 0).float().mean()
    kept_exempt = (released[:, 1] == 1).float().mean()
    assert kept_at_eta < 0.6 and kept_exempt > 0.95
    assert release.spend.amount == pytest.approx(n * (eta + exempt_eta))


def one_token(privatizer: EmbeddingPrivatizer, table: torch.Tensor
              ) -> Callable[[torch.Tensor, int, torch.Generator], torch.Tensor]:
    """n releases of one token (a one-token sentence) through the privatizer, as released ids."""
    def sample(point: torch.Tensor, n: int, generator: torch.Generator) -> torch.Tensor:
        ids = point.reshape(1, 1).expand(n, 1).clone()
        values = privatizer.privatize(table[ids], ids, ones_mask(ids), generator=generator).values[:, 0, :]
        return ids_of(values, table)
    return sample


def test_embedding_audit_stays_below_eta_times_distance_and_catches_too_little_noise():
    table, eta = SQUARE[:4], 3.0
    x, x_prime = torch.tensor(0), torch.tensor(1)
    claim = eta * (table[0] - table[1]).norm().item()  # = 3
    result = audit_mechanism(one_token(EmbeddingPrivatizer(table, eta=eta), table), x, x_prime, kind="discrete",
                             n_samples=20_000, claimed_epsilon=claim, generator=make_generator(24))
    assert not result.exceeds_claim and result.eps_lower <= claim
    assert result.eps_lower > 1.0  # detectable
    weak = audit_mechanism(one_token(EmbeddingPrivatizer(table, eta=4 * eta), table), x, x_prime, kind="discrete",
                           n_samples=20_000, claimed_epsilon=claim, generator=make_generator(25))
    assert weak.exceeds_claim


# --- straight-through -------------------------------------------------------------------------------

@pytest.mark.parametrize("privatizer", [EmbeddingPrivatizer(SQUARE, eta=1.0, special_ids=[SPECIAL]),
                                        HiddenStatePrivatizer(eta=1.0, clip_norm=1.0)], ids=["embedding", "hidden"])
def test_straight_through_equals_the_release_with_identity_gradient(privatizer):
    ids = torch.randint(0, 6, (3, 5), generator=make_generator(26))
    mask = padded_mask(3, 5)
    cut = SQUARE[ids].clone().requires_grad_(True)
    release = privatizer.privatize(cut, ids, mask, generator=make_generator(27))
    assert not release.values.requires_grad
    out = privatizer.straight_through(cut, release)
    assert out.requires_grad  # cut + (release - cut).detach(): the release up to the rounding of that sum
    torch.testing.assert_close(out, release.values, rtol=0, atol=1e-12)
    weights = torch.randn(cut.shape, generator=make_generator(28), dtype=cut.dtype)
    (weights * out).sum().backward()
    assert cut.grad is not None and torch.equal(cut.grad, weights)


# --- bad input --------------------------------------------------------------------------------------

@pytest.mark.parametrize("value", BAD_LEVELS)
def test_bad_levels_are_refused_by_name(value):
    with pytest.raises(ValueError, match="eta"):
        EmbeddingPrivatizer(SQUARE, eta=value)
    with pytest.raises(ValueError, match="exempt_eta"):
        EmbeddingPrivatizer(SQUARE, eta=1.0, exempt_eta=value)
    with pytest.raises(ValueError, match="eta"):
        HiddenStatePrivatizer(eta=value)
    with pytest.raises(ValueError, match="clip_norm"):
        HiddenStatePrivatizer(eta=1.0, clip_norm=value)


@pytest.mark.parametrize(("name", "ids"), [("exempt_ids", [6]), ("exempt_ids", [-1]), ("special_ids", [6]),
                                           ("special_ids", [0, -2])])
def test_ids_out_of_range_are_refused(name, ids):
    with pytest.raises(ValueError, match=name):
        EmbeddingPrivatizer(SQUARE, eta=1.0, **{name: ids})


@pytest.mark.parametrize("vocabulary", [SQUARE.long(), SQUARE[0], SQUARE.unsqueeze(0),
                                        torch.tensor([[0.0, float("nan")]])])
def test_bad_vocabularies_are_refused(vocabulary):
    with pytest.raises(ValueError, match="vocabulary"):
        EmbeddingPrivatizer(vocabulary, eta=1.0)


@pytest.mark.parametrize("privatizer", [EmbeddingPrivatizer(SQUARE, eta=1.0), HiddenStatePrivatizer(eta=1.0)],
                         ids=["embedding", "hidden"])
@pytest.mark.parametrize("cut", [SQUARE[torch.zeros(2, 3, dtype=torch.long)].long(), SQUARE[:3],
                                 SQUARE[torch.zeros(1, 2, 3, dtype=torch.long)],
                                 torch.full((2, 3, 2), float("inf"))], ids=["long", "2-D", "4-D", "inf"])
def test_bad_cuts_are_refused(privatizer, cut):
    ids = torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="cut"):
        privatizer.privatize(cut, ids, ones_mask(ids), generator=make_generator(29))
