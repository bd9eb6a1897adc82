"""The client half of a split model: a tokenizer and the word-embedding matrix, nothing else.

This is all an SnD or SAP client needs (and all the SnD bundle ships). ``SplitModel`` extends it
with the server half.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Literal

import torch
from transformers import PreTrainedTokenizerBase

from privlm.models.batching import pad_ids
from privlm.models.device import resolve_device
from privlm.models.fingerprints import model_fingerprint
from privlm.validation import check_choice

TruncationPolicy = Literal["warn", "error", "count"]  # "count": the caller reports truncation itself
TRUNCATION_POLICIES: tuple[TruncationPolicy, ...] = ("warn", "error", "count")


@dataclass(frozen=True)
class Tokens:
    """One tokenization of a list of texts: full-length ids with special tokens, never truncated."""

    texts: tuple[str, ...]
    ids: tuple[tuple[int, ...], ...]

    @property
    def counts(self) -> list[int]:
        return [len(ids) for ids in self.ids]

    def longer_than(self, max_length: int) -> list[int]:
        """Indices of the texts with more than ``max_length`` tokens."""
        return [i for i, ids in enumerate(self.ids) if len(ids) > max_length]

    @classmethod
    def join(cls, parts: Sequence[Tokens]) -> Tokens:
        """The tokens of several lists of texts, one after the other."""
        return cls(texts=tuple(text for part in parts for text in part.texts),
                   ids=tuple(ids for part in parts for ids in part.ids))

    def subset(self, indices: Sequence[int]) -> Tokens:
        return Tokens(texts=tuple(self.texts[i] for i in indices), ids=tuple(self.ids[i] for i in indices))

    def __len__(self) -> int:
        return len(self.ids)


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
    """A non-empty list of non-blank strings that are valid Unicode, or a ValueError that names the bad
    item by its index (never by its content: messages may travel to logs and error answers)."""
    if isinstance(texts, str) or not isinstance(texts, Sequence) or len(texts) == 0:
        raise ValueError("texts must be a non-empty list of strings")
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise ValueError(f"texts[{i}] is not a string but {type(text).__name__}")
        if not text.strip():
            raise ValueError(f"texts[{i}] is empty or blank")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # a lone UTF-16 surrogate: JSON can carry it, no tokenizer can read it
            raise ValueError(f"texts[{i}] is not valid Unicode (it holds a lone surrogate code point)") from None


class TokenEmbedder:
    """Tokenize and look up word-embedding rows (no position or type embeddings)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None, embedding_weight: torch.Tensor, *,
                 config: dict[str, object], max_length: int, normalize: bool = False, name: str = "model",
                 device: str | torch.device = "auto") -> None:
        self.device = resolve_device(device)
        self.tokenizer = tokenizer
        # A fast tokenizer keeps truncation and padding settings as shared state: one call at a time.
        self._tokenizer_lock = threading.Lock()
        if tokenizer is not None and tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token  # GPT-2 style tokenizers have no pad token
        self._embedding_weight = embedding_weight
        self.config_dict = config
        self.max_length = max_length
        self.normalize = normalize
        self.name = name

    # --- the vocabulary -------------------------------------------------------------------
    @property
    def embedding_matrix(self) -> torch.Tensor:
        """The (|V|, d) word-embedding matrix, detached."""
        return self._embedding_weight.detach()

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
        return model_fingerprint(self.embedding_matrix, self.config_dict)

    # --- tokens -------------------------------------------------------------------------------
    def tokens(self, texts: Iterable[str]) -> Tokens:
        """Tokenize once: every text's full-length ids (special tokens included), in one tokenizer call.
        ``texts`` may be any iterable of strings (a list, a numpy array, a generator)."""
        texts = texts if isinstance(texts, str) else list(texts)  # a lone string is refused by check_texts
        check_texts(texts)
        tokenizer = self.require_tokenizer()
        with self._tokenizer_lock:
            ids = tokenizer(list(texts), truncation=False)["input_ids"]
        empty = [i for i, row in enumerate(ids) if not row]
        if empty:
            raise ValueError(f"texts{empty[:10]} have no tokens at all; nothing to embed")
        return Tokens(texts=tuple(texts), ids=tuple(tuple(row) for row in ids))

    def with_unknown_tokens(self, tokens: Tokens) -> list[int]:
        """Indices of the texts with at least one unknown token (over-long words, unseen characters)."""
        unknown = self.require_tokenizer().unk_token_id
        return [] if unknown is None else [i for i, ids in enumerate(tokens.ids) if unknown in ids]

    def without_content(self, tokens: Tokens) -> list[int]:
        """Indices of the texts that are special tokens only (say, only zero-width characters): their
        embedding says nothing about the text."""
        tokenizer = self.require_tokenizer()
        special = set(tokenizer.all_special_ids) - {tokenizer.unk_token_id}  # [UNK] stands for some text
        return [i for i, ids in enumerate(tokens.ids) if all(t in special for t in ids)]

    def content_ids(self, texts: Sequence[str]) -> list[list[int]]:
        """Every text's ids without the tokenizer's special tokens (no [CLS]/[SEP]), untruncated."""
        check_texts(texts)
        tokenizer = self.require_tokenizer()
        with self._tokenizer_lock:
            return [list(ids) for ids in tokenizer(list(texts), add_special_tokens=False)["input_ids"]]

    def token_counts(self, texts: Sequence[str]) -> list[int]:
        """Token count of each text with special tokens, untruncated."""
        return self.tokens(texts).counts

    def pad(self, tokens: Tokens, *, max_length: int | None = None) -> TokenBatch:
        """A right-padded batch on the model's device; texts over ``max_length`` (default: the model's)
        are cut as the tokenizer cuts them (special tokens kept) and flagged in ``truncated``."""
        max_length = min(max_length or self.max_length, self.max_length)
        tokenizer = self.require_tokenizer()
        rows = list(tokens.ids)
        long = tokens.longer_than(max_length)
        if long:
            with self._tokenizer_lock:
                cut = tokenizer([tokens.texts[i] for i in long], truncation=True, max_length=max_length)["input_ids"]
            for i, ids in zip(long, cut, strict=True):
                rows[i] = tuple(ids)
        input_ids, attention_mask = pad_ids(rows, int(tokenizer.pad_token_id), self.device)
        return TokenBatch(input_ids=input_ids, attention_mask=attention_mask,
                          truncated=[len(ids) > max_length for ids in tokens.ids])

    def tokenize(self, texts: Sequence[str], *, truncation: TruncationPolicy = "warn", max_length: int | None = None
                 ) -> TokenBatch:
        """Tokenize a batch (right padding). Texts over ``max_length`` (default: the model's) are cut
        and counted with a warning, or refused with ``truncation="error"``."""
        check_choice("truncation", truncation, TRUNCATION_POLICIES)
        tokens = self.tokens(texts)
        limit = min(max_length or self.max_length, self.max_length)
        long = tokens.longer_than(limit)
        if long:
            message = (f"{len(long)} of {len(tokens)} texts exceed max_length={limit} tokens "
                       f"(longest: {max(tokens.counts)})")
            if truncation == "error":
                raise ValueError(message + "; pass truncation='warn' to cut them")
            if truncation == "warn":
                warnings.warn(message + "; they were truncated", stacklevel=2)
        return self.pad(tokens, max_length=limit)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """X = word-embedding rows of ``input_ids``."""
        if not isinstance(input_ids, torch.Tensor) or input_ids.dtype not in (torch.int64, torch.int32):
            raise ValueError("input_ids must be an integer torch.Tensor")
        if input_ids.numel() and (input_ids.min() < 0 or input_ids.max() >= self.vocab_size):
            raise ValueError(f"input_ids must lie in [0, {self.vocab_size}), the vocabulary")
        return torch.nn.functional.embedding(input_ids.to(self.device), self._embedding_weight)

    @classmethod
    def from_pretrained(cls, name_or_path: str | Path = "minilm", *, device: str | torch.device = "auto"
                        ) -> TokenEmbedder:
        """Load only the tokenizer and the word-embedding rows (not the transformer) from local files."""
        from transformers import AutoConfig, AutoTokenizer

        from privlm.models.loading import materialise_gguf, read_sentence_transformer_config
        from privlm.models.sources import resolve_source

        source = resolve_source(name_or_path)
        path = materialise_gguf(source) if source.gguf_file else source.path
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        weight = _read_word_embeddings(Path(path), vocab_size=config.vocab_size,
                                       tied=bool(getattr(config, "tie_word_embeddings", False)))
        st = read_sentence_transformer_config(Path(path))
        max_length = (st.max_seq_length if st and st.max_seq_length else None) or getattr(
            config, "max_position_embeddings", None) or getattr(config, "n_positions", None) or 512
        return cls(AutoTokenizer.from_pretrained(path, local_files_only=True), weight.to(resolve_device(device)),
                   config=config.to_dict(), max_length=max_length, normalize=bool(st and st.normalize),
                   name=str(name_or_path), device=device)

    def require_tokenizer(self) -> PreTrainedTokenizerBase:
        """The tokenizer, or a clear error for an embedder built without one."""
        if self.tokenizer is None:
            raise ValueError(f"{type(self).__name__} has no tokenizer; pass input_ids directly")
        return self.tokenizer


_EMBEDDING_KEYS = ("word_embeddings.weight", "embed_tokens.weight", "wte.weight", "shared.weight")


def _read_word_embeddings(folder: Path, *, vocab_size: int, tied: bool) -> torch.Tensor:
    """The word-embedding tensor from the folder's safetensors files, read without loading the rest.

    A tied model may store the shared matrix under the LM head's name only.
    """
    from safetensors import safe_open

    keys = (*_EMBEDDING_KEYS, "lm_head.weight") if tied else _EMBEDDING_KEYS
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 - safe_open handles are not mappings
                if key.endswith(keys) and handle.get_slice(key).get_shape()[0] == vocab_size:
                    return handle.get_tensor(key)
    raise ValueError(f"no word-embedding tensor ({', '.join(_EMBEDDING_KEYS)}) in the safetensors files of {folder}")
