"""Sweep ``baselines``: TokEmbPriv and Text2Text on MiniLM over several etas.

Privacy: nearest-neighbour inversion of what the server receives (noisy token embeddings for
TokEmbPriv, released token ids for Text2Text), on the user-text positions of test sentences.
Utility: a probe trained on train embeddings, early-stopped on validation, scored on test.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from privlm.attacks import AttackResult, nearest_neighbour_inversion, token_id_inversion
from privlm.baselines import Text2Text, TokEmbPriv
from privlm.baselines.common import text_positions
from privlm_bench.harness.bench import NON_PRIVATE, Point, Sweep
from privlm_bench.harness.embedding import SPLITS, TEXT2TEXT, TOKEMBPRIV, EmbeddingSetting, EmbeddingSweep

DEFAULT_ETAS = (10.0, 25.0, 50.0, 75.0, 100.0, 200.0, 500.0)
METHODS = (TOKEMBPRIV, TEXT2TEXT)


class BaselinesSweep(EmbeddingSweep):
    def evaluate(self, point: Point) -> dict[str, float]:
        task = point.task
        if math.isinf(point.level):
            embeddings, attack = self.clean[task], self._attack_clean(task)
        else:
            mechanism = self._mechanism(point)
            embeddings = {split: mechanism.encode(self.texts(task, split)) for split in SPLITS}
            attack = self._attack(mechanism, task)
        return {"attack_success": attack.rate, "attack_ci_low": attack.ci_low, "attack_ci_high": attack.ci_high,
                "attacked_tokens": attack.trials} | self.utility(task, embeddings)

    def _mechanism(self, point: Point) -> TokEmbPriv | Text2Text:
        method = {m.key: m for m in METHODS}[point.method]
        generator = self.generator(method.stream, point.level)
        if method is TOKEMBPRIV:
            return TokEmbPriv(self.model, eta=point.level, generator=generator)
        return Text2Text(self.model, eta=point.level, generator=generator)

    def _attack(self, mechanism: TokEmbPriv | Text2Text, task: str) -> AttackResult:
        texts = self.attack_texts(task)
        if isinstance(mechanism, TokEmbPriv):
            private = mechanism.privatize(texts)
            return nearest_neighbour_inversion(private.noisy, private.batch.input_ids, self.model.embedding_matrix,
                                               mask=text_positions(self.model, private.batch))
        released = mechanism.privatize(texts)
        return token_id_inversion(released.released_ids, released.batch.input_ids, self.model.embedding_matrix,
                                  mask=released.perturbed)

    def _attack_clean(self, task: str) -> AttackResult:
        batch = self.model.tokenize(self.attack_texts(task))
        with torch.inference_mode():
            clean = self.model.embed_tokens(batch.input_ids)
        return nearest_neighbour_inversion(clean, batch.input_ids, self.model.embedding_matrix,
                                           mask=text_positions(self.model, batch))


def baselines_sweep(setting: EmbeddingSetting | None = None, *, etas: Sequence[float] = DEFAULT_ETAS) -> Sweep:
    setting = setting or EmbeddingSetting()
    state = BaselinesSweep(setting)
    return Sweep(
        name="baselines",
        description=("TokEmbPriv (d_chi noise on token embeddings, no clip, no denoiser) and Text2Text "
                     f"(nearest-token replacement) on {setting.model}. Privacy: nearest-neighbour inversion of "
                     "what the server receives. Utility: test AUC of a probe trained on train embeddings and "
                     f"early-stopped on validation ({setting.probe}), tasks {', '.join(setting.tasks)}."),
        methods=list(METHODS), levels=list(etas), tasks=list(setting.tasks), evaluate=state.evaluate,
        references=[Point(NON_PRIVATE.key, math.inf, task) for task in setting.tasks],
        settings=setting.__dict__.copy(),
    )
