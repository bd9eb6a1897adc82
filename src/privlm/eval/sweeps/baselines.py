"""Sweep ``baselines``: TokEmbPriv and Text2Text on MiniLM over several etas.

Privacy: nearest-neighbour inversion of what the server receives (noisy token embeddings for
TokEmbPriv, released token ids for Text2Text), on the user-text positions of test sentences.
Utility: a probe trained on train embeddings, early-stopped on validation, scored on test.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from privlm.attacks import AttackResult, nearest_neighbour_inversion, token_id_inversion
from privlm.baselines import Text2Text, TokEmbPriv
from privlm.baselines.common import text_positions
from privlm.eval.bench import Point, Sweep
from privlm.eval.data import named_task, split_dataset
from privlm.eval.probes import embedding_agreement, evaluate_probe
from privlm.mechanisms import make_generator
from privlm.models import SplitModel

DEFAULT_ETAS = (10.0, 25.0, 50.0, 75.0, 100.0, 200.0, 500.0)


@dataclass
class Setting:
    model: str = "minilm"
    task: str = "tweets-binary"
    n_train: int = 2000
    n_validation: int = 500
    n_test: int = 1000
    attack_sentences: int = 300
    probe: str = "mlp"
    seed: int = 0
    device: str = "auto"


class BaselinesSweep:
    """State shared across points: the model, the splits and the clean embeddings."""

    def __init__(self, setting: Setting) -> None:
        self.setting = setting
        self.model = SplitModel.from_pretrained(setting.model, device=setting.device)
        data = named_task(setting.task)
        self.splits = split_dataset(data, seed=setting.seed).head(
            train=setting.n_train, validation=setting.n_validation, test=setting.n_test)
        self.clean = {name: self.model.encode_texts(self._texts(name)).numpy() for name in self._split_names}

    _split_names = ("train", "validation", "test")

    def _texts(self, split: str) -> list[str]:
        return list(getattr(self.splits, split).texts)

    def _labels(self, split: str) -> np.ndarray:
        return np.asarray(getattr(self.splits, split).labels)

    def _generator(self, point: Point) -> torch.Generator:
        """A seed per point, derived from the run's seed: reproducible, independent across points."""
        return make_generator(zlib.crc32(f"{point.method}/{point.level}".encode()) ^ self.setting.seed,
                              device=self.model.device)

    def evaluate(self, point: Point) -> dict[str, float]:
        if math.isinf(point.level):
            embeddings, attack = self.clean, self._attack_clean()
        else:
            mechanism = self._mechanism(point)
            embeddings = {name: mechanism.encode(self._texts(name)) for name in self._split_names}
            attack = self._attack(mechanism)
        probe = evaluate_probe(*[(embeddings[n], self._labels(n)) for n in self._split_names],
                               kind=self.setting.probe, seed=self.setting.seed)
        agreement = embedding_agreement(self.clean["test"], embeddings["test"])
        return {"attack_success": attack.rate, "attack_ci_low": attack.ci_low, "attack_ci_high": attack.ci_high,
                "attacked_tokens": attack.trials, "auc": probe.auc, "accuracy": probe.accuracy,
                "validation_auc": probe.validation_auc, "cosine_to_clean": agreement["cosine"],
                "mse_to_clean": agreement["mse"]}

    def _mechanism(self, point: Point) -> TokEmbPriv | Text2Text:
        generator = self._generator(point)
        if point.method == "TokEmbPriv":
            return TokEmbPriv(self.model, eta=point.level, generator=generator)
        if point.method == "Text2Text":
            return Text2Text(self.model, eta=point.level, generator=generator)
        raise ValueError(f"unknown method {point.method!r}")

    def _attack_texts(self) -> Sequence[str]:
        return self._texts("test")[: self.setting.attack_sentences]

    def _attack(self, mechanism: TokEmbPriv | Text2Text) -> AttackResult:
        texts = self._attack_texts()
        if isinstance(mechanism, TokEmbPriv):
            private = mechanism.privatize(texts)
            return nearest_neighbour_inversion(private.noisy, private.batch.input_ids, self.model.embedding_matrix,
                                               mask=text_positions(self.model, private.batch))
        released = mechanism.privatize(texts)
        return token_id_inversion(released.released_ids, released.batch.input_ids, self.model.embedding_matrix,
                                  mask=released.perturbed)

    def _attack_clean(self) -> AttackResult:
        batch = self.model.tokenize(self._attack_texts())
        with torch.inference_mode():
            clean = self.model.embed_tokens(batch.input_ids)
        return nearest_neighbour_inversion(clean, batch.input_ids, self.model.embedding_matrix,
                                           mask=text_positions(self.model, batch))


def baselines_sweep(setting: Setting | None = None, *, etas: Sequence[float] = DEFAULT_ETAS) -> Sweep:
    setting = setting or Setting()
    state = BaselinesSweep(setting)
    return Sweep(
        name="baselines",
        description=("TokEmbPriv (d_chi noise on token embeddings, no clip, no denoiser) and Text2Text "
                     f"(nearest-token replacement) on {setting.model}. Privacy: nearest-neighbour inversion of "
                     "what the server receives. Utility: test AUC of a probe trained on train embeddings and "
                     f"early-stopped on validation ({setting.probe}), task {setting.task}."),
        methods=["TokEmbPriv", "Text2Text"], levels=list(etas), tasks=[setting.task],
        evaluate=state.evaluate, references=[Point("non-private", math.inf, setting.task)],
        settings=setting.__dict__.copy(),
    )
