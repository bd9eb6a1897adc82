"""A local language model with its head: Cape's device model (causal or masked), offline only.

``LanguageModel.from_pretrained("smollm2")`` loads the packaged SmolLM2-135M-Instruct (causal);
a local folder of a masked LM (BERT-like, with its MLM head) loads as ``kind="masked"``.
``weights_fingerprint`` hashes every parameter and buffer, so an artefact calibrated on one model
(Cape's logit bound) is refused by another.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Literal

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from privlm.models.device import resolve_device
from privlm.models.fingerprints import weights_sha256
from privlm.models.loading import materialise_gguf, model_family
from privlm.models.sources import resolve_source
from privlm.models.vocabulary import CandidateVocabulary
from privlm.validation import check_choice

LanguageModelKind = Literal["causal", "masked"]
LANGUAGE_MODEL_KINDS: tuple[LanguageModelKind, ...] = ("causal", "masked")


@dataclass(eq=False)
class LanguageModel:
    """A language model with its head, its tokenizer, and its candidate vocabulary."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    kind: LanguageModelKind
    name: str = "model"
    quantized: bool = False
    _vocabulary: CandidateVocabulary | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        check_choice("kind", self.kind, LANGUAGE_MODEL_KINDS)
        if self.kind == "masked" and self.tokenizer.mask_token_id is None:
            raise ValueError("a masked device model needs a tokenizer with a mask token; this one has none")
        self.model.eval()

    @classmethod
    def from_pretrained(cls, name_or_path: str | Path = "smollm2", *, device: str | torch.device = "auto",
                        kind: LanguageModelKind | Literal["auto"] = "auto") -> LanguageModel:
        """Load ``"smollm2"``, a local folder, or a HF id already in the local cache (never downloads)."""
        check_choice("kind", kind, ("auto", *LANGUAGE_MODEL_KINDS))
        source = resolve_source(name_or_path)
        path = materialise_gguf(source) if source.gguf_file else source.path
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        family = model_family(config)
        by_family: dict[str, LanguageModelKind] = {"decoder": "causal", "encoder": "masked"}
        wanted = kind if kind != "auto" else by_family.get(family)
        if wanted is None or (wanted, family) not in (("causal", "decoder"), ("masked", "encoder")):
            raise ValueError(f"{name_or_path!s} is a {config.model_type} model, which cannot be loaded as a "
                             f"{wanted or 'causal or masked'} language model")
        model_class = AutoModelForCausalLM if wanted == "causal" else AutoModelForMaskedLM
        model = model_class.from_pretrained(path, local_files_only=True, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        torch.nn.Module.to(model, resolve_device(device))
        return cls(model=model, tokenizer=tokenizer, kind=wanted, name=str(name_or_path))

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def context_length(self) -> int:
        """Tokens one forward pass may hold (position embeddings), at most the tokenizer's own limit."""
        config = self.model.config
        limit = next((v for k in ("max_position_embeddings", "n_positions")
                      if isinstance(v := getattr(config, k, None), int) and v > 0), 512)
        tokenizer_limit = getattr(self.tokenizer, "model_max_length", limit)
        return int(min(limit, tokenizer_limit)) if isinstance(tokenizer_limit, int) else limit

    @property
    def vocabulary(self) -> CandidateVocabulary:
        """The candidates: every id of the tokenizer but the special ones, with the input embedding rows."""
        if self._vocabulary is None:
            table = self.model.get_input_embeddings()
            if not isinstance(table, torch.nn.Embedding):
                raise ValueError(f"{type(self.model).__name__} has no word-embedding table")
            self._vocabulary = CandidateVocabulary.from_tokenizer(self.tokenizer, table.weight.detach())
        return self._vocabulary

    @cached_property
    def weights_fingerprint(self) -> str:
        """sha256 of every parameter and buffer (fp32 bytes, by name), the kind and the quantization."""
        return weights_sha256(self.model, salt=f"{self.kind}/{'int8' if self.quantized else 'fp32'}".encode())

    def quantize_int8(self) -> LanguageModel:
        """A copy whose linear layers use int8 dynamic quantization (CPU only): faster, slightly different logits.

        The embedding table, and so the candidate vocabulary and its distances, stays fp32.
        """
        if self.device.type != "cpu":
            raise ValueError(f"int8 dynamic quantization runs on the CPU only; this model is on {self.device}")
        import copy

        from torch.ao.quantization import quantize_dynamic

        quantized = quantize_dynamic(copy.deepcopy(self.model), {torch.nn.Linear}, dtype=torch.qint8)
        return LanguageModel(model=quantized, tokenizer=self.tokenizer, kind=self.kind, name=self.name,
                             quantized=True, _vocabulary=self.vocabulary)
