"""A Hugging Face model seen as two halves.

Client side: ``embed_tokens(input_ids) -> X``, word-embedding rows only.
Server side: ``encode(X, attention_mask) -> pooled``, which feeds X as ``inputs_embeds`` (the
model adds position/type embeddings itself) and applies the family's pooling.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from functools import cached_property
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

from privlm.models.batching import map_in_length_order
from privlm.models.client import TokenEmbedder
from privlm.models.device import resolve_device
from privlm.models.fingerprints import weights_sha256
from privlm.models.loading import load_pretrained, model_family
from privlm.models.pooling import POOLERS, Pooling, choose_pooling
from privlm.validation import check_float_tensor

log = logging.getLogger(__name__)
_DEFAULT_MAX_LENGTH = 512


def _model_max_length(config: PretrainedConfig) -> int:
    for key in ("max_position_embeddings", "n_positions"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return _DEFAULT_MAX_LENGTH


class SplitModel(TokenEmbedder):
    """A model split into a client half (token embeddings) and a server half (the rest + pooling)."""

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase | None = None,
        *,
        pooling: Pooling | Literal["auto"] = "auto",
        normalize: bool = False,
        max_length: int | None = None,
        device: str | torch.device = "auto",
        name: str | None = None,
    ) -> None:
        self.family = model_family(model.config)
        self.pooling = choose_pooling(self.family, pooling)
        device = resolve_device(device)
        self.model = model
        torch.nn.Module.to(model, device).eval()  # Module.to: transformers' own override confuses type checkers
        self.backbone = model.base_model  # the transformer without task heads
        embeddings = self.model.get_input_embeddings()
        if not isinstance(embeddings, torch.nn.Embedding):
            raise ValueError(f"{type(model).__name__} has no word-embedding table ({type(embeddings).__name__})")
        super().__init__(tokenizer, embeddings.weight, config=model.config.to_dict(),
                         max_length=max_length or _model_max_length(model.config), normalize=normalize,
                         name=name or model.config.name_or_path or model.config.model_type, device=device)

    @classmethod
    def from_pretrained(cls, name_or_path: str | Path = "minilm", *, device: str | torch.device = "auto",
                        pooling: Pooling | Literal["auto"] = "auto", dtype: torch.dtype = torch.float32
                        ) -> SplitModel:
        """Load ``"minilm"``, ``"smollm2"``, a local folder, or a HF id already in the local cache.

        A sentence-transformers folder brings its own pooling, normalisation and max length.
        """
        resolved = resolve_device(device)
        loaded = load_pretrained(name_or_path, device=resolved, dtype=dtype)
        st = loaded.sentence_transformer
        return cls(loaded.model, loaded.tokenizer, pooling=choose_pooling(loaded.family, pooling, folder=st),
                   normalize=bool(st and st.normalize),
                   max_length=st.max_seq_length if st else None, device=resolved, name=str(name_or_path))

    @cached_property
    def weights_fingerprint(self) -> str:
        """sha256 of everything the server half computes with: every parameter and buffer (fp32 bytes, by
        name), the pooling, normalisation and max length. Two servers with equal weights fingerprints
        compute the same function (up to their device's and dtype's rounding); ``fingerprint`` (the
        embedding rows) is what a client can check itself."""
        facts = json.dumps([self.pooling, self.normalize, self.max_length])
        return weights_sha256(self.model, salt=(self.fingerprint + facts).encode())

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

    def _pool(self, hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        pooled = POOLERS[self.pooling](hidden, attention_mask)
        return torch.nn.functional.normalize(pooled, dim=-1) if self.normalize else pooled

    def __repr__(self) -> str:
        return (f"SplitModel(name={self.name!r}, family={self.family!r}, pooling={self.pooling!r}, "
                f"normalize={self.normalize}, d={self.hidden_size}, |V|={self.vocab_size}, device={self.device})")
