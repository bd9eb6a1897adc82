"""The SAP model: the vendor's model cut into the customer's bottom and the vendor's top, with LoRA on the top."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from peft import PeftModel, get_peft_model
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from privlm.models.device import forked_rng, resolve_device
from privlm.models.loading import load_pretrained
from privlm.models.partition import BottomModel, TopModel, split_model
from privlm.models.pooling import Pooling, choose_pooling
from privlm.sap.config import LoraSettings, SapConfig


@dataclass
class SplitParts:
    """What the vendor makes from its model: the bottom (to export), the top (to keep) and the tokenizer."""

    bottom: BottomModel
    top: TopModel
    tokenizer: PreTrainedTokenizerBase


def split_pretrained(name_or_path: str | Path = "minilm", *, config: SapConfig, n_classes: int,
                     device: str | torch.device = "auto") -> SplitParts:
    """Load a packaged or local model offline and cut it for ``config``: the head goes to the top when it sits at
    the vendor. The model's own pooling is used (mean for sentence-transformers models such as MiniLM)."""
    resolved = resolve_device(device)
    loaded = load_pretrained(name_or_path, device=resolved, causal_lm_head=False)
    pooling = choose_pooling(loaded.family, folder=loaded.sentence_transformer)
    bottom, top = split_model(loaded.model, config.blocks, pooling=pooling,
                              n_classes=n_classes if config.head == "vendor" else None, head_seed=config.seed,
                              name=str(name_or_path))
    return SplitParts(bottom=bottom, top=top, tokenizer=loaded.tokenizer)


@dataclass
class VendorModel:
    """What the vendor's server serves: its model, loaded once, and the bottoms it exports (split position -> the
    bottom with that many blocks). ``name`` is the name it was loaded by (shown without its folder)."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    pooling: Pooling
    bottoms: dict[int, BottomModel]
    name: str

    @classmethod
    def load(cls, name_or_path: str | Path = "minilm", *, splits: Sequence[int] = (0,),
             device: str | torch.device = "auto") -> VendorModel:
        """Load a packaged or local model offline and cut a bottom at each of ``splits`` (at least one)."""
        if not splits:
            raise ValueError("splits must name at least one split position")
        loaded = load_pretrained(name_or_path, device=resolve_device(device), causal_lm_head=False)
        pooling = choose_pooling(loaded.family, folder=loaded.sentence_transformer)
        bottoms = {blocks: split_model(loaded.model, blocks, pooling=pooling, name=str(name_or_path))[0]
                   for blocks in splits}
        return cls(model=loaded.model, tokenizer=loaded.tokenizer, pooling=pooling, bottoms=bottoms,
                   name=str(name_or_path))


def add_lora(top: TopModel, settings: LoraSettings, *, seed: int = 0) -> PeftModel:
    """Wrap ``top`` with LoRA adapters (peft); LoRA's random init is drawn under a forked, seeded RNG, so the
    global RNG is neither used nor moved."""
    with forked_rng(seed, next(top.parameters()).device):
        return get_peft_model(top, settings.peft_config(train_head=top.head is not None))


@contextmanager
def lora_dropout(model: torch.nn.Module, *, seed: int, device: torch.device) -> Iterator[None]:
    """Switch LoRA's dropout on for one training forward pass, drawing its masks from ``seed`` (the model stays in
    eval mode otherwise: the frozen layers' own dropout stays off). The masks live in the autograd graph, so the
    backward pass needs no RNG."""
    dropouts = [m for name, m in model.named_modules() if name.rsplit(".", 1)[-1] == "lora_dropout"]
    for module in dropouts:
        module.train()
    try:
        with forked_rng(seed, device):
            yield
    finally:
        for module in dropouts:
            module.eval()


def dropout_seed(seed: int, step: int) -> int:
    """The seed of LoRA's dropout masks at ``step``: a step replayed (a retry) draws the same masks."""
    return int(np.random.SeedSequence([seed, step]).generate_state(1, dtype=np.uint64)[0] >> 1)


