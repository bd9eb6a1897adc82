"""Tasks, datasets, deterministic splits, and the shared cleaning and accounting every loader uses.

Nothing is dropped silently: a loader's ``report`` names its source and counts every row that was
``skipped`` (unusable data) or ``filtered`` (by the options you chose), by reason, so that
``rows_read == kept + sum(skipped) + sum(filtered)``. All randomness is a local
``numpy.random.default_rng(seed)``; the global RNG is never touched.
"""

from __future__ import annotations

import logging
import math
import os
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from privlm.validation import check_choice, check_in_interval, check_positive_int

logger = logging.getLogger("privlm.data")

PathLike = str | os.PathLike[str]
_CONTROL = re.compile(r"[\x00-\x08\x0e-\x1f\x7f-\x9f\ufffd]")
_SPACE = re.compile(r"\s+")


@dataclass(frozen=True)
class Task:
    """What a dataset asks for. Label ids are indices into ``labels``; ``metric`` is the headline score."""

    name: str
    kind: Literal["single", "pair"]
    labels: tuple[str, ...]
    metric: str

    def __post_init__(self) -> None:
        check_choice("kind", self.kind, ("single", "pair"))
        object.__setattr__(self, "labels", tuple(self.labels))
        if len(self.labels) < 2 or len(set(self.labels)) != len(self.labels):
            raise ValueError(f"labels must be at least two distinct names, got {self.labels!r}")

    @property
    def n_classes(self) -> int:
        return len(self.labels)

    @property
    def is_pair(self) -> bool:
        return self.kind == "pair"

    @property
    def metrics(self) -> tuple[str, ...]:
        """Everything worth reporting: accuracy and AUC always, plus the headline metric."""
        return tuple(dict.fromkeys(("accuracy", default_metric(self.n_classes), self.metric)))


def default_metric(n_classes: int) -> str:
    """The headline metric of a task with ``n_classes`` labels: AUC for two, macro AUC for more."""
    return "auc" if n_classes == 2 else "macro_auc"


@dataclass
class TextDataset:
    """Texts (and second texts for pair tasks) with int64 label ids, plus a report of how they were made."""

    task: Task
    texts: list[str]
    labels: np.ndarray
    text_pairs: list[str] | None = None
    report: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.labels = np.asarray(self.labels, dtype=np.int64)
        if self.labels.ndim != 1 or len(self.labels) != len(self.texts):
            raise ValueError(f"labels must be 1-D with one id per text, got shape {self.labels.shape}")
        if len(self.labels) and (self.labels.min() < 0 or self.labels.max() >= self.task.n_classes):
            raise ValueError(f"labels must be ids in [0, {self.task.n_classes}) for task {self.task.name!r}")
        if self.task.is_pair != (self.text_pairs is not None):
            raise ValueError(f"text_pairs must be given exactly when the task is a pair task ({self.task.kind})")
        if self.text_pairs is not None and len(self.text_pairs) != len(self.texts):
            raise ValueError(f"text_pairs has {len(self.text_pairs)} entries for {len(self.texts)} texts")

    def __len__(self) -> int:
        return len(self.texts)

    def label_counts(self) -> dict[str, int]:
        """Examples per label name (every label of the task, zero included)."""
        counts = np.bincount(self.labels, minlength=self.task.n_classes)
        return {name: int(n) for name, n in zip(self.task.labels, counts, strict=True)}

    def subset(self, indices: Sequence[int] | np.ndarray) -> TextDataset:
        """The examples at ``indices`` (ids, in that order, or a boolean mask); the report is kept."""
        idx = np.asarray(indices)
        if idx.dtype == bool:  # a mask, not ids 0 and 1
            if idx.shape != (len(self),):
                raise ValueError(f"indices as a boolean mask must have shape ({len(self)},), got {idx.shape}")
            idx = np.flatnonzero(idx)
        idx = idx.astype(np.int64).reshape(-1)
        if len(idx) and (idx.min() < 0 or idx.max() >= len(self)):
            raise ValueError(f"indices must lie in [0, {len(self)}), got range [{idx.min()}, {idx.max()}]")
        positions = idx.tolist()
        pairs = None if self.text_pairs is None else [self.text_pairs[i] for i in positions]
        report = {**self.report, "parent_size": len(self), "subset_size": len(idx)}
        return TextDataset(self.task, [self.texts[i] for i in positions], self.labels[idx], pairs, report)


@dataclass
class Splits:
    """Disjoint train/validation/test parts of one dataset; ``indices`` point into the parent."""

    train: TextDataset
    validation: TextDataset
    test: TextDataset
    seed: int
    indices: dict[str, np.ndarray] = field(default_factory=dict)

    def head(self, *, train: int, validation: int, test: int) -> Splits:
        """The first n of each (already shuffled) split: caps compute, selects nothing."""
        def first(data: TextDataset, n: int) -> TextDataset:
            return data.subset(np.arange(min(n, len(data))))
        return Splits(train=first(self.train, train), validation=first(self.validation, validation),
                      test=first(self.test, test), seed=self.seed)


# ---------------------------------------------------------------- validation and sampling


def check_seed(seed: object) -> int:
    """``seed`` if it is an integer >= 0 (a loader's seed), else a ValueError naming it."""
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    return seed


def check_limit(limit: object) -> int | None:
    """``limit`` if it is None or an integer >= 1 (a loader's subsample size), else a ValueError naming it."""
    return None if limit is None else check_positive_int("limit", limit)


def _check_names(name: str, values: object, known: Sequence[str], *, minimum: int = 1) -> tuple[str, ...]:
    if isinstance(values, str) or not isinstance(values, Iterable):
        raise ValueError(f"{name} must be a sequence of names, got {values!r}")
    values = tuple(values)
    unknown = [v for v in values if v not in known]
    if unknown or len(set(values)) != len(values) or len(values) < minimum:
        raise ValueError(f"{name} must be at least {minimum} distinct names from {tuple(known)}, got {values!r}")
    return values


def _round(x: float) -> int:
    return math.floor(x + 0.5)


def _allocate(total: int, sizes: np.ndarray) -> np.ndarray:
    """Split ``total`` over classes in proportion to ``sizes`` (largest remainder, so it sums exactly)."""
    exact = total * sizes / sizes.sum()
    base = np.floor(exact).astype(np.int64)
    order = np.argsort(-(exact - base), kind="stable")
    base[order[: total - int(base.sum())]] += 1
    return base


def _stratified_sample(labels: np.ndarray, limit: int | None, rng: np.random.Generator) -> np.ndarray:
    """A seeded, shuffled index set; with a limit, each label keeps its share of the data."""
    if limit is None or limit >= len(labels):
        return rng.permutation(len(labels))
    _, inverse = np.unique(labels, return_inverse=True)
    quota = _allocate(limit, np.bincount(inverse))
    chosen = [rng.permutation(np.flatnonzero(inverse == c))[:q] for c, q in enumerate(quota)]
    return rng.permutation(np.concatenate(chosen))


def split_dataset(
    data: TextDataset, *, seed: int, validation: float = 0.1, test: float = 0.1, stratify: bool = True
) -> Splits:
    """Deterministic disjoint train/validation/test split covering every example exactly once.

    With ``stratify`` each label is split on its own (cumulative rounding of its count), so label
    proportions match across parts up to one example per label.
    """
    validation, test = (check_in_interval(name, value, 0, 1, high_open=True)
                        for name, value in (("validation", validation), ("test", test)))
    if validation + test >= 1:
        raise ValueError(f"validation + test must be < 1, got validation={validation}, test={test}")
    rng = np.random.default_rng(check_seed(seed))
    groups = [np.flatnonzero(data.labels == c) for c in np.unique(data.labels)] if stratify else [np.arange(len(data))]
    parts: dict[str, list[np.ndarray]] = {"train": [], "validation": [], "test": []}
    for group in groups:
        members = rng.permutation(group)
        n_test, n_held = _round(test * len(members)), _round((test + validation) * len(members))
        parts["test"].append(members[:n_test])
        parts["validation"].append(members[n_test:n_held])
        parts["train"].append(members[n_held:])
    indices = {k: rng.permutation(np.concatenate(v)).astype(np.int64) for k, v in parts.items()}
    return Splits(**{k: data.subset(v) for k, v in indices.items()}, seed=seed, indices=indices)


# ---------------------------------------------------------------- cleaning and reports


def _clean(text: str) -> str:
    """Drop control and U+FFFD replacement characters, collapse whitespace, strip."""
    return _SPACE.sub(" ", _CONTROL.sub("", text)).strip()


def finish_dataset(
    task: Task,
    rows: Sequence[tuple[str, str | None, int]],
    report: dict[str, Any],
    *,
    limit: int | None,
    seed: int,
    shuffle: bool = True,
) -> TextDataset:
    """A loader's dataset from its (text, text pair or None, label id) rows and :func:`new_report`: subsampled to
    ``limit`` (stratified by label, seeded) and shuffled, or kept in file order when not ``shuffle``; the report
    gets its totals and is logged."""
    labels = np.array([r[2] for r in rows], dtype=np.int64)
    order = _stratified_sample(labels, limit, np.random.default_rng(seed))
    if not shuffle:
        order = np.sort(order)
    report["filtered"]["limit"] = len(rows) - len(order)
    picked = [rows[i] for i in order.tolist()]
    pairs = [r[1] for r in picked] if task.is_pair else None
    data = TextDataset(task, [r[0] for r in picked], labels[order], pairs, report)
    skipped, filtered = (+report.pop(k) for k in ("skipped", "filtered"))  # +Counter drops zero counts
    report.update(kept=len(data), skipped=dict(skipped), filtered=dict(filtered), label_counts=data.label_counts())
    logger.info(
        "%s from %s: kept %d of %d rows; skipped %s; filtered %s",
        task.name, report["source"], len(data), report["rows_read"], report["skipped"], report["filtered"],
    )
    return data


def new_report(source: object, **extra: Any) -> dict[str, Any]:
    """A loader's empty report on ``source``: count ``rows_read`` and each ``skipped`` row (Counters by reason) into
    it, then pass it to :func:`finish_dataset`; ``extra`` are the loader's own facts."""
    return {"source": str(source), "rows_read": 0, "kept": 0, "skipped": Counter(), "filtered": Counter(), **extra}


def _dedupe(rows: Iterable[tuple[Any, ...]], report: dict[str, Any]) -> list[tuple[Any, ...]]:
    """Keep the first row of each exact text (row[0]); count the rest, and those whose label (row[1]) differed."""
    first: dict[str, tuple[Any, ...]] = {}
    report.setdefault("conflicting_duplicates", 0)
    for row in rows:
        if row[0] in first:
            report["skipped"]["duplicate text"] += 1
            report["conflicting_duplicates"] += first[row[0]][1] != row[1]
        else:
            first[row[0]] = row
    return list(first.values())
