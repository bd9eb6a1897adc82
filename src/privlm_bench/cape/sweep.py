"""Sweep ``cape``: Cape, two Cape ablations and the token-level baselines over epsilon, on tweet sentiment.

Every mechanism runs on the device model's (SmolLM2's) tokenizer, candidate vocabulary and embedding
table (:mod:`privlm.models.text_mechanisms`). Data: ``tweets-binary`` (negative vs positive), split
train / validation / test by the seed; nothing is chosen on the test split. Cape's logit bound B is
calibrated on training texts. Per (mechanism, epsilon), the test texts are perturbed once and scored:

Utility
- ``classifier_auc``, ``classifier_accuracy``: MiniLM sentence embeddings and logistic regression,
  trained on the clean training texts (C chosen by validation log-loss), applied to the perturbed test texts;
- ``zero_shot_auc``: the device model classifies the first ``zero_shot_texts`` perturbed test texts
  zero-shot with Cape's prompt (:mod:`privlm_bench.harness.zero_shot`); ``zero_shot_clean_auc`` is the same on the
  clean texts, the ceiling of this measure (0.5 is no signal);
- ``rouge_l`` (Rouge-L F1 on whitespace words) and ``cosine`` (MiniLM embeddings), original vs perturbed.

Privacy
- ``knn_success``: the KNN attack, top-10 nearest embedding rows of each released token
  (:func:`~privlm.attacks.token_id_inversion` with k = 10), on the positions that went through the mechanism
  (every token but the non-sensitive ones it passes through; SANTEXT+'s kept frequent tokens count: keeping
  them is the mechanism's own draw). The top-10 of a released id does not depend on where it appears, so
  each id's top-10 is computed once per run (:class:`KnnGuesses`; equal to ``token_id_inversion``).
  ``knn_success_sensitive``: the same attack on a set common to every mechanism, the tokens outside the
  shipped English non-sensitive list;
- ``mti_success``, ``mti_rouge_l``: masked-token inference with the causal-LM stand-in on SmolLM2
  (:func:`~privlm.attacks.masked_token_inference`), on the first ``mti_sentences`` test sentences of at most
  ``mti_max_tokens`` tokens (it is slow: one sentence-length forward pass per candidate and position);
- ``retention``: share of the mechanism's positions released unchanged; ``unchanged_share``: of all tokens;
- ``nw_median`` / ``nw_mean``: N_w, the distinct outputs of 1,000 perturbations of each of ``nw_tokens``
  sampled sensitive test tokens (Cape: the token in its real context, from its prepared utility row;
  baselines: their per-position mechanism).

Cape's device-model forward pass runs once per test text for every epsilon of Cape and of its
unbucketed ablation (same utilities): the first point of such a group prepares the rows and releases
them at every epsilon. ``perturb_seconds`` is the time spent perturbing the test texts: for a Cape group,
its releases plus an even share of the preparation; for a baseline, ``perturb_batch`` (its construction
is timed with the setup, in speed.json).
The rows ``cape-int8`` repeat Cape with the int8-quantized device model (its own B) at ``int8_epsilons``
(when Cape is in the run and the device model is on the CPU, where int8 dynamic quantization runs).
"""

from __future__ import annotations

import math
import resource
import statistics
import time
import warnings
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

import privlm.baselines
import privlm.cape  # noqa: F401 (Cape's variants register by name)
from privlm.attacks import AttackResult, MaskedTokenConfig, masked_token_inference, rouge_l_f1
from privlm.cape import Cape, PublicContextCape
from privlm.mechanisms import make_generator, nearest_neighbours
from privlm.models import SplitModel
from privlm.models.language import LanguageModel
from privlm.models.perturbation import PerturbedPrompt, TextPerturber, TokenOutcome
from privlm.models.prompts import NonSensitiveTokens, tokenize_prompt
from privlm.models.text_mechanisms import MechanismContext, TextMechanism, text_mechanism, text_mechanisms
from privlm_bench.data import named_task, split_dataset
from privlm_bench.harness.bench import NON_PRIVATE, Method, Point, Sweep
from privlm_bench.harness.probes import Probe, classification_metrics, embedding_agreement
from privlm_bench.harness.zero_shot import ZeroShotClassifier, zero_shot_auc

NAME = "cape"
DEFAULT_EPSILONS = (1.0, 2.0, 3.0, 6.0, 10.0, 14.0, 20.0)
KNN_K = 10
NW_SAMPLES = 1000
NW_POOL_TEXTS = 50  # N_w tokens are sampled among the sensitive tokens of the first 50 test texts
CAPE_INT8 = Method("cape-int8", "Cape, int8 device model")
# Claims and plots compare on the token set every mechanism shares (stopwords that Cape and CUSTEXT+ keep are
# out of it), so that no mechanism is scored on easier or harder tokens than another.
UTILITY_METRIC, ATTACK_METRIC = "classifier_auc", "knn_success_sensitive"


def method_of(mechanism: TextMechanism) -> Method:
    return Method(mechanism.key, mechanism.label)


TOKEN_LEVEL = tuple(m for m in text_mechanisms() if not m.rewrites)  # DP-Prompt's paraphrase: privlm bench chat-quality
METHODS = (*(method_of(m) for m in TOKEN_LEVEL), CAPE_INT8)


def _rewrites(name: str) -> bool:
    """Whether the registered mechanism ``name`` rewrites the prompt (an unregistered name is checked where it is
    built: a test registers its own)."""
    try:
        return text_mechanism(name).rewrites
    except ValueError:
        return False


@dataclass(kw_only=True)
class CapeSetting:
    """Everything the sweep records in ``results.json``."""

    task: str = "tweets-binary"
    mechanisms: tuple[str, ...] = field(default_factory=lambda: tuple(m.name for m in TOKEN_LEVEL))
    epsilons: tuple[float, ...] = DEFAULT_EPSILONS
    n_train: int = 2000
    n_validation: int = 500
    n_test: int = 500
    calibration_texts: int = 100
    zero_shot_texts: int = 150
    mti_sentences: int = 2
    mti_top_k: int = 5
    mti_max_tokens: int = 24
    nw_tokens: int = 20
    int8_epsilons: tuple[float, ...] = (6.0, 14.0)
    device_model: str = "smollm2"
    encoder: str = "minilm"
    seed: int = 0
    device: str = "auto"
    prepare_chunk: int = 32

    def __post_init__(self) -> None:
        for name in ("n_train", "n_validation", "n_test", "calibration_texts", "mti_top_k", "mti_max_tokens",
                     "prepare_chunk"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("zero_shot_texts", "mti_sentences", "nw_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative integer (0 turns it off), got {value!r}")
        if not self.epsilons or any(not (math.isfinite(e) and e > 0) for e in (*self.epsilons, *self.int8_epsilons)):
            raise ValueError(f"epsilons must be finite and > 0, got {self.epsilons} and {self.int8_epsilons}")
        rewriting = [name for name in self.mechanisms if _rewrites(name)]
        if rewriting:
            raise ValueError(f"{', '.join(rewriting)} rewrite(s) the prompt, so no released token stands for an "
                             "original one and this benchmark's token attacks do not apply: measure it with "
                             "privlm bench chat-quality")


@dataclass
class Released:
    """One point's perturbed test texts, its N_w counts and the seconds the mechanism took."""

    prompts: list[PerturbedPrompt]
    nw: list[int]
    seconds: float


class KnnGuesses:
    """The KNN attack's top-k guesses per released token id, computed once per id and kept.

    The guess of :func:`~privlm.attacks.token_id_inversion` (k nearest rows of the embedding table to the
    released id's row) depends on the released id only, so a run computes it at most once per id.
    """

    def __init__(self, table: torch.Tensor, k: int = KNN_K) -> None:
        self.table = table.detach().float()
        self.k = k
        self.guesses = torch.full((self.table.shape[0], k), -1, dtype=torch.long, device=self.table.device)

    def attack(self, released: torch.Tensor, original: torch.Tensor) -> AttackResult:
        """Success when the original id is among the k rows nearest to the released id's row."""
        released, original = released.to(self.table.device).long(), original.to(self.table.device).long()
        if released.numel() == 0:
            raise ValueError("the KNN attack needs at least one position")
        unique = released.unique()
        missing = unique[self.guesses[unique, 0] < 0]
        if missing.numel():
            self.guesses[missing] = nearest_neighbours(self.table[missing], self.table, k=self.k)[0]
        hits = (self.guesses[released] == original[:, None]).any(dim=1)
        return AttackResult(name=f"knn-top{self.k}", successes=int(hits.sum()), trials=int(hits.numel()),
                            chance=self.k / self.table.shape[0],
                            details={"k": self.k, "vocab_size": self.table.shape[0], "metric": "l2"})


@dataclass
class TokenView:
    """Per prompt: original ids, released ids, and which positions the mechanism handled."""

    original: list[list[int]]
    released: list[list[int]]
    through: list[list[bool]]

    @classmethod
    def of(cls, prompts: Sequence[PerturbedPrompt]) -> TokenView:
        original = [[t.original_id for t in p.report.tokens] for p in prompts]
        released = [[t.released_id for t in p.report.tokens] for p in prompts]
        through = [[t.outcome is not TokenOutcome.NON_SENSITIVE for t in p.report.tokens] for p in prompts]
        return cls(original, released, through)

    def flat(self, select: Sequence[Sequence[bool]]) -> tuple[torch.Tensor, torch.Tensor]:
        pairs = [(r, o) for rs, os_, ss in zip(self.released, self.original, select, strict=True)
                 for r, o, s in zip(rs, os_, ss, strict=True) if s]
        released, original = zip(*pairs, strict=True) if pairs else ((), ())
        return torch.tensor(released, dtype=torch.long), torch.tensor(original, dtype=torch.long)


class CapeBench:
    """State shared by the points: models, splits, the clean classifier, B, and the cached Cape releases."""

    def __init__(self, setting: CapeSetting, *, mechanisms: Sequence[TextMechanism] | None = None) -> None:
        self.setting = s = setting
        self.mechanisms = {m.key: m for m in (mechanisms or text_mechanisms(s.mechanisms))}
        self.lm = LanguageModel.from_pretrained(s.device_model, device=s.device)
        self.encoder = SplitModel.from_pretrained(s.encoder, device=s.device)
        splits = split_dataset(named_task(s.task), seed=s.seed).head(train=s.n_train, validation=s.n_validation,
                                                                     test=s.n_test)
        self.texts = {name: list(getattr(splits, name).texts) for name in ("train", "validation", "test")}
        self.labels = {name: np.asarray(getattr(splits, name).labels) for name in ("train", "validation", "test")}
        self.clean = {name: self.embed(texts) for name, texts in self.texts.items()}
        self.classifier = Probe(kind="logistic", seed=s.seed).fit(self.clean["train"], self.labels["train"],
                                                                 self.clean["validation"], self.labels["validation"])
        self.prompts = [tokenize_prompt(self.lm.tokenizer, text, NonSensitiveTokens.english())
                        for text in self.texts["test"]]
        self.context = MechanismContext(self.lm, self._calibrate(self.lm))
        self.int8_context: MechanismContext | None = None
        if s.int8_epsilons and "cape" in self.mechanisms and self.lm.device.type == "cpu":  # int8: CPU only
            quantized = self.lm.quantize_int8()
            self.int8_context = MechanismContext(quantized, self._calibrate(quantized))
        self.zero_shot = ZeroShotClassifier(self.lm)
        n_zero_shot = min(s.zero_shot_texts, len(self.texts["test"]))
        self.zero_shot_clean = (zero_shot_auc(self.zero_shot.scores(self.texts["test"][:n_zero_shot]),
                                              self.labels["test"][:n_zero_shot]) if n_zero_shot else math.nan)
        self.knn = KnnGuesses(self.lm.vocabulary.embeddings)
        self.mti_indices = self._mti_indices()
        self.nw_sites = self._nw_sites()
        self._released: dict[tuple[str, float], Released] = {}

    # --- setup ----------------------------------------------------------------------------------
    def _calibrate(self, model: LanguageModel) -> Any:
        """B on training texts (never test), when a Cape mechanism uses the device model's logits."""
        if not any(m.needs_logit_bound for m in self.mechanisms.values()):
            return None
        from privlm.cape import Cape

        return Cape(model, epsilon=1.0).calibrate(self.texts["train"][: self.setting.calibration_texts])

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """MiniLM sentence embeddings; a blank text (a release of only whitespace tokens) embeds as the empty one."""
        out = np.empty((len(texts), self.encoder.hidden_size), dtype=np.float32)
        filled = [i for i, t in enumerate(texts) if t.strip()]
        blank = [i for i, t in enumerate(texts) if not t.strip()]
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*exceed max_length.*")  # counted in encoder_truncated
            if filled:
                out[filled] = self.encoder.encode_texts([texts[i] for i in filled]).numpy()
        if blank:
            ids = torch.tensor([self.encoder.require_tokenizer()("")["input_ids"]], device=self.encoder.device)
            with torch.inference_mode():
                empty = self.encoder.encode(self.encoder.embed_tokens(ids), torch.ones_like(ids)).float().cpu()
            out[blank] = empty.numpy()
        return out

    def _mti_indices(self) -> list[int]:
        fits = [i for i, p in enumerate(self.prompts)
                if len(p) <= self.setting.mti_max_tokens and p.sensitive_positions]
        return fits[: self.setting.mti_sentences]

    def _nw_sites(self) -> list[tuple[int, int]]:
        """(test text, position) of ``nw_tokens`` sensitive tokens, drawn by the seed."""
        pool = [(i, j) for i, p in enumerate(self.prompts[:NW_POOL_TEXTS]) for j in p.sensitive_positions]
        order = torch.randperm(len(pool), generator=make_generator(self.setting.seed)).tolist()
        return sorted(pool[k] for k in order[: self.setting.nw_tokens])

    def generator(self, *stream: object) -> torch.Generator:
        """One generator per named stream, derived from the run's seed."""
        key = "/".join(str(part) for part in stream)
        return make_generator(zlib.crc32(key.encode()) ^ self.setting.seed, device=self.lm.device)

    # --- the points -----------------------------------------------------------------------------
    def methods(self) -> list[Method]:
        return [method_of(m) for m in self.mechanisms.values()]

    def extra_points(self) -> list[Point]:
        """The non-private reference and Cape with the int8 device model."""
        points = [Point(NON_PRIVATE.key, math.inf, self.setting.task)]
        if self.int8_context is not None:
            points += [Point(CAPE_INT8.key, eps, self.setting.task) for eps in self.setting.int8_epsilons]
        return points

    def evaluate(self, point: Point) -> dict[str, float]:
        if math.isinf(point.level):
            return self._reference()
        released = self.release(point.method, point.level)
        return self.score(released) | {"perturb_seconds": released.seconds}

    def release(self, method: str, epsilon: float) -> Released:
        """The perturbed test texts of ``method`` at ``epsilon`` (Cape groups: computed for every epsilon at once)."""
        key = (method, epsilon)
        if key not in self._released:
            if method == CAPE_INT8.key:
                self._released |= self._cape_group([(method, text_mechanisms(["cape"])[0])],
                                                   self.setting.int8_epsilons, self.int8_context)
            elif self._prepares(self.mechanisms[method]):
                group = [(k, m) for k, m in self.mechanisms.items()
                         if self._prepares(m) and _same_utility(m, self.mechanisms[method])]
                self._released |= self._cape_group(group, self.setting.epsilons, self.context)
            else:
                return self._release_baseline(self.mechanisms[method], epsilon)
        return self._released.pop(key)

    def _prepares(self, mechanism: TextMechanism) -> bool:
        """A Cape whose utility rows are prepared once for every epsilon (cape-public draws as it decodes). Only
        Cape's family is built to tell (a Cape is cheap to build; a baseline's setup is not)."""
        return mechanism.family == "cape" and isinstance(mechanism.build(self.context, epsilon=1.0), Cape)

    def _release_baseline(self, mechanism: TextMechanism, epsilon: float) -> Released:
        perturber = mechanism.build(self.context, epsilon=epsilon, generator=self.generator(mechanism.key, epsilon))
        started = time.perf_counter()  # setup is timed on its own (speed.json)
        prompts = perturber.perturb_batch(self.texts["test"])
        seconds = time.perf_counter() - started
        nw_generator = self.generator(mechanism.key, epsilon, "nw")
        if isinstance(perturber, PublicContextCape):  # its law at a position depends on the released prefix
            nw = [_distinct(_public_draws(perturber, self.texts["test"][i], prompts[i], j, nw_generator))
                  for i, j in self.nw_sites]
        else:
            sampler = _position_sampler(perturber)
            nw = [_distinct(sampler(torch.tensor([self.prompts[i].ids[j]]), nw_generator)) for i, j in self.nw_sites]
        return Released(prompts, nw, seconds)

    def _cape_group(self, group: Sequence[tuple[str, TextMechanism]], epsilons: Sequence[float],
                    context: MechanismContext | None) -> dict[tuple[str, float], Released]:
        """Prepare each test text once, release it for every (variant, epsilon) of the group."""
        if context is None:
            raise ValueError("Cape with the int8 device model needs the CPU")
        capes = {key: m.build(context, epsilon=epsilons[0], generator=None) for key, m in group}
        preparer = next(iter(capes.values()))
        out = {(key, eps): Released([], [], 0.0) for key in capes for eps in epsilons}
        generators = {(key, eps): self.generator(key, eps) for key in capes for eps in epsilons}
        nw_generators = {(key, eps): self.generator(key, eps, "nw") for key in capes for eps in epsilons}
        texts, chunk, shared = self.texts["test"], self.setting.prepare_chunk, 0.0
        for start in range(0, len(texts), chunk):
            t0 = time.perf_counter()
            prepared = preparer.prepare(texts[start:start + chunk])  # type: ignore[attr-defined]
            shared += time.perf_counter() - t0
            sites = [(i - start, j) for i, j in self.nw_sites if start <= i < start + chunk]
            for (key, eps), released in out.items():
                cape: Any = capes[key]
                t0 = time.perf_counter()
                released.prompts += cape.release(prepared, epsilon=eps, generator=generators[(key, eps)])
                released.seconds += time.perf_counter() - t0
                mechanism = cape.mechanism(eps)
                for i, j in sites:
                    row = prepared[i].utilities[prepared[i].positions.index(j)][None]
                    released.nw.append(_distinct(mechanism.sample(row, num_samples=NW_SAMPLES,
                                                                  generator=nw_generators[(key, eps)])))
        for released in out.values():
            released.seconds += shared / len(out)
        return out

    # --- scores ---------------------------------------------------------------------------------
    def score(self, released: Released) -> dict[str, float]:
        texts = [p.text for p in released.prompts]
        return (self._utility(texts) | self._privacy(TokenView.of(released.prompts))
                | _nw_summary(released.nw) | _accounting(released.prompts))

    def _utility(self, texts: Sequence[str], *, zero_shot: float | None = None) -> dict[str, float]:
        s, y = self.setting, self.labels["test"]
        embeddings = self.embed(texts)
        scores = classification_metrics(y, self.classifier.predict_proba(embeddings))
        n_zero_shot = min(s.zero_shot_texts, len(y))
        if zero_shot is None:
            zero_shot = (zero_shot_auc(self.zero_shot.scores(list(texts[:n_zero_shot])), y[:n_zero_shot])
                         if n_zero_shot else math.nan)
        rouge = [rouge_l_f1(a.split(), b.split()) for a, b in zip(self.texts["test"], texts, strict=True)]
        truncated = len(self.encoder.tokens([t for t in texts if t.strip()] or ["."]).longer_than(
            self.encoder.max_length))
        return {"classifier_auc": scores["auc"], "classifier_accuracy": scores["accuracy"],
                "zero_shot_auc": zero_shot, "zero_shot_clean_auc": self.zero_shot_clean,
                "rouge_l": float(np.mean(rouge)),
                "cosine": embedding_agreement(self.clean["test"], embeddings)["cosine"],
                "n_positive": float((y == 1).sum()), "n_negative": float((y == 0).sum()),
                "zero_shot_n_positive": float((y[:n_zero_shot] == 1).sum()),
                "zero_shot_n_negative": float((y[:n_zero_shot] == 0).sum()),
                "blank_releases": float(sum(not t.strip() for t in texts)), "encoder_truncated": float(truncated)}

    def _privacy(self, view: TokenView) -> dict[str, float]:
        sensitive = [[not flag for flag in p.non_sensitive] for p in self.prompts]
        if [len(r) for r in view.original] != [len(p) for p in self.prompts]:
            raise ValueError("a mechanism's report does not hold one record per token of the prompt")
        knn = self.knn.attack(*view.flat(view.through))
        knn_sensitive = self.knn.attack(*view.flat(sensitive))
        released, original = view.flat(view.through)
        every = [[True] * len(r) for r in view.original]
        all_released, all_original = view.flat(every)
        return {"knn_success": knn.rate, "knn_ci_low": knn.ci_low, "knn_ci_high": knn.ci_high,
                "knn_trials": float(knn.trials), "knn_success_sensitive": knn_sensitive.rate,
                "retention": float((released == original).float().mean()),
                "unchanged_share": float((all_released == all_original).float().mean()),
                "mechanism_share": released.numel() / all_released.numel()} | self._mti(view)

    def _mti(self, view: TokenView) -> dict[str, float]:
        chosen = [i for i in self.mti_indices if any(view.through[i])]
        if not chosen:
            return {"mti_success": math.nan, "mti_rouge_l": math.nan, "mti_trials": 0.0}
        result = masked_token_inference([view.original[i] for i in chosen], [view.released[i] for i in chosen],
                                        self.lm.model, self.lm.tokenizer,
                                        attack_mask=[view.through[i] for i in chosen], seed=self.setting.seed,
                                        config=MaskedTokenConfig(method="causal-lm-stand-in",
                                                                 top_k=self.setting.mti_top_k))
        return {"mti_success": result.rate, "mti_rouge_l": float(result.details["rouge_l_f1"]),
                "mti_trials": float(result.trials)}

    def _reference(self) -> dict[str, float]:
        """The clean test texts, scored like a release: utility ceilings and the attacks' upper ends."""
        view = TokenView(original=[list(p.ids) for p in self.prompts], released=[list(p.ids) for p in self.prompts],
                         through=[[not flag for flag in p.non_sensitive] for p in self.prompts])
        nw = [1] * len(self.nw_sites)
        return (self._utility(self.texts["test"], zero_shot=self.zero_shot_clean) | self._privacy(view)
                | _nw_summary(nw) | {"eps_paper_per_prompt": 0.0, "eps_privlm_per_prompt": 0.0, "perturb_seconds": 0.0})


def _same_utility(a: TextMechanism, b: TextMechanism) -> bool:
    """Two Cape variants whose utility rows are equal (they may differ in bucketing only)."""
    def utility_options(m: TextMechanism) -> dict[str, object]:
        return {k: v for k, v in m.options.items() if k != "n_buckets"}
    return a.family == b.family == "cape" and utility_options(a) == utility_options(b)


def _position_sampler(perturber: TextPerturber) -> Callable[[torch.Tensor, torch.Generator], torch.Tensor]:
    """A baseline's per-position mechanism: token ids (1,) -> (1000, 1) candidate indices."""
    mechanism = getattr(perturber, "mechanism", None)
    if mechanism is None or not hasattr(mechanism, "sample"):
        raise ValueError(f"{perturber.name} exposes no per-position mechanism (.mechanism.sample) for N_w")
    return lambda ids, generator: mechanism.sample(ids.to(perturber.vocabulary.device), num_samples=NW_SAMPLES,
                                                   generator=generator)


def _public_draws(perturber: PublicContextCape, text: str, released: PerturbedPrompt, position: int,
                  generator: torch.Generator) -> torch.Tensor:
    """NW_SAMPLES draws of cape-public at ``position`` given the prefix its release of ``text`` put before it."""
    positions, law = perturber.position_log_probabilities(text, [t.released_id for t in released.report.tokens])
    return torch.multinomial(law[positions.index(position)].exp(), NW_SAMPLES, replacement=True, generator=generator)


def _distinct(draws: torch.Tensor) -> int:
    return int(draws.reshape(-1).unique().numel())


def _nw_summary(nw: Sequence[int]) -> dict[str, float]:
    if not nw:
        return {"nw_median": math.nan, "nw_mean": math.nan, "nw_max": math.nan}
    return {"nw_median": float(statistics.median(nw)), "nw_mean": float(np.mean(nw)), "nw_max": float(max(nw))}


def _accounting(prompts: Sequence[PerturbedPrompt]) -> dict[str, float]:
    """Mean per-prompt totals under each accounting (units: the mechanism's; see its guarantee)."""
    return {f"eps_{name}_per_prompt": float(np.mean([p.report.accounting.get(name, math.nan) for p in prompts]))
            for name in ("paper", "privlm")}


def peak_rss_mb() -> float:
    """This process's peak resident memory so far (ru_maxrss; KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@dataclass
class CapeSweep(Sweep):
    """A sweep whose extra points (Cape with the int8 model) have methods outside the grid."""

    extra_methods: Sequence[Method] = field(default_factory=tuple)

    def labels(self) -> dict[str, str]:
        return super().labels() | {m.key: m.label for m in self.extra_methods}


def cape_sweep(setting: CapeSetting | None = None, *, bench: CapeBench | None = None) -> CapeSweep:
    """The sweep over ``setting`` (a prepared ``bench`` may be passed, e.g. to time it first)."""
    setting = setting or CapeSetting()
    state = bench or CapeBench(setting)

    def evaluate(point: Point) -> dict[str, float]:
        return state.evaluate(point) | {"peak_rss_mb": peak_rss_mb()}

    extra = [CAPE_INT8] if state.int8_context is not None else []
    return CapeSweep(
        name=NAME,
        description=(f"Cape, its ablations and token-level baselines on {setting.device_model}'s vocabulary and "
                     f"embeddings, on {setting.task} (train/validation/test by seed {setting.seed}; B calibrated on "
                     f"{setting.calibration_texts} training texts). Utility: MiniLM + logistic regression trained on "
                     "clean training texts (C chosen on validation) applied to the perturbed test texts; zero-shot "
                     f"AUC of the device model on {min(setting.zero_shot_texts, setting.n_test)} perturbed test "
                     "texts; Rouge-L (words) and MiniLM cosine to the original. Privacy: KNN top-10 on the "
                     f"released tokens, MTI (causal-LM stand-in) on {len(state.mti_indices)} sentences, retention, "
                     f"N_w over {NW_SAMPLES} draws of {len(state.nw_sites)} tokens. Levels are each mechanism's own "
                     "epsilon (Text2Text: eta), not one scale: compare at equal attack success."),
        methods=state.methods(), levels=list(setting.epsilons), tasks=[setting.task], evaluate=evaluate,
        level_name="epsilon", utility_metric=UTILITY_METRIC, attack_metric=ATTACK_METRIC,
        settings=setting.__dict__.copy() | {"mti_sentence_indices": state.mti_indices,
                                            "logit_bound": _bound_value(state.context),
                                            "logit_bound_int8": _bound_value(state.int8_context),
                                            "candidate_set_size": state.lm.vocabulary.size},
        references=state.extra_points(), extra_methods=extra,
    )


def _bound_value(context: MechanismContext | None) -> float | None:
    bound = None if context is None else context.logit_bound
    return None if bound is None else float(bound) if isinstance(bound, int | float) else float(bound.value)
