"""The SAP model: the vendor's model cut into the customer's bottom and the vendor's top, with LoRA on the top."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from peft import PeftModel, get_peft_model
from transformers import PreTrainedTokenizerBase

from privlm.models.device import resolve_device
from privlm.models.loading import load_pretrained
from privlm.models.partition import BottomModel, TopModel, split_model
from privlm.sap.config import LoraSettings, SapConfig


@dataclass
class SplitParts:
    """What the vendor makes from its model: the bottom (to export), the top (to keep) and the tokenizer."""

    bottom: BottomModel
    top: TopModel
    tokenizer: PreTrainedTokenizerBase


def split_pretrained(name_or_path: str | Path = "minilm", *, config: SapConfig, n_classes: int,
                     device: str | torch.device = "cpu") -> SplitParts:
    """Load a packaged or local model offline and cut it for ``config``: the head goes to the top when it sits at
    the vendor. The model's own pooling is used (mean for sentence-transformers models such as MiniLM)."""
    resolved = resolve_device(device)
    loaded = load_pretrained(name_or_path, device=resolved, causal_lm_head=False)
    pooling = loaded.sentence_transformer.pooling if loaded.sentence_transformer else None
    bottom, top = split_model(loaded.model, config.blocks, pooling=pooling,
                              n_classes=n_classes if config.head == "vendor" else None, head_seed=config.seed,
                              name=str(name_or_path))
    return SplitParts(bottom=bottom, top=top, tokenizer=loaded.tokenizer)


def add_lora(top: TopModel, settings: LoraSettings, *, seed: int = 0) -> PeftModel:
    """Wrap ``top`` with LoRA adapters (peft); LoRA's random init is drawn under a forked, seeded RNG, so the
    global RNG is neither used nor moved."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return get_peft_model(top, settings.peft_config(train_head=top.head is not None))


