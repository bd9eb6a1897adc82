"""Centralised LoRA fine-tuning: the ceiling SAP is measured against (no split, no noise, no transport).

The data owner holds the whole model and trains it as SAP's two parties do together: the same LoRA settings
(``config.lora``, through peft), the same linear head (initialised from ``config.seed``, trained in full), the same
optimiser (AdamW at ``config.learning_rate``), the same batch order (``numpy.random.default_rng(config.seed)``, one
permutation per epoch), the same tokenization (cut to ``config.max_length``) and the same epoch choice (best
validation accuracy, first of ties; test is only scored). Nothing is privatized, so the split without noise
(``SapConfig(blocks=0, eta=None)``) should land on (nearly) the same accuracy: a check of the protocol.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from peft import PeftModel, get_peft_model
from rich.progress import Progress
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from privlm.models.batching import pad_ids
from privlm.models.device import forked_rng, resolve_device
from privlm.models.loading import load_pretrained
from privlm.models.partition import make_head
from privlm.models.pooling import POOLERS, Pooling, choose_pooling
from privlm.sap.config import FitOptions, SapConfig
from privlm.sap.customer import check_every_class_present, check_labels, tokenize_texts
from privlm.sap.model import dropout_seed, lora_dropout


class _Classifier(torch.nn.Module):
    """The whole encoder, its pooling and a linear head: token ids -> logits."""

    def __init__(self, encoder: PreTrainedModel, pooling: Pooling, head: torch.nn.Linear) -> None:
        super().__init__()
        self.encoder = encoder
        self.pooling = pooling
        self.head = head

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return self.head(POOLERS[self.pooling](hidden, attention_mask))


@dataclass
class CentralisedModel:
    """The data owner's whole model with LoRA (``config.lora``) and a linear head (seeded by ``config.seed``), as
    :func:`fine_tune_centralised` trains it. ``load_seconds``: how long loading took (counted in the run's
    ``wall_seconds``, as it always was)."""

    model: PeftModel
    tokenizer: PreTrainedTokenizerBase
    config: SapConfig
    n_classes: int
    device: torch.device
    load_seconds: float

    @classmethod
    def load(cls, model_name: str | Path, *, config: SapConfig, n_classes: int,
             device: str | torch.device = "auto") -> CentralisedModel:
        """Load a packaged or local model offline, with its own pooling, and add the head and LoRA."""
        start = time.perf_counter()
        resolved = resolve_device(device)
        loaded = load_pretrained(model_name, device=resolved, causal_lm_head=False)
        pooling = choose_pooling(loaded.family, folder=loaded.sentence_transformer)
        head = make_head(loaded.model.config.hidden_size, n_classes, seed=config.seed).to(resolved)
        with forked_rng(config.seed, resolved):  # LoRA's init, seeded as the vendor's add_lora seeds it
            model = get_peft_model(_Classifier(loaded.model, pooling, head), config.lora.peft_config(train_head=True))
        model.eval()  # the frozen layers' dropout stays off, LoRA's is on per step: as at the SAP vendor
        return cls(model=model, tokenizer=loaded.tokenizer, config=config, n_classes=n_classes, device=resolved,
                   load_seconds=time.perf_counter() - start)

    @property
    def pad_id(self) -> int:
        return self.tokenizer.pad_token_id or 0

    def tokenize(self, texts: Sequence[str], labels: Sequence[int] | np.ndarray, *,
                 what: str) -> tuple[list[list[int]], torch.Tensor, int]:
        """Token ids cut to ``config.max_length``, the labels checked, and how many texts were cut."""
        tokens = tokenize_texts(self.tokenizer, texts, self.config.max_length, what=f"{what} texts")
        checked = check_labels(labels, n=len(tokens.ids), n_classes=self.n_classes)
        return tokens.ids, checked, tokens.truncated

    @torch.no_grad()
    def accuracy(self, ids: list[list[int]], truth: torch.Tensor) -> float:
        predicted = torch.cat([self.model(*pad_ids(ids[i:i + 256], self.pad_id, self.device)).argmax(-1).cpu()
                               for i in range(0, len(ids), 256)])
        return float((predicted == truth).float().mean())

    def step(self, inputs: tuple[torch.Tensor, torch.Tensor], labels: torch.Tensor, *, step: int,
             optimizer: torch.optim.Optimizer) -> float:
        """One optimiser step on a batch; its loss. LoRA's dropout, if any, draws its masks from ``step``."""
        if self.config.lora.dropout > 0:
            with lora_dropout(self.model, seed=dropout_seed(self.config.seed, step), device=self.device):
                logits = self.model(*inputs)
        else:
            logits = self.model(*inputs)
        loss = torch.nn.functional.cross_entropy(logits, labels.to(self.device))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        return float(loss.detach())


def fine_tune_centralised(model: CentralisedModel, train_texts: Sequence[str],
                          train_labels: Sequence[int] | np.ndarray, validation_texts: Sequence[str],
                          validation_labels: Sequence[int] | np.ndarray, *,
                          options: FitOptions | None = None) -> dict[str, Any]:
    """Train LoRA and the head of ``model`` (:meth:`CentralisedModel.load`) for ``config.epochs`` epochs; return a
    dict shaped like :meth:`privlm.sap.FitResult.to_dict` (epochs, best_epoch, steps, validation/test accuracy at
    the chosen epoch, wall_seconds, truncated). Only ``config``'s LoRA, optimiser, batch and length settings apply;
    ``options.patience`` does not (every epoch is trained)."""
    options = options or FitOptions()
    if options.patience is not None:
        raise ValueError("the centralised run trains every epoch: it takes no patience")
    start, config = time.perf_counter(), model.config
    train, labels, cut_train = model.tokenize(train_texts, train_labels, what="train")
    check_every_class_present(labels, model.n_classes)
    scored, truncated = _held_out(model, validation_texts, validation_labels, options)
    truncated = {"train": cut_train} | truncated
    optimizer = torch.optim.AdamW([p for p in model.model.parameters() if p.requires_grad], lr=config.learning_rate)
    order = np.random.default_rng(config.seed)
    epochs: list[dict[str, Any]] = []
    steps = 0
    with Progress(disable=not options.progress, transient=True) as bar:
        task = bar.add_task("centralised fine-tuning", total=config.epochs * -(-len(train) // config.batch_size))
        for epoch in range(1, config.epochs + 1):
            losses = _train_epoch(model, train, labels, order.permutation(len(train)), optimizer=optimizer,
                                  first_step=steps, advance=lambda: bar.advance(task))
            steps += len(losses)
            epochs.append({"epoch": epoch, "train_loss": float(np.mean(losses)),
                           "validation_accuracy": model.accuracy(*scored["validation"]),
                           "test_accuracy": model.accuracy(*scored["test"]) if "test" in scored else None})
    best = max(epochs, key=lambda e: (e["validation_accuracy"], -e["epoch"]))
    return {"epochs": epochs, "best_epoch": best["epoch"], "steps": steps,
            "validation_accuracy": best["validation_accuracy"], "test_accuracy": best["test_accuracy"],
            "wall_seconds": model.load_seconds + time.perf_counter() - start, "truncated": truncated,
            "trainable_parameters": sum(p.numel() for p in model.model.parameters() if p.requires_grad)}


def _held_out(model: CentralisedModel, validation_texts: Sequence[str],
              validation_labels: Sequence[int] | np.ndarray, options: FitOptions
              ) -> tuple[dict[str, tuple[list[list[int]], torch.Tensor]], dict[str, int]]:
    """The validation set and, when given, the test set: token ids and labels by name, and how many texts were cut."""
    held_out = {"validation": (validation_texts, validation_labels)}
    if options.test_texts is not None:
        held_out["test"] = (options.test_texts, options.test_labels if options.test_labels is not None else [])
    scored, truncated = {}, {}
    for name, (texts, labels) in held_out.items():
        ids, truth, truncated[name] = model.tokenize(texts, labels, what=name)
        scored[name] = (ids, truth)
    return scored, truncated


def _train_epoch(model: CentralisedModel, train: list[list[int]], labels: torch.Tensor, permutation: np.ndarray, *,
                 optimizer: torch.optim.Optimizer, first_step: int, advance: Callable[[], object]) -> list[float]:
    """One pass over ``train`` in the order of ``permutation``, a batch per step (steps counted from
    ``first_step``); the batches' losses."""
    losses: list[float] = []
    batch_size = model.config.batch_size
    for first in range(0, len(train), batch_size):
        batch = permutation[first:first + batch_size].tolist()
        inputs = pad_ids([train[i] for i in batch], model.pad_id, model.device)
        losses.append(model.step(inputs, labels[batch], step=first_step + len(losses), optimizer=optimizer))
        advance()
    return losses
