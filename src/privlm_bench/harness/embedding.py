"""What every embedding sweep shares: the setting, the model, the splits and their clean embeddings,
one seeded generator per noise stream, and the utility metrics of a set of embeddings.

A new sweep subclasses :class:`EmbeddingSweep`, defines its methods and ``evaluate``, and registers
itself (:mod:`privlm_bench.harness.registry`) in its own file.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from privlm.mechanisms import make_generator
from privlm.models import SplitModel
from privlm_bench.data import Splits, named_task, split_dataset
from privlm_bench.harness.bench import Method
from privlm_bench.harness.probes import ProbeKind, embedding_agreement, evaluate_probe

SPLITS = ("train", "validation", "test")
# The embedding baselines: their own sweep (baselines) and SnD's (snd) run them.
TOKEMBPRIV = Method("tokembpriv", "TokEmbPriv")
TEXT2TEXT = Method("text2text", "Text2Text")


@dataclass(kw_only=True)
class EmbeddingSetting:
    """The settings every embedding sweep records in its ``results.json``."""

    model: str = "minilm"
    tasks: tuple[str, ...] = ("tweets-binary",)
    n_train: int = 2000
    n_validation: int = 500
    n_test: int = 1000
    attack_sentences: int = 300
    probe: ProbeKind = "mlp"
    seed: int = 0
    device: str = "auto"


class EmbeddingSweep:
    """State shared across the points of a sweep."""

    def __init__(self, setting: EmbeddingSetting) -> None:
        self.setting = setting
        self.model = SplitModel.from_pretrained(setting.model, device=setting.device)
        self.splits: dict[str, Splits] = {}
        self.clean: dict[str, dict[str, np.ndarray]] = {}
        for task in setting.tasks:
            self.splits[task] = split_dataset(named_task(task), seed=setting.seed).head(
                train=setting.n_train, validation=setting.n_validation, test=setting.n_test)
            self.clean[task] = {s: self.model.encode_texts(self.texts(task, s)).numpy() for s in SPLITS}

    def texts(self, task: str, split: str) -> list[str]:
        return list(getattr(self.splits[task], split).texts)

    def labels(self, task: str, split: str) -> np.ndarray:
        return np.asarray(getattr(self.splits[task], split).labels)

    def generator(self, *stream: object) -> torch.Generator:
        """A generator per named stream, derived from the run's seed: reproducible, independent across streams."""
        key = "/".join(str(part) for part in stream)
        return make_generator(zlib.crc32(key.encode()) ^ self.setting.seed, device=self.model.device)

    def utility(self, task: str, embeddings: Mapping[str, np.ndarray]) -> dict[str, float]:
        """Probe trained on train, early-stopped on validation, scored once on test; agreement with the clean test."""
        probe = evaluate_probe(*[(embeddings[s], self.labels(task, s)) for s in SPLITS], kind=self.setting.probe,
                               seed=self.setting.seed)
        agreement = embedding_agreement(self.clean[task]["test"], embeddings["test"])
        return {"auc": probe.auc, "accuracy": probe.accuracy, "validation_auc": probe.validation_auc,
                "cosine_to_clean": agreement["cosine"], "mse_to_clean": agreement["mse"]}

    def attack_texts(self, task: str) -> Sequence[str]:
        return self.texts(task, "test")[: self.setting.attack_sentences]
