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
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from peft import get_peft_model
from rich.progress import Progress
from transformers import PreTrainedModel

from privlm.models.batching import pad_ids
from privlm.models.device import forked_rng, resolve_device
from privlm.models.loading import load_pretrained
from privlm.models.partition import make_head
from privlm.models.pooling import POOLERS, Pooling, choose_pooling
from privlm.sap.config import SapConfig
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


def fine_tune_centralised(model_name: str | Path, *, config: SapConfig, n_classes: int,
                          train_texts: Sequence[str], train_labels: Sequence[int] | np.ndarray,
                          validation_texts: Sequence[str], validation_labels: Sequence[int] | np.ndarray,
                          test_texts: Sequence[str] | None = None,
                          test_labels: Sequence[int] | np.ndarray | None = None,
                          device: str | torch.device = "auto", progress: bool = False) -> dict[str, Any]:
    """Train LoRA and the head on the unsplit model for ``config.epochs`` epochs; return a dict shaped like
    :meth:`privlm.sap.FitResult.to_dict` (epochs, best_epoch, steps, validation/test accuracy at the chosen epoch,
    wall_seconds, truncated). Only ``config``'s LoRA, optimiser, batch and length settings apply."""
    start = time.perf_counter()
    resolved = resolve_device(device)
    loaded = load_pretrained(model_name, device=resolved, causal_lm_head=False)
    pooling = choose_pooling(loaded.family, folder=loaded.sentence_transformer)
    tokenizer, pad_id = loaded.tokenizer, loaded.tokenizer.pad_token_id or 0
    head = make_head(loaded.model.config.hidden_size, n_classes, seed=config.seed).to(resolved)
    with forked_rng(config.seed, resolved):  # LoRA's init, seeded as the vendor's add_lora seeds it
        model = get_peft_model(_Classifier(loaded.model, pooling, head), config.lora.peft_config(train_head=True))
    model.eval()  # the frozen layers' dropout stays off, LoRA's is on per step: as at the SAP vendor
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=config.learning_rate)

    tokens = tokenize_texts(tokenizer, train_texts, config.max_length, what="train texts")
    train, cut_train = tokens.ids, tokens.truncated
    labels = check_labels(train_labels, n=len(train), n_classes=n_classes)
    check_every_class_present(labels, n_classes)
    held_out = {"validation": (validation_texts, validation_labels)}
    if test_texts is not None:
        held_out["test"] = (test_texts, test_labels if test_labels is not None else [])
    scored = {}
    truncated = {"train": cut_train}
    for name, (texts, split_labels) in held_out.items():
        held = tokenize_texts(tokenizer, texts, config.max_length, what=f"{name} texts")
        ids, truncated[name] = held.ids, held.truncated
        scored[name] = (ids, check_labels(split_labels, n=len(ids), n_classes=n_classes))

    @torch.no_grad()
    def accuracy(name: str) -> float:
        ids, truth = scored[name]
        predicted = torch.cat([model(*pad_ids(ids[i:i + 256], pad_id, resolved)).argmax(-1).cpu()
                               for i in range(0, len(ids), 256)])
        return float((predicted == truth).float().mean())

    order = np.random.default_rng(config.seed)
    epochs: list[dict[str, Any]] = []
    steps = 0
    with Progress(disable=not progress, transient=True) as bar:
        task = bar.add_task("centralised fine-tuning", total=config.epochs * -(-len(train) // config.batch_size))
        for epoch in range(1, config.epochs + 1):
            permutation, losses = order.permutation(len(train)), []
            for first in range(0, len(train), config.batch_size):
                batch = permutation[first:first + config.batch_size].tolist()
                inputs = pad_ids([train[i] for i in batch], pad_id, resolved)
                if config.lora.dropout > 0:
                    with lora_dropout(model, seed=dropout_seed(config.seed, steps), device=resolved):
                        logits = model(*inputs)
                else:
                    logits = model(*inputs)
                loss = torch.nn.functional.cross_entropy(logits, labels[batch].to(resolved))
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                losses.append(float(loss.detach()))
                steps += 1
                bar.advance(task)
            epochs.append({"epoch": epoch, "train_loss": float(np.mean(losses)),
                           "validation_accuracy": accuracy("validation"),
                           "test_accuracy": accuracy("test") if "test" in scored else None})
    best = max(epochs, key=lambda e: (e["validation_accuracy"], -e["epoch"]))
    return {"epochs": epochs, "best_epoch": best["epoch"], "steps": steps,
            "validation_accuracy": best["validation_accuracy"], "test_accuracy": best["test_accuracy"],
            "wall_seconds": time.perf_counter() - start, "truncated": truncated,
            "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad)}
