"""Sequence-aware inversion of noisy token-embedding rows with a language-model prior (after BeamClean, 2505.13758).

The attacker sees the rows x~_1..x~_n released for the content tokens t_1..t_n of one text, knows the vocabulary
E (|V| x d) and the mechanism, and guesses the sequence that maximises

    score(t_1..t_n) = sum_i log p(x~_i | t_i) + lambda * log P_prior(t_1..t_n),

searched left to right with a beam of width B over, per position, the ``shortlist`` tokens of highest noise
log-likelihood (so the max-likelihood token is always a candidate). lambda = 0 gives the per-position
max-likelihood token: the nearest neighbour for unclipped d_chi rows.

Noise laws (``NoiseModel.log_likelihood`` gives log p(x~ | v) up to a constant per row):

- d_chi: z has density proportional to exp(-eta ||z||); its norm is Gamma(d, 1/eta), so E||z|| = d / eta and
  E||z||^2 = d (d + 1) / eta^2. An unclipped row x~ = E_t + z has log p(x~ | v) = -eta ||x~ - E_v|| + const.
- Clipped (SnD): x~ = y min(1, C / ||y||), y = E_t + z. A row with ||x~|| < C (up to a tolerance) was not clipped
  and keeps the law above. A clipped row releases only its direction u = x~ / C, with density on the sphere
  (polar coordinates y = r u, dy = r^{d-1} dr du, and r > C because it was clipped)

      p(u | v) prop. to  integral_C^inf exp(-eta ||r u - E_v||) r^{d-1} dr,   ||r u - E_v||^2 = r^2 - 2 r a + b,

  a function h(a, b) of a = <u, E_v> and b = ||E_v||^2 only, the same for every row. For ||E_v|| << r the exponent
  is -eta (r - a) - eta (b - a^2) / (2 r) + ..., so the r-integrand peaks near (d - 1) / eta (or at C, if that is
  larger) with width sqrt(d - 1) / eta, whatever a and b. log h is computed in float64 by the trapezoid rule (a
  log-sum-exp) on a radius grid that covers that peak +- (max ||E_v|| + 12 widths) at a quarter width per step,
  with the Euler-Maclaurin end correction step^2 / 12 f'(C) (when (d - 1) / eta < C the integrand is largest at
  r = C, where the plain rule's O(step^2) error would sit). h increases in a and decreases in b (||r u - E_v|| does
  the opposite, r > 0), and is smooth when C >= max ||E_v|| (then r > C >= a: no kink), so it is tabulated once on
  a grid of (cos(u, E_v), ||E_v||) and interpolated bilinearly for every (row, token) pair: the exact law on the
  whole vocabulary, no pre-shortlist (interpolation error < 1e-3 nats, 6e-4 at eta 150 and d = 384; tested against
  direct quadrature, scipy's quad, and a Monte Carlo histogram of clipped directions in d = 2). When
  C < max ||E_v|| (not SnD) it is computed directly for every pair.
- Released token ids (Text2Text, SAP's k = 0 projection): the vocabulary row nearest to E_t + z. Its exact law,
  the noise's mass on row r's Voronoi cell around E_v, has no closed form in d > 1; ``ReleasedTokenNoise`` uses
  the SURROGATE -s ||E_r - E_v||: s = eta is the d_chi log-density at the released row, far too sure of it;
  ``ReleasedTokenNoise.calibrated`` fits s by maximum likelihood to releases the attacker simulates.

Eta, when the attacker does not know it (``estimate_eta``):

- unclipped: x and z are independent and z is isotropic with mean 0, so E||x~||^2 = E||x||^2 + d (d + 1) / eta^2,
  with E||x||^2 over the vocabulary weighted by token frequencies (uniform when none are given):
  eta = sqrt(d (d + 1) / (mean ||x~||^2 - E||x||^2)).
- clipped: maximum likelihood. The rows are a mixture over tokens, p(x~ | eta) = sum_v w_v p(x~ | v, eta), with w
  the token frequencies and p the exact law above times the d_chi normaliser eta^d Gamma(d/2) / (2 pi^{d/2}
  Gamma(d)) (the only factor of it that depends on eta is eta^d); eta maximises the mean log-likelihood of the
  rows, by golden-section search in log eta. (A simulated method of moments on the mean distance to the nearest
  row was tried first: on MiniLM that statistic hardly moves between eta = 1 and 100, because the nearest row of a
  clipped row is one of the longest rows whatever the noise.)

Success at a position: the guess is the true token (top-1). Chance: 1 / |V|.
"""

from __future__ import annotations

import copy
import math
import time
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Protocol, runtime_checkable

import torch

from privlm.attacks._checks import check_ids
from privlm.attacks.results import AttackResult
from privlm.mechanisms import nearest_neighbours, sample_dchi_noise
from privlm.mechanisms.randomness import resolve_generator
from privlm.models.kv_cache import cache_of, with_cache
from privlm.validation import check_float_tensor, check_non_negative_finite, check_positive_finite, check_positive_int

CLIP_TOLERANCE = 1e-4  # a row with norm >= C (1 - tol) was clipped (float32 rounding leaves it a little off C)
_ROW_CHUNK = 256  # rows per (rows, |V|) float64 block


# --- noise laws ----------------------------------------------------------------------------------------------


@runtime_checkable
class NoiseModel(Protocol):
    def log_likelihood(self, released: torch.Tensor, vocabulary: torch.Tensor) -> torch.Tensor:
        """(n, d), (V, d) -> (n, V): log p(released row | token v), up to a constant per row."""
        ...


def _released_rows(released: torch.Tensor, vocabulary: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    check_float_tensor("released", released, ndim=2)
    check_float_tensor("vocabulary", vocabulary, ndim=2)
    if released.shape[1] != vocabulary.shape[1]:
        raise ValueError(f"released rows have dimension {released.shape[1]} but vocabulary rows have "
                         f"{vocabulary.shape[1]}")
    return released.double(), vocabulary.double().to(released.device)


def _distances(rows: torch.Tensor, vocabulary: torch.Tensor) -> torch.Tensor:
    """(n, V) L2 distances in float64."""
    sq = rows.pow(2).sum(-1, keepdim=True) - 2 * rows @ vocabulary.T + vocabulary.pow(2).sum(-1)
    return sq.clamp_min(0).sqrt()


def _radius_grid(eta: float, dim: int, clip_norm: float, a_max: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Radii r >= C and log trapezoid weights covering the peak of exp(-eta ||r u - E_v||) r^{d-1}."""
    peak, width = (dim - 1) / eta, math.sqrt(max(dim - 1, 1)) / eta
    low = max(clip_norm, peak - a_max - 12 * width)
    high = max(peak, clip_norm) + a_max + 12 * width
    step = (width if clip_norm >= a_max else min(width, 1 / eta)) / 4  # resolve the kink at r = a when r can reach a
    points = min(max(math.ceil((high - low) / step) + 1, 65), 20001)
    radii = torch.linspace(low, high, points, dtype=torch.float64)
    weights = torch.full((points,), (high - low) / (points - 1), dtype=torch.float64)
    weights[[0, -1]] /= 2
    return radii, weights.log()


def clipped_log_likelihood(a: torch.Tensor, b: torch.Tensor, *, eta: float, dim: int, clip_norm: float,
                           a_max: float | None = None) -> torch.Tensor:
    """log integral_C^inf exp(-eta sqrt(r^2 - 2 r a + b)) r^{d-1} dr, elementwise over broadcast a = <u, E_v>,
    b = ||E_v||^2 (float64). ``a_max`` bounds |a| (default: the largest sqrt(b)) and sets the grid."""
    a, b = torch.broadcast_tensors(a.double(), b.double())
    a_max = float(b.max().sqrt()) if a_max is None else a_max
    radii, log_weights = _radius_grid(eta, dim, clip_norm, a_max)
    radii, log_weights = radii.to(a.device), log_weights.to(a.device)
    spacing = float(radii[1] - radii[0])
    out = torch.empty_like(a)
    flat_a, flat_b, flat_out = a.reshape(-1), b.reshape(-1), out.view(-1)
    step = max(1, 2**22 // radii.numel())  # bounded memory: ~4M grid values at a time
    for start in range(0, flat_a.numel(), step):
        sa, sb = flat_a[start:start + step, None], flat_b[start:start + step, None]
        distance = (radii * radii - 2 * radii * sa + sb).clamp_min(0).sqrt()
        log_f = -eta * distance + (dim - 1) * radii.log()
        trapezoid = (log_f + log_weights).logsumexp(-1)
        # Euler-Maclaurin: integral = trapezoid + h^2 / 12 (f'(low) - f'(high)) + O(h^4); f(high) is negligible
        gap, near = radii[0] - sa[:, 0], distance[:, 0]
        slope = -eta * torch.where(near > 0, gap / near.clamp_min(1e-300), 1.0) + (dim - 1) / radii[0]
        correction = spacing**2 / 12 * slope * (log_f[:, 0] - trapezoid).exp()
        flat_out[start:start + step] = trapezoid + correction.clamp_min(-0.5).log1p()
    return out


@lru_cache(maxsize=8)
def _clipped_table(eta: float, dim: int, clip_norm: float, norm_min: float, norm_max: float,
                   cos_points: int = 1025, norm_points: int = 257) -> torch.Tensor:
    """log h on a (cosine, norm) grid over [-1, 1] x [norm_min, norm_max]: a = norm * cosine, b = norm^2 (feasible
    pairs only, so no cell straddles |a| > sqrt(b), where r^2 - 2 r a + b can turn negative)."""
    cosine = torch.linspace(-1, 1, cos_points, dtype=torch.float64)
    norm = torch.linspace(norm_min, norm_max, norm_points, dtype=torch.float64)
    return clipped_log_likelihood(cosine[:, None] * norm[None, :], norm[None, :] ** 2, eta=eta, dim=dim,
                                  clip_norm=clip_norm, a_max=norm_max)


def _interpolate(table: torch.Tensor, cosine: torch.Tensor, norm: torch.Tensor, norm_min: float,
                 norm_max: float) -> torch.Tensor:
    """Bilinear interpolation of ``table`` (over [-1, 1] x [norm_min, norm_max]) at (cosine (n, V), norm (V,))."""
    table = table.to(cosine.device)
    nc, nn = table.shape
    fc = ((cosine + 1) / 2 * (nc - 1)).clamp(0, nc - 1)
    fn = ((norm - norm_min) / max(norm_max - norm_min, 1e-300) * (nn - 1)).clamp(0, nn - 1).expand_as(cosine)
    ic, jn = fc.floor().long().clamp(max=nc - 2), fn.floor().long().clamp(max=max(nn - 2, 0))
    wc, wn = fc - ic, (fn - jn) if nn > 1 else torch.zeros_like(fn)
    flat = table.reshape(-1)
    jn_next = (jn + 1).clamp(max=nn - 1)

    def at(i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
        return flat[i * nn + j]

    return ((1 - wc) * ((1 - wn) * at(ic, jn) + wn * at(ic, jn_next))
            + wc * ((1 - wn) * at(ic + 1, jn) + wn * at(ic + 1, jn_next)))


def clipped_rows(released: torch.Tensor, clip_norm: float, *, tolerance: float = CLIP_TOLERANCE) -> torch.Tensor:
    """(n,) booleans: rows whose norm is C (they were clipped), up to ``tolerance`` (relative)."""
    return released.double().norm(dim=-1) >= clip_norm * (1 - tolerance)


def clip_rate(released: torch.Tensor, clip_norm: float) -> float:
    """Share of the released rows (..., d) that were clipped to norm ``clip_norm``."""
    check_float_tensor("released", released)
    clip_norm = check_positive_finite("clip_norm", clip_norm)
    return float(clipped_rows(released.reshape(-1, released.shape[-1]), clip_norm).double().mean())


@dataclass(frozen=True)
class DChiNoise:
    """The exact law of a d_chi release x~ = E_t + z, clipped to norm ``clip_norm`` when it is given.

    ``estimated`` records that ``eta`` was estimated from the release (reported, not used)."""

    eta: float
    clip_norm: float | None = None
    estimated: bool = False
    table_points: tuple[int, int] = (1025, 257)  # (cosines, norms) of the clipped law's table

    def __post_init__(self) -> None:
        object.__setattr__(self, "eta", check_positive_finite("eta", self.eta))
        if self.clip_norm is not None:
            object.__setattr__(self, "clip_norm", check_positive_finite("clip_norm", self.clip_norm))

    def log_likelihood(self, released: torch.Tensor, vocabulary: torch.Tensor) -> torch.Tensor:
        rows, table = _released_rows(released, vocabulary)
        out = torch.empty(rows.shape[0], table.shape[0], dtype=torch.float64, device=rows.device)
        clipped = (clipped_rows(rows, self.clip_norm) if self.clip_norm is not None
                   else torch.zeros(rows.shape[0], dtype=torch.bool, device=rows.device))
        if (~clipped).any():
            out[~clipped] = -self.eta * _distances(rows[~clipped], table)
        if clipped.any():
            assert self.clip_norm is not None
            out[clipped] = self._clipped(rows[clipped], table, self.clip_norm)
        return out

    def _clipped(self, rows: torch.Tensor, table: torch.Tensor, clip_norm: float) -> torch.Tensor:
        directions = rows / rows.norm(dim=-1, keepdim=True)
        norms = table.norm(dim=-1)
        dim = rows.shape[1]
        norm_min, norm_max = float(norms.min()), float(norms.max())
        if clip_norm < norm_max:  # h has a kink at r = a >= C: no table, direct quadrature
            return clipped_log_likelihood(directions @ table.T, norms.pow(2), eta=self.eta, dim=dim,
                                          clip_norm=clip_norm, a_max=norm_max)
        cosine = (directions @ (table / norms.clamp_min(1e-300)[:, None]).T).clamp(-1, 1)
        grid = _clipped_table(self.eta, dim, clip_norm, norm_min, norm_max, *self.table_points)
        return _interpolate(grid, cosine, norms, norm_min, norm_max)


@dataclass(frozen=True)
class ReleasedTokenNoise:
    """A released token id, given as its row E_r: the SURROGATE log-likelihood -scale ||E_r - E_v||, scale = eta by
    default (the exact law of "the row nearest to E_t + z" is the noise's mass on a Voronoi cell, with no closed
    form in d > 1). With ``scale=eta`` the surrogate is far too sure of the released token (retention is much lower
    than exp(-eta * distance) implies); :meth:`calibrated` fits ``scale`` to simulated releases instead. The
    likelihood is left unnormalised over released rows (log Z_s(v) = log sum_r exp(-s ||E_r - E_v||) is dropped): on
    MiniLM at eta 50 adding it back changed no figure measurably (13.4% of 80 tweets' tokens either way). A scale that
    lands on the edge of the search bracket [eta e^-8, eta e^3] means the surrogate carries almost no signal there."""

    eta: float
    scale: float | None = None
    estimated: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "eta", check_positive_finite("eta", self.eta))
        if self.scale is not None:
            object.__setattr__(self, "scale", check_positive_finite("scale", self.scale))

    def log_likelihood(self, released: torch.Tensor, vocabulary: torch.Tensor) -> torch.Tensor:
        rows, table = _released_rows(released, vocabulary)
        return -(self.scale or self.eta) * _distances(rows, table)

    @classmethod
    def calibrated(cls, vocabulary: torch.Tensor, eta: float, *, frequencies: torch.Tensor | None = None,
                   generator: torch.Generator | None = None, samples: int = 400) -> ReleasedTokenNoise:
        """The surrogate with the scale that maximises the mean log q(r | t) = -s ||E_r - E_t|| - log sum_r'
        exp(-s ||E_r' - E_t||) of ``samples`` simulated releases r of tokens t drawn by ``frequencies`` (a concave
        function of s: golden-section search in log s)."""
        check_float_tensor("vocabulary", vocabulary, ndim=2)
        eta = check_positive_finite("eta", eta)
        table = vocabulary.float()
        generator = resolve_generator(generator, table.device)
        weights = _token_weights(frequencies, table.shape[0])
        tokens = torch.multinomial(weights.to(table.device), check_positive_int("samples", samples), replacement=True,
                                   generator=generator).to(table.device)
        noisy = table[tokens] + sample_dchi_noise((samples, table.shape[1]), eta=eta, generator=generator,
                                                  device=table.device)
        released = nearest_neighbours(noisy, table, k=1)[0][:, 0]
        # float32 suffices for a mean log-likelihood, and the search below evaluates it 2 x 24 times
        distances = torch.cat([_distances(chunk.double(), table.double()).float()
                               for chunk in table[tokens].split(_ROW_CHUNK)])
        observed = distances.gather(1, released[:, None])[:, 0]

        def fit(log_scale: float) -> float:
            scale = math.exp(log_scale)
            return float((-scale * observed - (-scale * distances).logsumexp(-1)).mean())

        low, high = math.log(eta) - 8, math.log(eta) + 3
        ratio = (math.sqrt(5) - 1) / 2
        for _ in range(24):  # the bracket shrinks to 0.618^24 of 11 nats of log-scale: under 1e-4
            left, right = high - ratio * (high - low), low + ratio * (high - low)
            low, high = (low, right) if fit(left) > fit(right) else (left, high)
        return cls(eta=eta, scale=math.exp((low + high) / 2))


# --- estimating eta --------------------------------------------------------------------------------------------


def _token_weights(frequencies: torch.Tensor | None, vocab_size: int) -> torch.Tensor:
    if frequencies is None:
        return torch.full((vocab_size,), 1 / vocab_size, dtype=torch.float64)
    check_float_tensor("frequencies", frequencies.double(), ndim=1)
    if frequencies.shape[0] != vocab_size or (frequencies < 0).any() or frequencies.sum() <= 0:
        raise ValueError(f"frequencies must be {vocab_size} non-negative numbers with a positive sum")
    return frequencies.double().cpu() / frequencies.double().sum()


def estimate_eta(released: torch.Tensor, vocabulary: torch.Tensor, *, clip_norm: float | None = None,
                 frequencies: torch.Tensor | None = None, generator: torch.Generator | None = None,
                 samples: int = 250, tolerance: float = 0.02) -> float:
    """The d_chi level of the released rows (..., d) (see the module docstring): the second-moment equation
    without clipping; with ``clip_norm``, the maximum-likelihood eta of at most ``samples`` rows (drawn with
    ``generator``) under the token mixture sum_v w_v p(x~ | v, eta), found by search in log eta (a grid, then golden
    sections) to a relative ``tolerance``. ``frequencies`` (|V|,) weights the tokens (uniform when None)."""
    check_float_tensor("released", released)
    check_float_tensor("vocabulary", vocabulary, ndim=2)
    tolerance = check_positive_finite("tolerance", tolerance)
    if released.shape[-1] != vocabulary.shape[1]:
        raise ValueError(f"released rows have dimension {released.shape[-1]} but vocabulary rows have "
                         f"{vocabulary.shape[1]}")
    rows = released.reshape(-1, released.shape[-1])
    table = vocabulary.to(rows.device)
    weights = _token_weights(frequencies, table.shape[0]).to(rows.device)
    dim = table.shape[1]
    mean_sq = float((weights * table.double().pow(2).sum(-1)).sum())
    if clip_norm is None:
        excess = float(rows.double().pow(2).sum(-1).mean()) - mean_sq
        if excess <= 0:
            raise ValueError("the released rows are no longer than the vocabulary's: no noise to measure")
        return math.sqrt(dim * (dim + 1) / excess)
    clip_norm = check_positive_finite("clip_norm", clip_norm)
    samples = check_positive_int("samples", samples)
    if rows.shape[0] > samples:
        generator = resolve_generator(generator, rows.device)
        rows = rows[torch.randperm(rows.shape[0], generator=generator, device=rows.device)[:samples]]
    log_weights, kept = weights.log(), weights > 0
    support = table[kept]

    def log_likelihood(log_eta: float) -> float:
        # log c_d(eta) = d log eta + (terms free of eta): the d_chi density's normaliser
        noise = DChiNoise(math.exp(log_eta), clip_norm=clip_norm, table_points=(257, 65))
        total = sum(float((noise.log_likelihood(chunk, support) + log_weights[kept]).logsumexp(-1).sum())
                    for chunk in rows.split(_ROW_CHUNK))
        return total / rows.shape[0] + dim * log_eta

    # a coarse grid of noise norms from 100x to 0.1x the rows' (a factor 2 apart), then golden section around its best
    scale = math.sqrt(mean_sq)
    grid = [math.log(dim / (100 * scale)) + i * math.log(2) for i in range(math.ceil(math.log2(1000)) + 1)]
    values = [log_likelihood(x) for x in grid]
    best = max(range(len(grid)), key=values.__getitem__)
    if best in (0, len(grid) - 1):
        raise ValueError("the likelihood of eta peaks at the end of the searched range (noise norms 0.1x to 100x "
                         "the rows'): the release is all noise, or hardly any")
    low, high = grid[best - 1], grid[best + 1]
    ratio = (math.sqrt(5) - 1) / 2
    left, right = high - ratio * (high - low), low + ratio * (high - low)
    f_left, f_right = log_likelihood(left), log_likelihood(right)
    while high - low > tolerance:
        if f_left > f_right:
            high, right, f_right = right, left, f_left
            left = high - ratio * (high - low)
            f_left = log_likelihood(left)
        else:
            low, left, f_left = left, right, f_right
            right = low + ratio * (high - low)
            f_right = log_likelihood(right)
    return math.exp((low + high) / 2)


# --- priors --------------------------------------------------------------------------------------------------


@runtime_checkable
class TokenPrior(Protocol):
    """A left-to-right distribution over token sequences: a state per prefix."""

    @property
    def vocab_size(self) -> int: ...

    def start(self) -> Any: ...

    def next_log_probs(self, states: list[Any]) -> torch.Tensor:
        """(B, V) log P(next token | prefix) for each state."""
        ...

    def extend(self, state: Any, token: int) -> Any: ...


_BOS = -1  # the padding id before a text's first token


class NGramPrior:
    """Interpolated Kneser-Ney n-gram model in any tokenizer's vocabulary (one discount D, uniform at the bottom).

    P(w | h) = max(c(h w) - D, 0) / c(h) + D N1+(h .) / c(h) * P(w | h'),  h' = h without its first token,
    with raw counts at the top order and continuation counts N1+(. h w) (distinct left neighbours) below, and
    P(w | h) = P(w | h') for an unseen h; the empty context backs off to 1 / V, so every token has mass.
    """

    def __init__(self, levels: list[dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]]], vocab_size: int,
                 order: int, discount: float, token_counts: torch.Tensor, cache_size: int = 128) -> None:
        self.levels = levels  # levels[k - 1]: context of k - 1 tokens -> (ids, counts) of the k-grams
        self._vocab_size = vocab_size
        self.order = order
        self.discount = discount
        self.token_counts = token_counts  # raw unigram counts (V,): frequencies for estimate_eta
        self._cache: OrderedDict[tuple[int, ...], torch.Tensor] = OrderedDict()
        self._cache_size = cache_size

    @classmethod
    def fit(cls, sequences: Sequence[Sequence[int]], vocab_size: int, *, order: int = 3,
            discount: float = 0.75) -> NGramPrior:
        vocab_size = check_positive_int("vocab_size", vocab_size)
        order = check_positive_int("order", order)
        discount = check_non_negative_finite("discount", discount)
        if not 0 < discount <= 1:
            raise ValueError(f"discount must lie in (0, 1], got {discount}")
        top: Counter[tuple[int, ...]] = Counter()
        token_counts = torch.zeros(vocab_size, dtype=torch.float64)
        for sequence in sequences:
            ids = [int(t) for t in sequence]
            if any(not 0 <= t < vocab_size for t in ids):
                raise ValueError(f"sequences must hold token ids in [0, {vocab_size})")
            padded = [_BOS] * (order - 1) + ids
            top.update(tuple(padded[j - order + 1:j + 1]) for j in range(order - 1, len(padded)))
            token_counts += torch.bincount(torch.tensor(ids, dtype=torch.long), minlength=vocab_size).double()
        if not top:
            raise ValueError("sequences hold no tokens")
        counts: list[Counter[tuple[int, ...]]] = [Counter() for _ in range(order)]
        counts[order - 1] = top
        grams = set(top)
        for k in range(order - 1, 0, -1):  # every k-gram occurrence ends an order-gram: suffixes are all of them
            counts[k - 1] = Counter(gram[1:] for gram in grams)
            grams = set(counts[k - 1])
        levels = []
        for level in counts:
            grouped: dict[tuple[int, ...], list[tuple[int, int]]] = {}
            for gram, count in level.items():
                grouped.setdefault(gram[:-1], []).append((gram[-1], count))
            levels.append({context: (torch.tensor([w for w, _ in pairs], dtype=torch.long),
                                     torch.tensor([c for _, c in pairs], dtype=torch.float64))
                           for context, pairs in grouped.items()})
        return cls(levels, vocab_size, order, discount, token_counts)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def start(self) -> tuple[int, ...]:
        return (_BOS,) * (self.order - 1)

    def extend(self, state: tuple[int, ...], token: int) -> tuple[int, ...]:
        return (*state, int(token))[1:] if self.order > 1 else ()

    def _probs(self, context: tuple[int, ...]) -> torch.Tensor:
        cached = self._cache.get(context)
        if cached is not None:
            self._cache.move_to_end(context)
            return cached
        probs = torch.full((self._vocab_size,), 1 / self._vocab_size, dtype=torch.float64)
        for k in range(1, self.order + 1):
            seen = self.levels[k - 1].get(context[len(context) - (k - 1):] if k > 1 else ())
            if seen is None:
                continue  # unseen context: keep the lower order
            ids, counts = seen
            total = float(counts.sum())
            probs = probs * (self.discount * ids.numel() / total)
            probs[ids] += (counts - self.discount).clamp_min(0) / total
        log_probs = probs.log()
        self._cache[context] = log_probs
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return log_probs

    def next_log_probs(self, states: list[tuple[int, ...]]) -> torch.Tensor:
        return torch.stack([self._probs(state) for state in states])


@dataclass(frozen=True)
class _LMState:
    log_probs: torch.Tensor  # (V,) of the next token
    cache: Any


class CausalLMPrior:
    """A causal LM (transformers) in the rows' own vocabulary: P(t_1..t_n) = prod_i P(t_i | start_id, t_<i).

    Each state keeps its key/value cache, so extending a prefix runs the model on one token."""

    def __init__(self, model: torch.nn.Module, *, start_id: int) -> None:
        self.model = model
        self.start_id = int(start_id)
        self._vocab_size = int(model.get_output_embeddings().weight.shape[0])  # type: ignore[operator]

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @torch.inference_mode()
    def _step(self, cache: Any, token: int) -> _LMState:
        device = next(self.model.parameters()).device
        cache = copy.deepcopy(cache)  # a parent's cache is shared by its children: never append to it
        out = self.model(input_ids=torch.tensor([[token]], device=device), use_cache=True,
                         **with_cache(self.model, cache))
        return _LMState(out.logits[0, -1].float().log_softmax(-1).cpu(), cache_of(self.model, out))

    def start(self) -> _LMState:
        return self._step(None, self.start_id)

    def extend(self, state: _LMState, token: int) -> _LMState:
        return self._step(state.cache, int(token))

    def next_log_probs(self, states: list[_LMState]) -> torch.Tensor:
        return torch.stack([state.log_probs for state in states])


# --- the attack ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Inversion:
    guesses: tuple[torch.Tensor, ...]  # per text, (n_i,) token ids
    result: AttackResult


def _shortlists(noise: NoiseModel, rows: torch.Tensor, vocabulary: torch.Tensor, k: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the ``k`` tokens of highest noise log-likelihood and their log-likelihoods, best first."""
    ids, scores = [], []
    for chunk in rows.split(_ROW_CHUNK):
        log_lik = noise.log_likelihood(chunk, vocabulary)
        top = log_lik.double().topk(k, dim=-1)
        ids.append(top.indices.cpu())
        scores.append(top.values.cpu())
    return torch.cat(ids), torch.cat(scores)


def _beam_search(candidates: torch.Tensor, log_lik: torch.Tensor, prior: TokenPrior, *, beam: int,
                 prior_weight: float) -> torch.Tensor:
    """The best sequence under sum log-lik + prior_weight * log P_prior over the candidates (n, K) of each position."""
    use_prior = prior_weight != 0
    states: list[Any] = [prior.start() if use_prior else None]
    scores = torch.zeros(1, dtype=torch.float64)
    paths = torch.zeros(1, 0, dtype=torch.long)
    n = candidates.shape[0]
    for i in range(n):
        total = scores[:, None] + log_lik[i][None, :]
        if use_prior:
            total = total + prior_weight * prior.next_log_probs(states)[:, candidates[i]].double()
        scores, flat = total.reshape(-1).topk(min(beam, total.numel()))
        parent, choice = flat // total.shape[1], flat % total.shape[1]
        tokens = candidates[i][choice]
        paths = torch.cat([paths[parent], tokens[:, None]], dim=1)
        if use_prior and i < n - 1:
            states = [prior.extend(states[p], int(t)) for p, t in zip(parent.tolist(), tokens.tolist(), strict=True)]
        else:
            states = [None] * len(parent)
    return paths[0]


@dataclass(frozen=True, kw_only=True)
class LMInversionConfig:
    """The beam search of :func:`lm_inversion` (see the module docstring)."""

    beam: int = 8  # B, the sequences kept after each position
    shortlist: int = 64  # candidates per position: the tokens of highest noise log-likelihood
    prior_weight: float = 1.0  # the prior's weight against the noise; 0: the likelihood alone


def _check_models(noise: object, prior: object, vocab_size: int) -> None:
    if not isinstance(noise, NoiseModel):
        raise ValueError(f"noise must be a NoiseModel (e.g. DChiNoise or ReleasedTokenNoise: a log_likelihood "
                         f"method), got {type(noise).__name__}")
    if not isinstance(prior, TokenPrior):
        raise ValueError(f"prior must be a TokenPrior (e.g. NGramPrior or CausalLMPrior: vocab_size, start, "
                         f"next_log_probs and extend), got {type(prior).__name__}")
    if prior.vocab_size != vocab_size:
        raise ValueError(f"the prior's vocabulary has {prior.vocab_size} tokens, the rows' {vocab_size}")


def _checked_truths(released: Sequence[torch.Tensor], true_ids: Sequence[torch.Tensor], vocabulary: torch.Tensor
                    ) -> list[torch.Tensor]:
    """Each text's true ids (n_i,) on the CPU, once its released rows (n_i, d) are checked against them."""
    if isinstance(released, torch.Tensor) or not isinstance(released, Sequence) or not released:
        raise ValueError("released must be a non-empty sequence of (n_i, d) tensors, one per text")
    if isinstance(true_ids, torch.Tensor) or not isinstance(true_ids, Sequence) or len(true_ids) != len(released):
        raise ValueError(f"true_ids must be a sequence of {len(released)} id tensors, one per released text")
    vocab_size, dim = vocabulary.shape
    truths = []
    for i, (rows, ids) in enumerate(zip(released, true_ids, strict=True)):
        check_float_tensor(f"released[{i}]", rows, ndim=2)
        if rows.shape[1] != dim:
            raise ValueError(f"released[{i}] has dimension {rows.shape[1]} but vocabulary rows have {dim}")
        truths.append(check_ids(f"true_ids[{i}]", ids, shape=(rows.shape[0],), vocab_size=vocab_size).cpu())
    return truths


def lm_inversion(released: Sequence[torch.Tensor], true_ids: Sequence[torch.Tensor], vocabulary: torch.Tensor, *,
                 noise: NoiseModel, prior: TokenPrior, name: str | None = None,
                 config: LMInversionConfig = LMInversionConfig()) -> Inversion:
    """Guess every text's tokens from its released rows (see the module docstring); top-1 success per position.

    ``released[i]`` (n_i, d): the content-token rows of text i; ``true_ids[i]`` (n_i,). ``details``: the noise's
    eta (and whether it was estimated), the clip rate, the max-likelihood guess's own successes, the share of
    positions where the guess differs from it, how often the true token was in the shortlist, and the seconds.
    """
    start = time.perf_counter()
    vocab_size = check_float_tensor("vocabulary", vocabulary, ndim=2).shape[0]
    beam, shortlist = check_positive_int("beam", config.beam), check_positive_int("shortlist", config.shortlist)
    if shortlist > vocab_size:
        raise ValueError(f"shortlist must be <= the vocabulary size {vocab_size}, got {shortlist}")
    prior_weight = check_non_negative_finite("prior_weight", config.prior_weight)
    _check_models(noise, prior, vocab_size)
    truths = _checked_truths(released, true_ids, vocabulary)
    all_rows = torch.cat([rows.to(vocabulary.device) for rows in released])
    candidates, log_lik = _shortlists(noise, all_rows, vocabulary, shortlist)
    guesses, offset = [], 0
    for truth in truths:
        n = truth.shape[0]
        guesses.append(_beam_search(candidates[offset:offset + n], log_lik[offset:offset + n], prior, beam=beam,
                                    prior_weight=prior_weight))
        offset += n
    truth_all, guess_all = torch.cat(truths), torch.cat(guesses)
    max_likelihood = candidates[:, 0]
    clip_norm = getattr(noise, "clip_norm", None)
    return Inversion(guesses=tuple(guesses), result=AttackResult(
        name=name or "lm-inversion", successes=int((guess_all == truth_all).sum()), trials=int(truth_all.numel()),
        chance=1 / vocab_size,
        details={"eta": getattr(noise, "eta", None), "eta_estimated": bool(getattr(noise, "estimated", False)),
                 "noise": type(noise).__name__,
                 "clip_rate": None if clip_norm is None else clip_rate(all_rows, clip_norm),
                 "max_likelihood_successes": int((max_likelihood == truth_all).sum()),
                 "changed_share": float((guess_all != max_likelihood).double().mean()),
                 "shortlist_recall": float((candidates == truth_all[:, None]).any(-1).double().mean()),
                 "beam": beam, "shortlist": shortlist, "prior_weight": prior_weight,
                 "seconds": time.perf_counter() - start}))
