"""Cape: each sensitive token of a prompt replaced on the user's machine, by a bucketized exponential mechanism
whose utility mixes a small local model's contextual logits with embedding distance.

Pipeline of one batch of prompts:
  1. tokenize (no special tokens added) and flag every token (:func:`~privlm.models.prompts.tokenize_prompt`):
     non-sensitive tokens (stopwords and punctuation) pass through unchanged; every other token,
     the tokenizer's unknown token included, is perturbed;
  2. ``prepare``: one forward pass of the device model for every sensitive position of the batch, one
     matrix product for their distances, and the utility rows u in [0, Delta] (:mod:`privlm.cape.utility`);
     this does not depend on epsilon;
  3. ``release``: charge the ledger the sound per-prompt total (:mod:`privlm.cape.accounting`), then
     draw one candidate per sensitive position (:mod:`privlm.cape.sampling`), and report every token.

Guarantee: see :mod:`privlm.cape.accounting` (neighbouring relation, what is revealed, how it composes).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, replace

import torch

from privlm.accounting import Ledger
from privlm.cape.accounting import (
    GUARANTEE,
    PAPER,
    PRIVLM,
    PairBound,
    check_neighbours,
    paper_total,
    privlm_total,
)
from privlm.cape.calibration import LogitBound, bound_from_logits
from privlm.cape.config import CapeConfig, OnUncalibrated
from privlm.cape.sampling import CapeBucketizedMechanism
from privlm.cape.utility import (
    Query,
    chunk_of,
    context_room,
    device_logits,
    distance_scores,
    hybrid_utility,
    logit_scores,
    logits_and_distances,
    tied_head,
)
from privlm.mechanisms import (
    ExponentialMechanism,
    PrivacyUnit,
    bucketized_pair_bound,
    exact_privacy_loss,
)
from privlm.mechanisms.randomness import resolve_generator
from privlm.models import check_texts
from privlm.models.language import LanguageModel
from privlm.models.perturbation import (
    NOTHING_SPENT,
    PerturbedPrompt,
    PromptReport,
    TokenOutcome,
    charge_prompts,
    perturb_one,
    released_text,
    token_records,
)
from privlm.models.prompts import NonSensitiveTokens, PromptTokens, tokenize_prompt
from privlm.models.vocabulary import CandidateVocabulary
from privlm.validation import check_in_interval

CapeMechanism = CapeBucketizedMechanism | ExponentialMechanism


@dataclass(frozen=True, eq=False)
class PreparedPrompt:
    """A tokenized prompt and the utility rows of its perturbed positions: everything but epsilon and the draw."""

    tokens: PromptTokens
    positions: tuple[int, ...]  # the perturbed positions (sensitive, unknown tokens included), ascending
    utilities: torch.Tensor  # (len(positions), |C|) float32, every entry in [0, Delta]
    chunks: tuple[int, ...]  # the chunk (context) each token was processed in
    n_chunks: int
    prepared_by: tuple[object, ...] = ()  # the Cape that made it: device model, lambdas, B (release checks it)


@dataclass(frozen=True, kw_only=True)
class CapeOptions:
    """Cape's less often set knobs (defaults from the paper: lambda_L = 0.5, lambda_D = 1.0, N_b = 50).

    ``n_buckets=None``: the plain exponential mechanism on the hybrid utility. ``on_uncalibrated``: what Cape does
    without B when ``lambda_L > 0`` (see :class:`Cape`). ``non_sensitive``: the tokens that pass unchanged (None:
    English stopwords and punctuation). ``batch_size``: prompts per forward pass. Checked with epsilon, in
    :class:`~privlm.cape.config.CapeConfig`.
    """

    lambda_L: float = 0.5  # noqa: N815 (the paper's name)
    lambda_D: float = 1.0  # noqa: N815
    n_buckets: int | None = 50
    on_uncalibrated: OnUncalibrated = "error"
    non_sensitive: NonSensitiveTokens | None = None
    batch_size: int = 16

    def config(self, *, epsilon: float, logit_bound: float | LogitBound | None) -> CapeConfig:
        """The configuration these options give at ``epsilon`` with B (refused when out of range)."""
        bound = logit_bound.value if isinstance(logit_bound, LogitBound) else logit_bound
        return CapeConfig(epsilon=epsilon, lambda_L=self.lambda_L, lambda_D=self.lambda_D, n_buckets=self.n_buckets,
                          logit_bound=bound, on_uncalibrated=self.on_uncalibrated, batch_size=self.batch_size)


class Cape:
    """Cape with privlm's utility (:mod:`privlm.cape.utility`) and accounting (:mod:`privlm.cape.accounting`).

    ``device_model``: ``"smollm2"`` (the default causal LM), a local folder of a causal or masked LM, or a
    loaded :class:`LanguageModel` (``device`` applies only when loading). ``epsilon`` is per perturbed token.
    ``logit_bound``: B as a number, or a :class:`LogitBound` calibrated on this very model (else refused).
    ``options``: the utility's weights, the buckets (``n_buckets=None``: the plain exponential mechanism on the
    hybrid utility), the non-sensitive tokens and the batch size (:class:`CapeOptions`). When B is not set
    and ``lambda_L > 0``, ``on_uncalibrated="error"`` refuses to run; ``"calibrate"`` warns and
    calibrates on the first prompts it sees (B then depends on those prompts: each release's guarantee
    with respect to its own prompt holds whatever B is, because every utility stays in [0, Delta]; but
    B, kept for later calls, is a function of the first prompts, so calibrate on public text where
    that matters). ``generator``: the only source of randomness (OS-seeded when None).
    """

    name = "cape"
    unit = PrivacyUnit.EPSILON  # what its ledger charges count: the sound per-prompt total of privlm.cape.accounting

    def __init__(self, device_model: str | LanguageModel = "smollm2", *, epsilon: float,
                 logit_bound: float | LogitBound | None = None, options: CapeOptions | None = None,
                 generator: torch.Generator | None = None, ledger: Ledger | None = None, principal: str = "local",
                 device: str = "auto") -> None:
        options = options or CapeOptions()
        self.config = options.config(epsilon=epsilon, logit_bound=logit_bound)
        self.device_model = (device_model if isinstance(device_model, LanguageModel)
                             else LanguageModel.from_pretrained(device_model, device=device))
        _check_device_model(self.device_model, logit_bound)
        self.logit_bound = logit_bound if isinstance(logit_bound, LogitBound) else None
        self.room = context_room(self.device_model)
        self._head = tied_head(self.device_model) if self.config.uses_logits else None
        self.non_sensitive = options.non_sensitive or NonSensitiveTokens.english()
        self.generator = resolve_generator(generator, self.device_model.device)
        self.ledger, self.principal = ledger, principal

    @staticmethod
    def check(device_model: LanguageModel, *, epsilon: float, logit_bound: float | LogitBound | None = None,
              options: CapeOptions | None = None) -> None:
        """Refuse what the constructor would refuse for these arguments, building nothing: a configuration out of
        range, a masked model without a mask token, a bound calibrated on another model."""
        (options or CapeOptions()).config(epsilon=epsilon, logit_bound=logit_bound)
        _check_device_model(device_model, logit_bound)

    @property
    def vocabulary(self) -> CandidateVocabulary:
        """The candidate set C: the device model's vocabulary minus its special tokens (|C| = ``vocabulary.size``)."""
        return self.device_model.vocabulary

    def __repr__(self) -> str:
        c = self.config
        bound = "uncalibrated" if c.logit_bound is None else f"{c.logit_bound:.4g}"
        return (f"Cape({self.device_model.name} ({self.device_model.kind}), |C|={self.vocabulary.size}, "
                f"epsilon={c.epsilon:g}, lambda_L={c.lambda_L:g}, lambda_D={c.lambda_D:g}, "
                f"n_buckets={c.n_buckets}, B={bound})")

    # --- the mechanism and B ------------------------------------------------------------------
    def mechanism(self, epsilon: float | None = None) -> CapeMechanism:
        """The per-position mechanism at ``epsilon`` (default: the configured one), sensitivity lambda_L + lambda_D."""
        eps = self.config.epsilon if epsilon is None else epsilon
        if self.config.n_buckets is None:
            return ExponentialMechanism(epsilon=eps, sensitivity=self.config.sensitivity)
        return CapeBucketizedMechanism(epsilon=eps, sensitivity=self.config.sensitivity,
                                       n_buckets=self.config.n_buckets)

    def calibrate(self, texts: Sequence[str], *, quantile: float = 1.0) -> LogitBound:
        """Set B to the ``quantile`` of |logits| over the candidate columns at every position of ``texts``."""
        check_texts(texts)
        quantile = check_in_interval("quantile", quantile, 0, 1, low_open=True)
        prompts = [self._tokenize(text) for text in texts]
        kept, n_logits = [], 0
        for batch in _batches(prompts, self.config.batch_size):
            queries = [q for p in batch for q in self._queries(p, range(len(p)))]
            if queries:
                magnitudes = device_logits(self.device_model, queries).abs_().flatten()
                n_logits += magnitudes.numel()
                kept.append(magnitudes.max().reshape(1) if quantile == 1.0 else magnitudes)  # the max needs no more
        if not kept:
            raise ValueError("the calibration texts hold no tokens")
        bound = LogitBound(value=bound_from_logits(torch.cat(kept), quantile),
                           model_fingerprint=self.device_model.weights_fingerprint, quantile=quantile,
                           n_texts=len(texts), n_logits=n_logits)
        self.logit_bound = bound
        self.config = replace(self.config, logit_bound=bound.value)
        return bound

    def _require_bound(self, texts: Sequence[str]) -> float:
        if self.config.logit_bound is not None:
            return self.config.logit_bound
        if self.config.on_uncalibrated == "error":
            raise ValueError("the logit bound B is not calibrated: call Cape.calibrate(sample_texts) first, pass "
                             "logit_bound=, or use on_uncalibrated='calibrate'")
        warnings.warn("Cape's logit bound B is not calibrated: calibrating it on the first prompts "
                      f"({len(texts)} texts); B then depends on them (see Cape's docstring)", stacklevel=3)
        return self.calibrate(texts).value

    # --- utilities ----------------------------------------------------------------------------
    def _tokenize(self, text: str) -> PromptTokens:
        return tokenize_prompt(self.vocabulary.tokenizer, text, self.non_sensitive)

    def _queries(self, prompt: PromptTokens, positions: Sequence[int]) -> list[Query]:
        """One query per chunk holding a wanted position; each chunk is its own context."""
        by_chunk: dict[int, list[int]] = {}
        for i in positions:
            by_chunk.setdefault(i // self.room, []).append(i % self.room)
        return [Query(ids=prompt.ids[c * self.room:(c + 1) * self.room], positions=tuple(local))
                for c, local in sorted(by_chunk.items())]

    def preparation_key(self, scope: Hashable) -> Hashable | None:
        """Capes with one key may share a preparation (:class:`~privlm.models.perturbation.SharedPreparation`): one
        device model, one configuration but for epsilon, one non-sensitive list. None where this Cape calibrates B
        on its first texts (it would take them from another request). An int8 model's dynamic quantization scales
        a batch as a whole, so a text's utilities depend on the others': there only one ``scope`` shares."""
        if self.config.on_uncalibrated != "error":
            return None
        key: tuple[Hashable, ...] = (id(self.device_model), replace(self.config, epsilon=1.0), self.non_sensitive)
        return (*key, scope) if self.device_model.quantized else key

    def prepare(self, texts: Sequence[str]) -> list[PreparedPrompt]:
        """Tokens and utility rows of every prompt (one forward pass per batch); independent of epsilon."""
        check_texts(texts)
        prompts = [self._tokenize(text) for text in texts]
        needs_bound = self.config.uses_logits and any(p.sensitive_positions for p in prompts)
        bound = self._require_bound(texts) if needs_bound else self.config.logit_bound
        return [prepared for batch in _batches(prompts, self.config.batch_size)
                for prepared in self._prepare_batch(batch, bound)]

    def utilities(self, prompts: Sequence[PromptTokens], bound: float | None = None) -> list[torch.Tensor]:
        """Per prompt, the (n_s, |C|) float32 utility rows of its perturbed positions (:mod:`privlm.cape.utility`).

        One forward pass of the device model for all of them; ``bound``: B (default: the configured one).
        """
        positions = [p.sensitive_positions for p in prompts]
        counts = [len(ps) for ps in positions]
        if sum(counts) == 0:
            return [torch.zeros((0, self.vocabulary.size), device=self.vocabulary.device) for _ in prompts]
        c = self.config
        bound = c.logit_bound if bound is None else bound
        if c.uses_logits and bound is None:
            raise ValueError("the logit bound B is not calibrated: call Cape.calibrate(sample_texts) first")
        queries = ([q for p, ps in zip(prompts, positions, strict=True) for q in self._queries(p, ps)]
                   if c.uses_logits and bound is not None else None)
        ids = (torch.tensor([p.ids[i] for p, ps in zip(prompts, positions, strict=True) for i in ps],
                            device=self.vocabulary.device) if c.lambda_D > 0 else None)
        logits, distances = logits_and_distances(self.device_model, self._head, queries, ids)
        utility = hybrid_utility(None if logits is None or bound is None else logit_scores(logits, bound, c.lambda_L),
                                 None if distances is None else distance_scores(distances, c.lambda_D),
                                 sensitivity=c.sensitivity)
        return list(utility.split(counts))

    def _prepare_batch(self, prompts: list[PromptTokens], bound: float | None) -> list[PreparedPrompt]:
        rows = self.utilities(prompts, bound)
        return [PreparedPrompt(tokens=p, positions=tuple(p.sensitive_positions), utilities=u,
                               prepared_by=self._utility_key(bound),
                               chunks=tuple(chunk_of(len(p), self.room)),
                               n_chunks=max(1, math.ceil(len(p) / self.room)))
                for p, u in zip(prompts, rows, strict=True)]

    # --- release ------------------------------------------------------------------------------
    def perturb(self, text: str) -> PerturbedPrompt:
        return perturb_one(self, text)

    def perturb_batch(self, texts: Sequence[str]) -> list[PerturbedPrompt]:
        return self.release(self.prepare(texts))

    def release(self, prepared: Sequence[PreparedPrompt], *, epsilon: float | None = None,
                generator: torch.Generator | None = None) -> list[PerturbedPrompt]:
        """Charge the ledger for every prompt, then draw and report; ``epsilon`` overrides the configured one.

        The ledger is charged each prompt's "privlm" total before anything is drawn, in one transaction: a batch
        whose total passes the remaining budget is refused whole (BudgetExhaustedError, nothing charged or
        released), concurrent spenders included.
        """
        mechanism = self.mechanism(epsilon)
        self._check_prepared(prepared)
        generator = self.generator if generator is None else resolve_generator(generator, self.vocabulary.device)
        totals = [privlm_total(mechanism, p.utilities) for p in prepared]
        spent = charge_prompts(self.ledger, self.principal, self.unit, totals, note=self.name)
        return [self._release_one(p, mechanism, generator, total, charged)
                for p, total, charged in zip(prepared, totals, spent, strict=True)]

    def _utility_key(self, bound: float | None) -> tuple[object, ...]:
        c = self.config
        return (id(self.device_model), c.lambda_L, c.lambda_D, bound if c.uses_logits else None)

    def _check_prepared(self, prepared: Sequence[PreparedPrompt]) -> None:
        """Utilities made by this Cape (same device model and lambdas), inside [0, Delta]: what the charge assumes."""
        mine = {self._utility_key(self.config.logit_bound)[:3]}
        for i, p in enumerate(prepared):
            if p.prepared_by[:3] not in mine:
                raise ValueError(f"prepared[{i}] was prepared by another Cape (other device model or lambdas); "
                                 "prepare it with this one")
            if p.utilities.numel() and (p.utilities.amin().item() < 0
                                        or p.utilities.amax().item() > self.config.sensitivity):
                raise ValueError(f"prepared[{i}] holds utilities outside [0, {self.config.sensitivity:g}]")

    def _draw(self, mechanism: CapeMechanism, utility: torch.Tensor,
              generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, list[int | None]]:
        """Candidate indices drawn, the paper's eps' per row, and K (None without bucketing)."""
        if isinstance(mechanism, CapeBucketizedMechanism):
            draws, buckets = mechanism.release_rows(utility, generator)
            return draws, buckets.eps_prime, [int(k) for k in buckets.non_empty.tolist()]
        draws = mechanism.sample(utility, generator=generator)
        return draws, torch.zeros(utility.shape[0], dtype=torch.float64), [None] * utility.shape[0]

    def _release_one(self, prepared: PreparedPrompt, mechanism: CapeMechanism, generator: torch.Generator,
                     total: float, charged: float | None) -> PerturbedPrompt:
        prompt, positions = prepared.tokens, prepared.positions
        n = len(prompt)
        released = list(prompt.ids)
        epsilon: list[float | None] = [None] * n
        eps_prime: list[float | None] = [None] * n
        buckets: list[int | None] = [None] * n
        paper = 0.0
        if positions:
            draws, row_eps_prime, row_buckets = self._draw(mechanism, prepared.utilities, generator)
            ids = self.vocabulary.candidate_ids[draws].tolist()
            for j, i in enumerate(positions):
                released[i], epsilon[i] = int(ids[j]), mechanism.epsilon
                eps_prime[i], buckets[i] = float(row_eps_prime[j]), row_buckets[j]
            paper = paper_total(mechanism.epsilon, row_eps_prime)
        outcomes = [TokenOutcome.UNKNOWN if unknown else TokenOutcome.NON_SENSITIVE if kept else TokenOutcome.PERTURBED
                    for kept, unknown in zip(prompt.non_sensitive, prompt.unknown, strict=True)]
        records = token_records(prompt, self.vocabulary, released, outcomes, epsilon=epsilon, eps_prime=eps_prime,
                                non_empty_buckets=buckets, chunks=prepared.chunks)
        report = PromptReport(mechanism=self.name, tokens=records, candidate_set_size=self.vocabulary.size,
                              accounting={PAPER: paper, PRIVLM: total}, guarantee=GUARANTEE,
                              chunks=prepared.n_chunks, uncovered=prompt.uncovered, spent=charged,
                              notes=_notes(prompt, bool(positions)))
        return PerturbedPrompt(text=released_text(self.vocabulary, released), report=report)

    # --- the bound for two concrete prompts ----------------------------------------------------
    def pair_bound(self, text: str, text_prime: str, *, epsilon: float | None = None) -> PairBound:
        """Per perturbed position of two neighbouring prompts: the sound bound on their own rows, and the exact loss.

        Refuses prompts that are not neighbours (different token count, or different non-sensitive tokens
        or places). Without bucketing the per-position bound is epsilon.
        """
        check_texts([text, text_prime])
        check_neighbours(self._tokenize(text), self._tokenize(text_prime))  # before any forward pass
        first, second = self.prepare([text, text_prime])
        mechanism = self.mechanism(epsilon)
        u, u_prime = first.utilities, second.utilities
        if not first.positions:
            return PairBound(positions=(), per_position=(), exact=(), epsilon=mechanism.epsilon)
        exact = exact_privacy_loss(mechanism.log_probabilities(u), mechanism.log_probabilities(u_prime))
        if isinstance(mechanism, CapeBucketizedMechanism):
            bound = bucketized_pair_bound(mechanism.bucketing(u), mechanism.bucketing(u_prime),
                                          epsilon=mechanism.epsilon)
        else:
            bound = torch.full((u.shape[0],), mechanism.epsilon, dtype=torch.float64)
        return PairBound(positions=first.positions, per_position=tuple(bound.tolist()), exact=tuple(exact.tolist()),
                         epsilon=mechanism.epsilon)


def _check_device_model(device_model: LanguageModel, logit_bound: float | LogitBound | None) -> None:
    if device_model.kind == "masked" and device_model.tokenizer.mask_token_id is None:
        raise ValueError("a masked device model needs a tokenizer with a mask token; this one has none")
    if isinstance(logit_bound, LogitBound):
        logit_bound.check_model(device_model.weights_fingerprint)


def _batches(items: list[PromptTokens], size: int) -> list[list[PromptTokens]]:
    return [items[start:start + size] for start in range(0, len(items), size)]


def _notes(prompt: PromptTokens, perturbed: bool) -> tuple[str, ...]:
    notes = [] if perturbed else [NOTHING_SPENT]
    n_unknown = sum(prompt.unknown)
    if n_unknown:
        notes.append(f"{n_unknown} token(s) the tokenizer could not represent (its unknown token) were perturbed "
                     "from the unknown token's embedding row")
    if prompt.uncovered:
        notes.append(f"{len(prompt.uncovered)} character span(s) no token covers were dropped by the tokenizer "
                     "and are not in the released text (see uncovered)")
    return tuple(notes)


