"""A Hugging Face model seen as two halves.

Client side: ``embed_tokens(input_ids) -> X``, word-embedding rows only.
Server side: ``encode(X, attention_mask) -> pooled``, which feeds X as ``inputs_embeds`` (the
model adds position/type embeddings itself) and applies the family's pooling.
"""

from __future__ import annotations

import hashlib
import json
import logging
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from privlm._validation import check_choice, check_float_tensor
from privlm.models.batching import map_in_length_order
from privlm.models.device import resolve_device
from privlm.models.loading import FAMILY_POOLING, load_pretrained, model_family
from privlm.models.pooling import POOLERS, POOLINGS

log = logging.getLogger(__name__)
TRUNCATION_POLICIES = ("warn", "error", "count")  # "count": the caller reports truncation itself
_DEFAULT_MAX_LENGTH = 512


@dataclass
class TokenBatch:
    """Token ids and mask on the model's device, with which texts were cut to ``max_length``."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    truncated: list[bool]

    @property
    def n_truncated(self) -> int:
        return sum(self.truncated)


def check_texts(texts: object) -> None:
    """A non-empty list of non-blank strings, or a ValueError that names the bad item."""
    if isinstance(texts, str) or not isinstance(texts, Sequence) or len(texts) == 0:
        raise ValueError("texts must be a non-empty list of strings")
    for i, text in enumerate(texts):
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"texts[{i}] is empty or not a string: {text!r}")


class SplitModel:
    """A model split into a client half (token embeddings) and a server half (the rest + pooling)."""

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase | None = None,
        *,
        pooling: str = "auto",
        normalize: bool = False,
        max_length: int | None = None,
        device: str | torch.device = "auto",
        name: str | None = None,
    ) -> None:
        self.family = model_family(model.config)
        check_choice("pooling", pooling, ("auto", *POOLINGS))
        self.pooling = FAMILY_POOLING[self.family] if pooling == "auto" else pooling
        self.normalize = normalize
        self.device = resolve_device(device)
        self.model = model.to(self.device).eval()
        self.backbone = model.base_model  # the transformer without task heads
        self.tokenizer = tokenizer
        if tokenizer is not None and tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token  # GPT-2 style tokenizers have no pad token
        self.max_length = max_length or self._model_max_length()
        self.name = name or model.config.name_or_path or model.config.model_type

    @classmethod
    def from_pretrained(cls, name_or_path: str | Path = "minilm", *, device: str | torch.device = "auto",
                        pooling: str = "auto", dtype: torch.dtype = torch.float32) -> SplitModel:
        """Load ``"minilm"``, ``"smollm2"``, a local folder, or a HF id already in the local cache.

        A sentence-transformers folder brings its own pooling, normalisation and max length.
        """
        resolved = resolve_device(device)
        loaded = load_pretrained(name_or_path, device=resolved, dtype=dtype)
        st = loaded.sentence_transformer
        if pooling == "auto" and st is not None:
            pooling = st.pooling
        return cls(loaded.model, loaded.tokenizer, pooling=pooling, normalize=bool(st and st.normalize),
                   max_length=st.max_seq_length if st else None, device=resolved, name=str(name_or_path))

    # --- the vocabulary -------------------------------------------------------------------
    @property
    def embedding_matrix(self) -> torch.Tensor:
        """The (|V|, d) word-embedding matrix, detached."""
        return self.model.get_input_embeddings().weight.detach()

    @property
    def hidden_size(self) -> int:
        return self.embedding_matrix.shape[1]

    @property
    def vocab_size(self) -> int:
        return self.embedding_matrix.shape[0]

    @cached_property
    def max_embedding_norm(self) -> float:
        """max_v ||E_v||_2, the SnD clipping bound C, computed from the matrix."""
        return self.embedding_matrix.float().norm(dim=-1).max().item()

    @cached_property
    def fingerprint(self) -> str:
        """sha256 of the embedding matrix and the config: identifies the base model exactly."""
        digest = hashlib.sha256()
        digest.update(self.embedding_matrix.float().cpu().contiguous().numpy().tobytes())
        config = self.model.config.to_dict()
        config.pop("_name_or_path", None)
        config.pop("transformers_version", None)
        digest.update(json.dumps(config, sort_keys=True, default=str).encode())
        return digest.hexdigest()

    # --- client side ------------------------------------------------------------------------
    def tokenize(self, texts: Sequence[str], *, truncation: str = "warn", max_length: int | None = None
                 ) -> TokenBatch:
        """Tokenize a batch (right padding). Texts over ``max_length`` (default: the model's) are cut
        and counted with a warning, or refused with ``truncation="error"``."""
        max_length = min(max_length or self.max_length, self.max_length)
        if self.tokenizer is None:
            raise ValueError("this SplitModel has no tokenizer; pass input_ids directly")
        check_choice("truncation", truncation, TRUNCATION_POLICIES)
        check_texts(texts)
        full_lengths = self.token_counts(texts)
        truncated = [n > max_length for n in full_lengths]
        if any(truncated):
            worst = max(full_lengths)
            message = (f"{sum(truncated)} of {len(texts)} texts exceed max_length={max_length} tokens "
                       f"(longest: {worst}); they were truncated")
            if truncation == "error":
                raise ValueError(message.replace("they were truncated", "pass truncation='warn' to cut them"))
            if truncation == "warn":
                warnings.warn(message, stacklevel=2)
        batch = self.tokenizer(list(texts), padding=True, truncation=True, max_length=max_length,
                               return_tensors="pt", padding_side="right")
        return TokenBatch(input_ids=batch["input_ids"].to(self.device),
                          attention_mask=batch["attention_mask"].to(self.device), truncated=truncated)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """X = word-embedding rows of ``input_ids`` (no position or type embeddings)."""
        if not isinstance(input_ids, torch.Tensor) or input_ids.dtype not in (torch.int64, torch.int32):
            raise ValueError("input_ids must be an integer torch.Tensor")
        if input_ids.numel() and (input_ids.min() < 0 or input_ids.max() >= self.vocab_size):
            raise ValueError(f"input_ids must lie in [0, {self.vocab_size}), the vocabulary")
        return self.model.get_input_embeddings()(input_ids.to(self.device))

    # --- server side ------------------------------------------------------------------------
    def encode(self, token_embeddings: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Pooled sentence embeddings (batch, d) from token embeddings (batch, seq, d)."""
        check_float_tensor("token_embeddings", token_embeddings, ndim=3)
        if token_embeddings.shape[-1] != self.hidden_size:
            raise ValueError(f"token_embeddings have dimension {token_embeddings.shape[-1]}, "
                             f"the model expects {self.hidden_size}")
        if attention_mask.shape != token_embeddings.shape[:2]:
            raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}, expected "
                             f"{tuple(token_embeddings.shape[:2])}")
        embeddings = token_embeddings.to(self.device, self.embedding_matrix.dtype)
        mask = attention_mask.to(self.device)
        hidden = self.backbone(inputs_embeds=embeddings, attention_mask=mask).last_hidden_state
        return self._pool(hidden, mask)

    def forward_ids(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """The unsplit model on token ids, pooled the same way (the reference for ``encode``)."""
        mask = attention_mask.to(self.device)
        hidden = self.backbone(input_ids=input_ids.to(self.device), attention_mask=mask).last_hidden_state
        return self._pool(hidden, mask)

    @torch.inference_mode()
    def encode_texts(self, texts: Sequence[str], *, batch_size: int = 64) -> torch.Tensor:
        """Non-private sentence embeddings (n, d) of ``texts`` through the split path, in input order."""
        def encode_batch(chunk: list[str]) -> np.ndarray:
            batch = self.tokenize(chunk)
            return self.encode(self.embed_tokens(batch.input_ids), batch.attention_mask).float().cpu().numpy()
        return torch.from_numpy(map_in_length_order(texts, encode_batch, batch_size=batch_size))

    def token_counts(self, texts: Sequence[str]) -> list[int]:
        """Token count of each text with special tokens, untruncated."""
        return [len(ids) for ids in self.tokenizer(list(texts), truncation=False)["input_ids"]]

    def _pool(self, hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        pooled = POOLERS[self.pooling](hidden, attention_mask)
        return torch.nn.functional.normalize(pooled, dim=-1) if self.normalize else pooled

    def _model_max_length(self) -> int:
        config = self.model.config
        for key in ("max_position_embeddings", "n_positions"):
            value = getattr(config, key, None)
            if isinstance(value, int) and value > 0:
                return value
        return _DEFAULT_MAX_LENGTH

    def __repr__(self) -> str:
        return (f"SplitModel(name={self.name!r}, family={self.family!r}, pooling={self.pooling!r}, "
                f"normalize={self.normalize}, d={self.hidden_size}, |V|={self.vocab_size}, device={self.device})")
