"""InferDPT's RANTEXT (Tong et al. 2023), on the device model's candidate vocabulary, with a sound bound.

The mechanism, per token t with embedding row phi(t) (every token of the prompt is replaced):

1. draw z with independent coordinates z_j ~ Laplace(0, b_j), b_j = Delta_j / eps, where Delta_j is
   the range (max - min) of dimension j over the candidate rows; let r = ||z||_2, the distance of
   the noisy embedding phi(t) + z from phi(t). Only r is used, and r depends on |z_j| = b_j E_j
   (E_j ~ Exp(1)) alone, so r's law is the same for every token;
2. the candidate set is C_r(t) = {y in C : d(t, y) <= r}, d the Euclidean distance of embedding rows;
3. y is drawn from C_r(t) with P(y | t, r) ∝ exp(eps u / 2), u = (r - d(t, y)) / r in [0, 1].

privlm uses no fitted epsilon curve (the reference code bends eps above 2 with one), and makes one
addition, for inputs that are no candidate (the tokenizer's unknown token): their set always holds
their nearest candidate (r is replaced by max(r, min_y d(t, y))), so it is never empty. A candidate
input is at distance 0 from itself and needs no such rule.

The exact output law is P(y | t) = E_r[P(y | t, r)], and ``log_probabilities`` integrates over r
numerically, with conditional probabilities exact given r:

- the law of r^2 = sum_j b_j^2 E_j^2 is computed on a grid of 65,536 points by FFT convolution of the
  d per-dimension laws (each discretised so that its mass and mean are exact); its round-off is
  about 1e-18 per point, and points below 1e-15 are dropped, so the law is resolved down to tail
  probabilities of about 1e-13 (the law at eps = 1 is cached per vocabulary; r scales as 1 / eps);
- the grid is cut into bins holding at most 1/512 of the mass and spanning at most 1/512 of r's
  range (so the tails keep fine bins), about 1,000 in all; P(y | t) ~ sum_k w_k P(y | t, r_k) with
  r_k a bin's mean radius and w_k its mass.

Accuracy (tests): against an exact integral on a one-dimensional vocabulary, and against a rule 4
times finer on SmolLM2's, total variation below 1e-3 and exact privacy losses within about 0.05.
An output whose probability is below the resolution (about 1e-13 times P(y | t, r) at the farthest
bins) gets probability 0, so an unresolved pair of inputs shows an infinite loss: compare losses only
over outputs whose probabilities are finite under both inputs, and say so.

Privacy. The paper claims eps-DP per token. It does not hold: the candidate set is centred on the
true token, so an output near t and far from t' needs a large r under t' and not under t, and r is
concentrated (its relative spread is a few percent in 576 dimensions). The tests show the exact loss
above eps on a one-dimensional vocabulary (exact integrals, every eps tried) and between two real
SmolLM2 tokens (" Paris" and " the" at eps = 6, every output resolved). On SmolLM2 the claim does
hold at small eps, where r exceeds every distance and the law is SANTEXT-like with scale eps / r.
The auditor, which needs many draws of an output, cannot reach the rare outputs where the loss is
large: its lower bound stays below eps at feasible sample sizes.

privlm's sound bound, for inputs t != t' with delta = d(t, t') and R >= max(D(t), D(t')) (D(t): the
largest distance from t to a candidate, so that for r >= R both sets are all of C):

    P(y | t) <= e^{eps delta / R} P(y | t')  +  P(r < R)        (for r >= R both laws are SANTEXT-like
                                                                 with scale eps / r, the ratio <= e^{eps delta / r})
    P(y | t') >= P(r >= R) e^{-eps / 2} / |C|                    (the weights of a full set lie in [1, e^{eps/2}])

    => |ln P(y | t) / P(y | t')| <= ln( e^{eps delta / R} + P(r < R) |C| e^{eps / 2} / P(r >= R) ),

minimised over R on a grid. P(r < R) is bounded above by Chernoff's bound on r^2 = sum_j b_j^2 E_j^2
(E e^{-c E^2} = sqrt(pi) / (2 sqrt(c)) erfcx(1 / (2 sqrt(c))), exact), and P(r >= R) below by the
larger of Paley-Zygmund's bound on r^2 and P(some |z_j| >= R) = 1 - prod_j (1 - e^{-R / b_j}). The
bound is small when eps is small (r is then larger than every distance: a SANTEXT-like law) and
grows about linearly in eps beyond (roughly eps * R / max_j Delta_j + ln |C|). ``privacy_bound``
returns it (``claim_source``), summed over positions; ``paper_bound`` returns the paper's eps per
position. ``spend`` charges the data-independent worst case per token: the pair bound at
delta = R = 2 max_t ||phi(t) - c|| (c: the centre of the table's bounding box), in
``PrivacyUnit.EPSILON``; the perturber's report gives both totals ("paper": eps per token).

Like for like: the device model's tokenizer, candidate set and input embeddings (Cape's); the paper
used OpenAI's ada-002 embeddings.

Mechanism object. :class:`InferDPTMechanism` implements the privlm mechanism protocol on token ids:
x is an int64 tensor of token ids, 0-d (one position) or 1-D (n positions), one independent release
per id; outputs are candidate indices (0 .. |C| - 1) of shape ``x.shape`` (with ``num_samples=m``:
``(m, *x.shape)``); ``log_probabilities(x)`` has shape ``(*x.shape, |C|)``. Sampling draws a fresh r per
release and takes one distance row per distinct input token; each release is one inverse-CDF draw
over its set: a prompt's tokens all at once over their rows, and many releases of one token (tests,
audits) over prefixes of its row sorted once, in blocks of like radii. No loop over the vocabulary.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cached_property
from typing import ClassVar

import numpy as np
import torch
from scipy import special

from privlm.accounting import Ledger
from privlm.baselines.santext import check_token_ids, distance_rows, draws_shape, pair_distances
from privlm.baselines.token_level import TokenLevelBaseline
from privlm.mechanisms import OutputKind, PrivacyUnit, Spend
from privlm.mechanisms.randomness import resolve_generator
from privlm.models.perturbation import Accounting
from privlm.models.vocabulary import CandidateVocabulary
from privlm.validation import check_positive_finite

FINE_GRID = 2**16  # points of the numerical law of r^2
MASS_BINS, WIDTH_BINS = 512, 512  # quadrature bins: at most 1/512 of the mass, and 1/512 of the range of r, each
MASS_FLOOR = 1e-15  # grid masses below this are FFT round-off (about 1e-18) or beyond resolution: dropped
ROWS_PER_BLOCK = 64  # distinct input tokens whose distance rows are held at once
FEW_DRAWS = 16  # releases of one token up to which its row is not sorted
BLOCK_ELEMENTS = 2**22  # float64 entries of one block of sampling or integration work (32 MiB)
_CHERNOFF_GRID = np.geomspace(1e-8, 1e10, 1200)  # lambda * mean(b^2): any lambda gives a valid bound
_R_GRID = 64  # radii R tried by the pair bound
_TINY = 1e-300  # the smallest radius: the set is then {y : d(x, y) = 0}
_UNIT_LAWS: dict[str, tuple[np.ndarray, np.ndarray]] = {}


# --- the law of r ------------------------------------------------------------------------------
def squared_radius_law(scales: np.ndarray, *, points: int = FINE_GRID) -> tuple[np.ndarray, np.ndarray]:
    """The law of r^2 = sum_j b_j^2 E_j^2 on a grid: points x_k = k h and their masses p_k (float64).

    ``points`` is the grid size for 64 dimensions or more (finer with fewer). Each term's mass on
    [k h, (k+1) h) is split between k h and (k+1) h so that its mean is exact (P(b^2 E^2 in a bin)
    and E[b^2 E^2; bin] have closed forms); the terms are convolved by FFT.
    The grid reaches past the point where the heaviest term alone has tail e^{-45}, so the mass
    that wraps around is below the FFT's round-off.
    """
    b = scales[scales > 0]
    mean = 2 * float((b**2).sum())
    # With few dimensions r has mass near 0, where a grid uniform in r^2 is coarse in r: refine it.
    points *= max(1, 64 // b.size)
    h = max(4 * mean, (45 * float(b.max())) ** 2) / points
    k = np.arange(points + 1)
    spectrum = np.ones(points // 2 + 1, dtype=complex)
    for chunk in np.array_split(b, max(1, b.size // 16)):
        e = np.sqrt(k * h)[None, :] / chunk[:, None]  # bin edges in units of E
        survival = np.exp(-e)
        mass = survival[:, :-1] - survival[:, 1:]
        moment = chunk[:, None] ** 2 * np.diff(-(e * e + 2 * e + 2) * survival, axis=1)  # E[b^2 E^2; bin]
        right = np.clip((moment - k[None, :-1] * h * mass) / h, 0, mass)
        pmf = mass - right
        pmf[:, 1:] += right[:, :-1]
        spectrum *= np.fft.rfft(pmf, axis=1).prod(axis=0)
    masses = np.fft.irfft(spectrum, n=points)
    return k[:-1] * h, np.where(masses > MASS_FLOOR, masses, 0.0)


def unit_squared_radius_law(ranges: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """:func:`squared_radius_law` at eps = 1 (scales = ranges), cached per process."""
    values = ranges.double().cpu().numpy()
    key = hashlib.sha256(values.tobytes() + f"/{FINE_GRID}/{MASS_FLOOR}".encode()).hexdigest()
    if key not in _UNIT_LAWS:
        _UNIT_LAWS[key] = squared_radius_law(values)
    return _UNIT_LAWS[key]


def quadrature(radii: np.ndarray, masses: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Bins of the grid law of r: a new bin every 1/MASS_BINS of mass or 1/WIDTH_BINS of r's range.

    Returns the nodes (the mean r of each bin) and weights (its mass). Equal-mass bins resolve the
    bulk; equal-width bins keep the tails, where masses are tiny, resolved too.
    """
    kept = masses > 0
    r, p = radii[kept], masses[kept]
    below = np.cumsum(p) - p / 2
    by_mass = np.floor(below / below[-1] * MASS_BINS)
    by_width = np.floor((r - r[0]) / max(r[-1] - r[0], np.finfo(float).tiny) * WIDTH_BINS)
    starts = np.concatenate([[True], (np.diff(by_mass) != 0) | (np.diff(by_width) != 0)])
    bin_of = np.cumsum(starts) - 1
    weights = np.bincount(bin_of, weights=p)
    return np.bincount(bin_of, weights=p * r) / weights, weights


@dataclass(frozen=True, eq=False)
class RadiusLaw:
    """r = ||z||_2 with independent z_j ~ Laplace(0, b_j), b_j = ranges_j / eps: r^2 = sum_j b_j^2 E_j^2."""

    ranges: torch.Tensor  # (d,) float64 Delta_j
    epsilon: float

    @cached_property
    def scales(self) -> torch.Tensor:
        return self.ranges.double() / self.epsilon

    def sample(self, shape: tuple[int, ...], *, generator: torch.Generator) -> torch.Tensor:
        """Float64 draws of r, of ``shape``; at most BLOCK_ELEMENTS noise entries at a time."""
        d, n = self.scales.numel(), math.prod(shape)
        scales = self.scales.to(generator.device)
        rows = max(1, BLOCK_ELEMENTS // d)
        draws = [torch.empty(0, dtype=torch.float64, device=generator.device)]
        for start in range(0, n, rows):
            magnitudes = torch.empty((min(rows, n - start), d), dtype=torch.float64, device=generator.device)
            magnitudes.exponential_(generator=generator)  # |z_j| / b_j
            draws.append((magnitudes * scales).norm(dim=-1))
        return torch.cat(draws).reshape(shape)

    @cached_property
    def _grid(self) -> tuple[np.ndarray, np.ndarray]:
        """Radii and masses of the numerical law (the unit law, scaled: r is proportional to 1 / eps)."""
        squares, masses = unit_squared_radius_law(self.ranges)
        return np.sqrt(squares) / self.epsilon, masses

    def cdf(self, s: np.ndarray) -> np.ndarray:
        """Numerical P(r <= s) (absolute error about 1e-12)."""
        radii, masses = self._grid
        return np.interp(s, radii, np.cumsum(masses))

    @cached_property
    def nodes_and_weights(self) -> tuple[np.ndarray, np.ndarray]:
        """The quadrature rule of ``log_probabilities``: at most MASS_BINS + WIDTH_BINS nodes."""
        return quadrature(*self._grid)

    @cached_property
    def _b2(self) -> np.ndarray:
        return self.scales.cpu().numpy() ** 2

    @property
    def mean_square(self) -> float:
        """E r^2 = sum_j 2 b_j^2."""
        return float(2 * self._b2.sum())

    @property
    def fourth_moment(self) -> float:
        """E r^4 = Var r^2 + (E r^2)^2, with Var(b^2 E^2) = 20 b^4."""
        return float(20 * (self._b2**2).sum()) + self.mean_square**2

    def log_tail_lower_bound(self, s: float) -> float:
        """ln of a lower bound on P(r >= s): Paley-Zygmund on r^2, or one coordinate reaching s alone."""
        if s <= 0:
            return 0.0
        b = self.scales.double().cpu().numpy()
        exponents = -s / b[b > 0]
        with np.errstate(divide="ignore"):
            log_none = float(np.log1p(-np.exp(exponents)).sum())  # ln P(every |z_j| < s)
        one = max(float(exponents.max()), math.log(-math.expm1(log_none)) if log_none < 0 else -math.inf)
        theta = s * s / self.mean_square
        if theta >= 1:
            return one
        paley_zygmund = 2 * math.log1p(-theta) + 2 * math.log(self.mean_square) - math.log(self.fourth_moment)
        return max(one, paley_zygmund)

    @cached_property
    def _chernoff_terms(self) -> tuple[np.ndarray, np.ndarray]:
        """lambda on a grid and sum_j ln E exp(-lambda b_j^2 E_j^2) at each."""
        lam = _CHERNOFF_GRID / self._b2.mean()
        c = lam[:, None] * self._b2[None, :]
        with np.errstate(divide="ignore"):
            w = 1 / (2 * np.sqrt(c))  # E e^{-c E^2} = sqrt(pi) w erfcx(w); c = 0 gives 1
            log_mgf = np.where(c > 0, np.log(np.sqrt(np.pi) * w * special.erfcx(w)), 0.0)
        return lam, log_mgf.sum(axis=1)

    def log_head_upper_bound(self, s: float) -> float:
        """ln of an upper bound on P(r < s): Chernoff, P(r^2 <= s^2) <= e^{lambda s^2} E e^{-lambda r^2}."""
        lam, log_mgf = self._chernoff_terms
        return min(0.0, float((lam * s * s + log_mgf).min()))


# --- the mechanism -----------------------------------------------------------------------------
def _rows_in_blocks(vocabulary: CandidateVocabulary,
                    ids: torch.Tensor) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """(id, ascending distance row, candidate order) for each id, one block of rows at a time."""
    for block in ids.split(ROWS_PER_BLOCK):
        rows, order = distance_rows(vocabulary, block).sort(dim=-1)
        yield from zip(block.tolist(), rows, order, strict=True)


@dataclass(frozen=True, eq=False)
class InferDPTMechanism:
    """RANTEXT at one position per token id (see the module doc). Claim: privlm's sound pair bound.

    Input x: int64 token ids, 0-d or 1-D, one release per id; output: candidate indices, shape x.shape
    (``num_samples=m``: (m, *x.shape)). ``paper_bound`` is the paper's claim; ``spend`` the sound worst case.
    """

    unit: ClassVar[PrivacyUnit] = PrivacyUnit.EPSILON  # the sound bound holds against any token, at any distance
    vocabulary: CandidateVocabulary
    epsilon: float
    claim_source: str = field(default="privlm's sound bound (the paper's eps per token is unsound: see paper_bound "
                                      "and the tests)", init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "epsilon", check_positive_finite("epsilon", self.epsilon))
        if self.vocabulary.size < 2 or not (self.ranges > 0).any():
            raise ValueError("InferDPT needs at least two distinct candidate rows")

    @property
    def output_kind(self) -> OutputKind:
        return "discrete"

    @cached_property
    def ranges(self) -> torch.Tensor:
        """(d,) Delta_j = max - min of dimension j over the candidate rows (float64)."""
        table = self.vocabulary.candidate_embeddings  # max and min are exact in float32
        return (table.amax(dim=0) - table.amin(dim=0)).double()

    @cached_property
    def radius(self) -> RadiusLaw:
        """The law of r: Laplace scales b_j = Delta_j / eps."""
        return RadiusLaw(self.ranges, self.epsilon)

    @cached_property
    def _quadrature(self) -> tuple[torch.Tensor, torch.Tensor]:
        nodes, weights = self.radius.nodes_and_weights
        device = self.vocabulary.device
        return torch.from_numpy(nodes).to(device), torch.from_numpy(weights).to(device)

    # --- the law given r --------------------------------------------------------------------------
    def _weights(self, rows: torch.Tensor, radii: torch.Tensor) -> torch.Tensor:
        """(k, |C|): exp(eps u / 2) over each distance row (k, |C|) for its radius (k,), up to a factor per row
        (exp(-eps (d - d_0) / 2r), in (0, 1], the nearest member 1), and 0 outside each set."""
        nearest = rows.min(dim=-1, keepdim=True).values
        radii = torch.maximum(radii[:, None], nearest).clamp_min(_TINY)
        weight = ((rows - nearest) * (-self.epsilon / (2 * radii))).exp_()
        return weight.masked_fill_(rows > radii, 0.0)

    def _prefix_weights(self, ascending: torch.Tensor, radii: torch.Tensor) -> torch.Tensor:
        """:meth:`_weights` for an ascending row, over the prefix the largest radius reaches: (k, W)."""
        radii = _effective(radii, ascending)
        width = torch.searchsorted(ascending, radii, right=True)
        d = ascending[: int(width.max())] - ascending[0]
        weight = torch.outer(-self.epsilon / (2 * radii), d).exp_()
        if int(width.min()) < d.numel():  # some sets are not the whole prefix
            position = torch.arange(d.numel(), device=d.device)
            weight.masked_fill_(position >= width[:, None], 0.0)
        return weight

    def conditional_log_probabilities(self, x: torch.Tensor, radius: torch.Tensor) -> torch.Tensor:
        """Exact ln P(y | x, r), shape (*x.shape, |C|); ``radius`` (float) broadcasts to x.shape."""
        x = check_token_ids("x", x, self.vocabulary)
        radius = _check_radius(radius).to(self.vocabulary.device).broadcast_to(x.shape).reshape(-1)
        rows = distance_rows(self.vocabulary, x.reshape(-1))
        r = torch.maximum(radius, rows.min(dim=-1).values).clamp_min(_TINY)[:, None]
        logits = ((self.epsilon / 2) * (r - rows) / r).masked_fill(rows > r, -math.inf)
        return torch.log_softmax(logits, dim=-1).reshape(*x.shape, -1)

    def sample_given_radius(self, x: torch.Tensor, radius: torch.Tensor, *,
                            generator: torch.Generator | None = None) -> torch.Tensor:
        """Candidate indices of shape radius.shape (x broadcast to it): one exact draw from each set C_r(x)."""
        x = check_token_ids("x", x, self.vocabulary)
        radius = _check_radius(radius).to(self.vocabulary.device)
        generator = resolve_generator(generator, self.vocabulary.device)
        flat_x, flat_r = x.broadcast_to(radius.shape).reshape(-1), radius.reshape(-1)
        distinct, which = flat_x.unique(return_inverse=True)
        many = torch.bincount(which) > FEW_DRAWS  # per distinct token: sort its row once and draw within prefixes
        out = torch.empty_like(flat_x)
        for first, block in zip(range(0, distinct.numel(), ROWS_PER_BLOCK), distinct.split(ROWS_PER_BLOCK),
                                strict=True):
            rows = distance_rows(self.vocabulary, block)
            local = which - first
            in_block = (local >= 0) & (local < block.numel())
            # A prompt's tokens (a few releases each): one pass over their rows, all at once.
            few = (in_block & ~many[which]).nonzero().squeeze(-1)
            for members in few.split(max(1, BLOCK_ELEMENTS // rows.shape[1])):
                out[members] = _inverse_cdf(self._weights(rows[local[members]], flat_r[members]), generator)
            for k in many[first: first + block.numel()].nonzero().squeeze(-1).tolist():
                members = (local == k).nonzero().squeeze(-1)
                ascending, order = rows[k].sort()
                out[members] = order[self._draw_sorted(ascending, flat_r[members], generator)]
        return out.reshape(radius.shape)

    def _draw_sorted(self, ascending: torch.Tensor, radii: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """Positions in the ascending row, one per radius; in blocks of like radii, each over its prefix only."""
        order = radii.argsort()
        picks = torch.empty_like(order)
        start = 0
        for block in _blocks_by_width(ascending, radii[order]):
            picks[order[start: start + block.numel()]] = _inverse_cdf(self._prefix_weights(ascending, block), generator)
            start += block.numel()
        return picks

    # --- the protocol --------------------------------------------------------------------------
    def sample(self, x: torch.Tensor, *, num_samples: int | None = None,
               generator: torch.Generator | None = None) -> torch.Tensor:
        """Candidate indices of shape x.shape (``num_samples=m``: (m, *x.shape)); a fresh r per release."""
        x = check_token_ids("x", x, self.vocabulary)
        generator = resolve_generator(generator, self.vocabulary.device)
        radius = self.radius.sample(draws_shape(x, num_samples), generator=generator)
        return self.sample_given_radius(x, radius, generator=generator)

    def log_probabilities(self, x: torch.Tensor) -> torch.Tensor:
        """ln of the M-node integration of P(y | x, r) over r (float64), shape (*x.shape, |C|); see the module doc."""
        x = check_token_ids("x", x, self.vocabulary)
        flat = x.reshape(-1)
        distinct, which = flat.unique(return_inverse=True)
        rows = torch.empty((distinct.numel(), self.vocabulary.size), dtype=torch.float64, device=flat.device)
        for k, (_, row, order) in enumerate(_rows_in_blocks(self.vocabulary, distinct)):
            rows[k, order] = self._integrate(row)
        return rows.log()[which].reshape(*x.shape, -1)

    def _integrate(self, sorted_row: torch.Tensor) -> torch.Tensor:
        """sum_k w_k P(y | x, r_k) over the quadrature nodes (ascending), for the sorted row, in blocks of nodes."""
        nodes, weights = self._quadrature
        total = torch.zeros_like(sorted_row)
        start = 0
        for radii in _blocks_by_width(sorted_row, nodes):
            mass = weights[start: start + radii.numel()]
            start += radii.numel()
            weight = self._prefix_weights(sorted_row, radii)
            total[: weight.shape[-1]] += weight.T @ (mass / weight.sum(dim=-1))
        return total

    def pair_bound(self, delta: float, reach: float) -> float:
        """Sound bound on max_y |ln P(y|t) / P(y|t')| for d(t, t') = delta and max(D(t), D(t')) <= reach."""
        if delta == 0:
            return 0.0
        top = max(reach, 2 * math.sqrt(self.radius.mean_square))
        log_size = math.log(self.vocabulary.size)
        best = math.inf
        for big_r in np.geomspace(reach, top, _R_GRID):
            tail = self.radius.log_head_upper_bound(big_r) + log_size + self.epsilon / 2 \
                - self.radius.log_tail_lower_bound(big_r)
            best = min(best, float(np.logaddexp(self.epsilon * delta / big_r, tail)))
        return best

    def privacy_bound(self, x: torch.Tensor, x_prime: torch.Tensor) -> float:
        """privlm's sound bound, summed over positions (0 where x_i == x'_i); ``paper_bound`` gives the paper's."""
        x, x_prime = check_token_ids("x", x, self.vocabulary), check_token_ids("x_prime", x_prime, self.vocabulary)
        deltas = pair_distances(self.vocabulary, x, x_prime).tolist()
        reach = torch.maximum(self._reach(x.reshape(-1)), self._reach(x_prime.reshape(-1))).tolist()
        return sum(self.pair_bound(d, r) for d, r in zip(deltas, reach, strict=True))

    def _reach(self, ids: torch.Tensor) -> torch.Tensor:
        """D(t) = max_y d(t, y) per id."""
        return torch.cat([distance_rows(self.vocabulary, block).max(dim=-1).values
                          for block in ids.split(ROWS_PER_BLOCK)]).cpu()

    def paper_bound(self, x: torch.Tensor, x_prime: torch.Tensor) -> float:
        """The paper's claim, eps per position (unsound: see the module doc)."""
        x, x_prime = check_token_ids("x", x, self.vocabulary), check_token_ids("x_prime", x_prime, self.vocabulary)
        if x.shape != x_prime.shape:
            raise ValueError(f"x and x_prime must have the same shape, got {tuple(x.shape)} and {tuple(x_prime.shape)}")
        return self.epsilon * x.numel()

    @cached_property
    def diameter(self) -> float:
        """An upper bound on every distance between rows of the table: 2 max_t ||phi(t) - c||, c the box centre."""
        table = self.vocabulary.embeddings.float()
        centre = (table.amax(dim=0) + table.amin(dim=0)) / 2
        return 2 * float((table - centre).norm(dim=-1).max()) * (1 + 1e-5)  # the margin covers float32 rounding

    @cached_property
    def per_token_bound(self) -> float:
        """The data-independent worst case of the pair bound: delta = reach = the diameter."""
        return self.pair_bound(self.diameter, self.diameter)

    def spend(self, x: torch.Tensor) -> Spend:
        """privlm's per-token worst case per released id (pure epsilon; the paper would charge eps)."""
        x = check_token_ids("x", x, self.vocabulary)
        return Spend(self.unit, self.per_token_bound * x.numel())


def _check_radius(radius: object) -> torch.Tensor:
    if not isinstance(radius, torch.Tensor) or not radius.is_floating_point() or radius.numel() == 0:
        raise ValueError("radius must be a non-empty floating-point tensor")
    if not torch.isfinite(radius).all() or (radius <= 0).any():
        raise ValueError("radius must be finite and > 0")
    return radius.to(torch.float64)


def _inverse_cdf(weights: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One column per row of (k, W) non-negative weights, drawn in proportion to them (exact up to float64)."""
    cdf = weights.cumsum_(dim=-1)
    u = torch.rand((cdf.shape[0], 1), generator=generator, dtype=torch.float64, device=cdf.device) * cdf[:, -1:]
    # right=True: the first column whose cumulative weight exceeds u, never one of weight 0
    return torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp_max_(cdf.shape[-1] - 1)


def _effective(radii: torch.Tensor, sorted_row: torch.Tensor) -> torch.Tensor:
    """max(r, d_0): a non-candidate input keeps its nearest candidate; r = 0 (a node) is the limit r -> 0+."""
    return radii.clamp_min(max(float(sorted_row[0]), _TINY))


def _blocks_by_width(sorted_row: torch.Tensor, ascending_radii: torch.Tensor) -> list[torch.Tensor]:
    """Consecutive blocks of ascending radii, each as large as (size x its widest prefix) <= BLOCK_ELEMENTS allows."""
    widths = torch.searchsorted(sorted_row, _effective(ascending_radii, sorted_row), right=True).clamp_min(1).cpu()
    blocks, start, n = [], 0, ascending_radii.numel()
    while start < n:
        cost = torch.arange(1, n - start + 1) * widths[start:]  # increasing: the widths ascend
        size = max(1, int((cost <= BLOCK_ELEMENTS).sum()))
        blocks.append(ascending_radii[start: start + size])
        start += size
    return blocks


# --- the perturber -----------------------------------------------------------------------------
class InferDPT(TokenLevelBaseline):
    """InferDPT's RANTEXT on prompts: every token replaced by a draw of :class:`InferDPTMechanism`."""

    name = "inferdpt"
    unit = InferDPTMechanism.unit
    guarantee = ("per token, against any token: privlm's sound bound (the data-independent worst case of "
                 "InferDPTMechanism.pair_bound), composed over the tokens of prompts of the same length; the "
                 "paper's eps per token is unsound (the candidate set is centred on the true token)")

    mechanism: InferDPTMechanism

    def __init__(self, vocabulary: CandidateVocabulary, *, epsilon: float, generator: torch.Generator | None = None,
                 ledger: Ledger | None = None, principal: str = "local") -> None:
        super().__init__(vocabulary, epsilon=epsilon, generator=generator, ledger=ledger, principal=principal)
        self.mechanism = InferDPTMechanism(vocabulary, self.epsilon)

    def per_token_cost(self) -> float:
        return self.mechanism.per_token_bound

    def accounting(self, n_perturbed: int) -> dict[str, float]:
        return {Accounting.PAPER: self.epsilon * n_perturbed, Accounting.PRIVLM: self.per_token_cost() * n_perturbed}
