"""Inversion with a learned prior and a gradient term (after BiSR, Chen et al., CCS 2024), for split learning.

**What the vendor sees, and what the gradient can add.** In SAP the customer releases rows X~ = M(f(E[t])) (f the
bottom of k blocks, M the mechanism); the vendor computes h = top(X~) and the customer returns

    g = dL/dh = W^T (softmax(W h + b) - onehot(y)) / B      (head at the customer), or dL/dlogits (head at the vendor).

So g is a function of (h(X~), y, W, b), and the vendor already holds h(X~). Given the forward rows, the gradient
says something about the tokens t only through the label y (and the head): for two classes it is the scalar
(p_1 - y) ||w_1 - w_0|| / B along a fixed direction. Nothing in this setting says a gradient term must help.
BiSR's gains come from its learned inversion built on the pre-trained weights, and from settings where the
gradient is computed on clean activations (then g depends on f(E[t]) directly). Both ingredients are here, so
that the gradient term can be measured, with and without.

**1. Learned inversion (the pre-trained weights as prior).** The attacker runs the known pre-trained bottom on its
own public text, applies the mechanism at the same eta, and fits a map from released rows to tokens
(:func:`fit_inversion_model`). Per position i, with features u_i = [x_{i-w}; ..; x_{i+w}; 1] (zeros outside the
sequence; w = ``window``):

    A = argmin ||U A - E[t]||^2 + lambda ||A||^2     (ridge: predicted embedding row e^_i = u_i A; at k = 0,
                                                      where the rows are embedding rows, e^_i = x_i may be used)
    log q(t_i = v | X~) = -a_1 ||e^_i - E_v|| - a_2 ||e^_i - E_v||^2 / 2 + c log pi_v - log Z_i

with pi the add-one token frequencies of the public text: the d_chi likelihood (exp(-eta ||z||)) and a Gaussian
one, tilted by the token prior. (a_1, a_2, c) are fitted by maximum likelihood on a held-out fifth of the public
positions (the ridge on the other four fifths), so the noise's temperature against the prior is learned, not
guessed. Nearest neighbour is a_1 = inf.

**2. Relaxed-token refinement with a gradient term** (:func:`gradient_inversion`). As in
:mod:`~privlm.attacks.optimisation_inversion`: p_i = softmax(z_i / T), X = p E, with T annealed from T_0 to T_1,

    loss(Z) = (1 / sum m) sum_i m_i ||f(X)_i - H_i||^2  +  lambda_g (1 / B) sum_b ||G(f(X))_b - g_b||^2 / ||g_b||^2

where H are the observed rows, g the observed returned gradients, and G the attacker's model of what the customer
would return for given cut rows (the top, the head and the label: ``gradient_forward``). lambda_g = 0 with random
initial logits is exactly ``optimisation_inversion``. ``init_logits`` starts Z from T_0 log q, the learned
inversion's posterior, so p starts at q.

The bottom and G are only read: gradients are taken with ``torch.autograd.grad`` with respect to Z alone, and a
``bottom_forward`` that is a module (or its bound method) is frozen in eval mode for the attack.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from privlm.attacks._checks import check_ids, check_mask
from privlm.attacks.optimisation_inversion import (
    BottomForward,
    OptimisationInversionConfig,
    _check_inputs,
    _frozen,
    _invert_chunk,
    _modules_of,
    _Relaxation,
    _relaxation_of,
)
from privlm.attacks.results import AttackResult
from privlm.mechanisms.randomness import resolve_generator
from privlm.validation import (
    check_float_tensor,
    check_non_negative_finite,
    check_positive_finite,
    check_positive_int,
)

GradientForward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""(cut rows (b, L, d), attention mask (b, L), example indices (b,)) -> the customer's gradient (b, D)."""
CALIBRATION_POSITIONS = 400  # held-out positions for the calibration: two (n, |V|) score matrices
POSTERIOR_CHUNK = 16  # examples per log-posterior block: 16 x 64 x 30522 float32 is 125 MB per temporary
_TINY = 1e-12


@dataclass(frozen=True)
class InversionModel:
    """Released rows -> log q(token | rows): the ridge map A, the calibration (a, c) and the log prior."""

    weight: torch.Tensor | None  # ((2w + 1) d + 1, d); None: the identity map (rows already in embedding space)
    vocabulary: torch.Tensor  # (|V|, d)
    log_prior: torch.Tensor  # (|V|,)
    weights: tuple[float, float, float]  # (a_1, a_2, c)
    window: int

    def log_posterior(self, rows: torch.Tensor, attention_mask: torch.Tensor, *,
                      chunk_size: int = POSTERIOR_CHUNK) -> torch.Tensor:
        """log q (B, L, |V|) for released rows (B, L, d), ``chunk_size`` examples at a time: the scores need a few
        (chunk, L, |V|) temporaries, not (B, L, |V|) ones."""
        return torch.cat(list(self._blocks(rows, attention_mask, chunk_size)))

    def most_likely(self, rows: torch.Tensor, attention_mask: torch.Tensor, *,
                    chunk_size: int = POSTERIOR_CHUNK) -> torch.Tensor:
        """argmax_v log q(v | rows) (B, L), without holding the whole (B, L, |V|) posterior."""
        return torch.cat([block.argmax(dim=-1) for block in self._blocks(rows, attention_mask, chunk_size)])

    def _blocks(self, rows: torch.Tensor, attention_mask: torch.Tensor, chunk_size: int) -> Iterator[torch.Tensor]:
        check_float_tensor("rows", rows, ndim=3)
        chunk_size = check_positive_int("chunk_size", chunk_size)
        for first in range(0, rows.shape[0], chunk_size):
            yield self._log_posterior(rows[first:first + chunk_size], attention_mask[first:first + chunk_size])

    def _log_posterior(self, rows: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        predicted = rows if self.weight is None else \
            _features(rows, attention_mask, self.window) @ self.weight.to(rows)
        distance, square = _scores(predicted, self.vocabulary.to(predicted))
        a_1, a_2, c = self.weights
        return torch.log_softmax(a_1 * distance + a_2 * square + c * self.log_prior.to(predicted), dim=-1)


def _features(rows: torch.Tensor, attention_mask: torch.Tensor, window: int) -> torch.Tensor:
    """u_i = [x_{i-w}; ..; x_{i+w}; 1] per position (B, L, (2w + 1) d + 1); padding and outside rows are zero."""
    rows = rows * attention_mask.unsqueeze(-1).to(rows)
    padded = torch.nn.functional.pad(rows, (0, 0, window, window))
    length = rows.shape[1]
    parts = [padded[:, offset:offset + length] for offset in range(2 * window + 1)]
    return torch.cat([*parts, torch.ones_like(rows[..., :1])], dim=-1)


def _scores(predicted: torch.Tensor, vocabulary: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(-||e^ - E_v||, e^ . E_v - ||E_v||^2 / 2): the d_chi and the Gaussian log-likelihood, up to constants in v."""
    square = predicted @ vocabulary.T - 0.5 * vocabulary.pow(2).sum(dim=-1)
    distance = -(predicted.pow(2).sum(dim=-1, keepdim=True) - 2 * square).clamp_min(0).sqrt()
    return distance, square


def _ridge(features: torch.Tensor, targets: torch.Tensor, ridge: float) -> torch.Tensor:
    """argmin ||F A - Y||^2 + ridge ||A||^2, solved in float64."""
    f, y = features.double(), targets.double()
    gram = f.T @ f + ridge * torch.eye(f.shape[1], dtype=torch.float64, device=f.device)
    return torch.linalg.solve(gram, f.T @ y).to(features.dtype)


def _calibrate(scores: tuple[torch.Tensor, torch.Tensor], log_prior: torch.Tensor, ids: torch.Tensor
               ) -> tuple[float, float, float]:
    """(a_1, a_2, c) maximising sum log softmax(a_1 s_1 + a_2 s_2 + c log pi)[t] on held-out positions (L-BFGS).
    The scores are standardised first and the weights kept in [-1e3, 1e3], so the search cannot overflow."""
    units = [float(s.std().clamp_min(_TINY)) for s in scores]
    standard = [s / unit for s, unit in zip(scores, units, strict=True)]
    weights = torch.tensor([1.0, 0.0, 1.0], dtype=standard[0].dtype, requires_grad=True)
    optimiser = torch.optim.LBFGS([weights], max_iter=40, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        optimiser.zero_grad()
        w = weights.clamp(-1e3, 1e3)
        loss = torch.nn.functional.cross_entropy(w[0] * standard[0] + w[1] * standard[1] + w[2] * log_prior, ids)
        loss.backward()
        return loss

    with torch.enable_grad():
        optimiser.step(closure)
    a_1, a_2, c = weights.detach().clamp(-1e3, 1e3).tolist()
    if not all(map(math.isfinite, (a_1, a_2, c))):
        raise RuntimeError("the calibration of the learned inversion did not converge")
    return a_1 / units[0], a_2 / units[1], c


@dataclass(frozen=True, kw_only=True)
class InversionModelConfig:
    """How :func:`fit_inversion_model` fits the learned inversion (see the module docstring, step 1)."""

    linear_map: bool = True  # False: no ridge map (e^ = x), for rows already in the embedding space (k = 0)
    window: int = 1  # w: the ridge map reads the rows i - w .. i + w
    ridge: float = 1.0  # lambda, the ridge penalty
    smoothing: float = 1.0  # added to every token count of the prior pi (1: add-one)


def fit_inversion_model(rows: torch.Tensor, attention_mask: torch.Tensor, true_ids: torch.Tensor,
                        vocabulary: torch.Tensor, *, mask: torch.Tensor | None = None,
                        generator: torch.Generator | None = None,
                        config: InversionModelConfig = InversionModelConfig()) -> InversionModel:
    """Fit the learned inversion on the attacker's own (released rows, token ids) pairs of public text.

    ``rows`` (N, L, d) are the attacker's simulated releases (its public text through the pre-trained bottom and
    the mechanism); ``mask`` (default: the attention mask) selects the positions to learn from (e.g. without special
    tokens). ``config.linear_map=False`` skips the ridge map (e^ = x), for rows that already live in the embedding
    space (k = 0). A fifth of the selected positions (at most :data:`CALIBRATION_POSITIONS`), drawn with
    ``generator``, calibrates (a, c); the ridge map and the prior come from the rest.
    """
    check_float_tensor("rows", rows, ndim=3)
    table = check_float_tensor("vocabulary", vocabulary, ndim=2).detach().to(rows)
    if rows.shape[-1] != table.shape[-1]:
        raise ValueError(f"rows have dimension {rows.shape[-1]} but vocabulary rows have {table.shape[-1]}")
    ids = check_ids("true_ids", true_ids, shape=rows.shape[:2], vocab_size=table.shape[0]).to(rows.device)
    if not isinstance(attention_mask, torch.Tensor) or tuple(attention_mask.shape) != tuple(ids.shape):
        raise ValueError(f"attention_mask must be a tensor of shape {tuple(ids.shape)}")
    counted = attention_mask.bool() if mask is None else check_mask("mask", mask, shape=ids.shape)
    linear_map, window = config.linear_map, config.window
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise ValueError(f"window must be a non-negative integer, got {window!r}")
    ridge = check_positive_finite("ridge", config.ridge)
    smoothing = check_positive_finite("smoothing", config.smoothing)
    features = _features(rows.detach(), attention_mask.to(rows.device), window)[counted.to(rows.device)]
    targets = ids[counted.to(rows.device)]
    n = targets.numel()
    if n < 10:
        raise ValueError(f"need at least 10 positions to learn from, got {n}")
    order = torch.randperm(n, generator=resolve_generator(generator, torch.device("cpu"))).to(rows.device)
    held = order[:min(n // 5, CALIBRATION_POSITIONS)]
    fit = order[min(n // 5, CALIBRATION_POSITIONS):]
    weight = _ridge(features[fit], table[targets[fit]], ridge) if linear_map else None
    counts = torch.bincount(targets[fit], minlength=table.shape[0]).to(rows.dtype) + smoothing
    log_prior = (counts / counts.sum()).log()
    held_rows = features[held] @ weight if weight is not None else rows.detach()[counted.to(rows.device)][held]
    weights = _calibrate(_scores(held_rows, table), log_prior, targets[held])
    return InversionModel(weight=weight, vocabulary=table, log_prior=log_prior, weights=weights,
                          window=window if linear_map else 0)


def learned_inversion(observed: torch.Tensor, attention_mask: torch.Tensor, model: InversionModel,
                      true_ids: torch.Tensor, *, mask: torch.Tensor | None = None,
                      name: str | None = None) -> AttackResult:
    """Guess argmax_v log q(v | observed) per position with a fitted :class:`InversionModel`; chance 1 / |V|."""
    start = time.perf_counter()
    if not isinstance(model, InversionModel):
        raise ValueError(f"model must be an InversionModel (from fit_inversion_model), got {type(model).__name__}")
    ids, attention_mask, counted = _check_inputs(observed, attention_mask, model.vocabulary, true_ids, mask)
    guess = model.most_likely(observed.detach(), attention_mask).to(ids.device)
    counted = counted.to(ids.device)
    hits = guess[counted] == ids[counted]
    return AttackResult(name=name or "learned-inversion", successes=int(hits.sum()), trials=int(hits.numel()),
                        chance=1 / model.vocabulary.shape[0],
                        details={"window": model.window, "linear_map": model.weight is not None,
                                 "weights": list(model.weights), "seconds": time.perf_counter() - start})


# --- the relaxed-token refinement, with a gradient term ----------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class GradientInversionConfig(OptimisationInversionConfig):
    """:class:`OptimisationInversionConfig`'s optimisation, plus the weight of the gradient term."""

    gradient_weight: float = 0.0  # lambda_g; 0: the forward-only optimisation


@dataclass(frozen=True, kw_only=True)
class RefinementInputs:
    """What :func:`gradient_inversion` uses beside the forward rows: the returned gradients with the attacker's
    model of them (both needed when ``gradient_weight`` > 0), and where the relaxed tokens start."""

    observed_gradients: torch.Tensor | None = None  # (B, D): what the customer returned for each example
    gradient_forward: GradientForward | None = None  # the attacker's G (see GradientForward)
    init_logits: torch.Tensor | None = None  # (B, L, |V|), e.g. InversionModel.log_posterior: start at q
    generator: torch.Generator | None = None  # draws the random start without init_logits (OS-seeded when None)


@dataclass(frozen=True)
class _Objective:
    relaxation: _Relaxation
    gradient_forward: GradientForward | None
    gradient_weight: float


def _gradient_term(objective: _Objective, rows: torch.Tensor, attention_mask: torch.Tensor, index: torch.Tensor,
                   observed: torch.Tensor) -> torch.Tensor:
    """(1 / b) sum_b ||G(rows)_b - g_b||^2 / ||g_b||^2."""
    assert objective.gradient_forward is not None
    predicted = objective.gradient_forward(rows, attention_mask, index)
    if predicted.shape != observed.shape:
        raise ValueError(f"gradient_forward returned shape {tuple(predicted.shape)}, the observed gradients have "
                         f"{tuple(observed.shape)}")
    return ((predicted - observed).pow(2).sum(dim=-1) / observed.pow(2).sum(dim=-1).clamp_min(_TINY)).mean()


def _refine_chunk(objective: _Objective, observed: torch.Tensor, attention_mask: torch.Tensor,
                  gradients: torch.Tensor | None, index: torch.Tensor, init: torch.Tensor | None) -> torch.Tensor:
    """argmax of the optimised logits (b, L) for one chunk: optimisation_inversion's loop (the same random start
    without ``init``, so weight 0 reproduces it), plus the gradient term."""
    extra = None
    if objective.gradient_weight > 0 and gradients is not None:
        observed_gradients = gradients

        def extra(output: torch.Tensor) -> torch.Tensor:
            return objective.gradient_weight * _gradient_term(objective, output, attention_mask, index,
                                                              observed_gradients)

    start = None if init is None else objective.relaxation.schedule[0] * init
    return _invert_chunk(objective.relaxation, observed, attention_mask, init=start, extra_loss=extra)


def _check_gradient_inputs(observed: torch.Tensor, inputs: RefinementInputs, gradient_weight: object,
                           vocab_size: int) -> tuple[torch.Tensor | None, float, torch.Tensor | None]:
    weight = check_non_negative_finite("gradient_weight", gradient_weight)
    gradient_forward = inputs.gradient_forward
    if gradient_forward is not None and not callable(gradient_forward):
        raise ValueError(f"gradient_forward must be callable (a GradientForward), got "
                         f"{type(gradient_forward).__name__}")
    gradients = None
    if weight > 0:
        if gradient_forward is None:
            raise ValueError("gradient_forward must be callable when gradient_weight > 0")
        gradients = check_float_tensor("observed_gradients", inputs.observed_gradients, ndim=2).detach()
        if gradients.shape[0] != observed.shape[0]:
            raise ValueError(f"observed_gradients has {gradients.shape[0]} rows for {observed.shape[0]} examples")
        gradients = gradients.to(observed)
    init = None
    if inputs.init_logits is not None:
        init = check_float_tensor("init_logits", inputs.init_logits, ndim=3).detach()
        if tuple(init.shape) != (*observed.shape[:2], vocab_size):
            raise ValueError(f"init_logits has shape {tuple(init.shape)}, expected "
                             f"{(*observed.shape[:2], vocab_size)}")
    return gradients, weight, init


def gradient_inversion(
    observed: torch.Tensor,
    attention_mask: torch.Tensor,
    bottom_forward: BottomForward,
    vocabulary: torch.Tensor,
    true_ids: torch.Tensor,
    *,
    inputs: RefinementInputs = RefinementInputs(),
    mask: torch.Tensor | None = None,
    config: GradientInversionConfig = GradientInversionConfig(),
) -> AttackResult:
    """Recover the tokens behind ``observed`` from the forward rows and, with ``config.gradient_weight`` > 0, the
    returned gradients ``inputs.observed_gradients`` (B, D), through ``inputs.gradient_forward`` (see
    :data:`GradientForward`; it gets the rows the bottom would give for the relaxed tokens and the examples'
    indices into ``observed``).

    ``inputs.init_logits`` (B, L, |V|), e.g. :meth:`InversionModel.log_posterior`, starts the relaxed tokens at that
    posterior (random near-uniform logits, drawn with ``inputs.generator``, otherwise). The other arguments are
    those of :func:`~privlm.attacks.optimisation_inversion.optimisation_inversion`, which this equals at weight 0
    without ``init_logits``.
    """
    start = time.perf_counter()
    ids, attention_mask, counted = _check_inputs(observed, attention_mask, vocabulary, true_ids, mask)
    relaxation = _relaxation_of(config, observed, bottom_forward, vocabulary, inputs.generator)
    gradients, weight, init = _check_gradient_inputs(observed, inputs, config.gradient_weight, vocabulary.shape[0])
    batch_size = check_positive_int("batch_size", config.batch_size)
    objective = _Objective(relaxation=relaxation, gradient_forward=inputs.gradient_forward, gradient_weight=weight)
    target = observed.detach()
    predictions = []
    with _frozen(_modules_of(bottom_forward) + _modules_of(inputs.gradient_forward)), torch.enable_grad():
        for first in range(0, target.shape[0], batch_size):
            rows = slice(first, first + batch_size)
            index = torch.arange(target.shape[0], device=target.device)[rows]
            predictions.append(_refine_chunk(
                objective, target[rows], attention_mask[rows], None if gradients is None else gradients[rows],
                index, None if init is None else init[rows]))
    counted = counted.to(ids.device)
    hits = torch.cat(predictions).to(ids.device)[counted] == ids[counted]
    details: dict[str, Any] = {"steps": len(relaxation.schedule), "lr": relaxation.lr, "batch_size": batch_size,
                               "temperature": (float(config.temperature[0]), float(config.temperature[1])),
                               "gradient_weight": weight, "with_gradient_term": weight > 0,
                               "init": "learned" if init is not None else "random",
                               "vocab_size": int(vocabulary.shape[0]), "seconds": time.perf_counter() - start}
    default = "gradient-inversion" if weight > 0 else "forward-inversion"
    return AttackResult(name=config.name or default, successes=int(hits.sum()), trials=int(hits.numel()),
                        chance=1 / vocabulary.shape[0], details=details)


__all__ = ["CALIBRATION_POSITIONS", "GradientForward", "GradientInversionConfig", "InversionModel",
           "InversionModelConfig", "RefinementInputs", "fit_inversion_model", "gradient_inversion",
           "learned_inversion"]
