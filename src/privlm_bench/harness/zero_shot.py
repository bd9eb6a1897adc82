"""Zero-shot sentiment classification by a local causal LM, with the Cape paper's prompt.

The prompt (Cape, Appendix; kept word for word, its grammar included) goes through the tokenizer's
chat template with the generation prompt, so the next token is the model's first answer token:

    system: "You are a helpful assistant. Classify if the sentence is positive or negative sentiment.
             Just gives the answer in positive, negative."
    user:   "“Content”: {input}"

The score of a text is the difference of two logits at that first answer position,

    score(x) = logit(t_pos | prompt(x)) - logit(t_neg | prompt(x)),

where t_pos and t_neg are the first tokens of "positive" and "negative" (no leading space: the answer
starts a new line). The score ranks texts, so it is summarised by its ROC AUC against the labels; no
threshold is chosen. A small model such as SmolLM2-135M is a weak zero-shot classifier: compare a
perturbed AUC with the clean AUC of the same texts, not with 1, and with 0.5 (no signal).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from sklearn.metrics import roc_auc_score
from transformers import PreTrainedTokenizerBase

from privlm.models.batching import length_sorted_batches
from privlm.models.kv_cache import cache_of, with_cache
from privlm.models.language import LanguageModel
from privlm.validation import check_positive_int

CAPE_SYSTEM_PROMPT = ("You are a helpful assistant. Classify if the sentence is positive or negative sentiment. "
                      "Just gives the answer in positive, negative.")
CAPE_USER_TEMPLATE = "“Content”: {input}"


def zero_shot_prompt(tokenizer: PreTrainedTokenizerBase, text: str) -> str:
    """The Cape prompt for ``text`` in the tokenizer's chat template, ending where the answer starts."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("zero-shot classification needs a tokenizer with a chat template (an instruct model)")
    messages = [{"role": "system", "content": CAPE_SYSTEM_PROMPT},
                {"role": "user", "content": CAPE_USER_TEMPLATE.format(input=text)}]
    return str(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))


def first_token_id(tokenizer: PreTrainedTokenizerBase, word: str) -> int:
    """The id of the first token of ``word`` as the answer's first word (no leading space)."""
    ids = tokenizer(word, add_special_tokens=False)["input_ids"]
    if not ids:
        raise ValueError(f"the tokenizer gives no token for {word!r}")
    return int(ids[0])


@dataclass
class ZeroShotClassifier:
    """Scores texts by logit(first token of ``positive``) - logit(first token of ``negative``)."""

    model: LanguageModel
    positive: str = "positive"
    negative: str = "negative"
    batch_size: int = 16

    def __post_init__(self) -> None:
        if self.model.kind != "causal":
            raise ValueError(f"zero-shot classification needs a causal LM, got a {self.model.kind} one")
        check_positive_int("batch_size", self.batch_size)
        tokenizer = self.model.tokenizer
        self.answer_ids = (first_token_id(tokenizer, self.negative), first_token_id(tokenizer, self.positive))
        if self.answer_ids[0] == self.answer_ids[1]:
            raise ValueError(f"{self.positive!r} and {self.negative!r} start with the same token")

    def scores(self, texts: Sequence[str]) -> np.ndarray:
        """(n,) float64 scores, in the order of ``texts``.

        Every prompt starts with the same system message, so its keys and values are computed once
        (a cache of the shared prefix of token ids) and each batch of similar length runs only its own
        suffix; the logits are those of the full prompt, to float rounding.
        """
        if isinstance(texts, str) or not texts:
            raise ValueError("texts must be a non-empty list of strings")
        tokenizer = self.model.tokenizer
        if tokenizer.pad_token_id is None:
            raise ValueError("the tokenizer has no pad token, so prompts cannot be batched")
        prompts = [zero_shot_prompt(tokenizer, text) for text in texts]
        ids = [list(row) for row in tokenizer(prompts, add_special_tokens=False)["input_ids"]]
        prefix = ids[0][: _shared_prefix_length(ids)]
        out = np.empty(len(ids), dtype=np.float64)
        with torch.inference_mode():
            hf = self.model.model
            cache = cache_of(hf, hf(input_ids=torch.tensor([prefix], device=self.model.device), use_cache=True))
            for indices in length_sorted_batches(prompts, self.batch_size):
                out[indices] = self._score_batch([ids[i][len(prefix):] for i in indices], cache, len(prefix))
        return out

    def _score_batch(self, suffixes: list[list[int]], prefix_cache: Any, prefix_length: int) -> np.ndarray:
        hf, device, n = self.model.model, self.model.device, len(suffixes)
        # Right padding: a causal model's states at a real position never see the pads after it.
        width = max(len(row) for row in suffixes)
        input_ids = torch.full((n, width), int(self.model.tokenizer.pad_token_id), dtype=torch.long, device=device)
        mask = torch.zeros((n, width), dtype=torch.long, device=device)
        for i, row in enumerate(suffixes):
            input_ids[i, : len(row)] = torch.tensor(row, device=device)
            mask[i, : len(row)] = 1
        cache = copy.deepcopy(prefix_cache)
        cache.batch_repeat_interleave(n)
        full_mask = torch.cat([torch.ones((n, prefix_length), dtype=torch.long, device=device), mask], dim=1)
        hidden = hf.base_model(input_ids=input_ids, attention_mask=full_mask, use_cache=True,
                               **with_cache(hf.base_model, cache)).last_hidden_state
        last = hidden[torch.arange(n, device=device), mask.sum(dim=1) - 1]  # predicts the first answer token
        answer = hf.get_output_embeddings()(last)[:, list(self.answer_ids)].double()  # the LM head on n rows only
        return (answer[:, 1] - answer[:, 0]).cpu().numpy()


def _shared_prefix_length(rows: Sequence[Sequence[int]]) -> int:
    """Length of the longest common prefix of ``rows``, leaving every row at least one token of its own."""
    limit = min(len(row) for row in rows) - 1
    length = 0
    while length < limit and all(row[length] == rows[0][length] for row in rows):
        length += 1
    return length


def zero_shot_auc(scores: np.ndarray | Sequence[float], labels: np.ndarray | Sequence[int]) -> float:
    """ROC AUC of ``scores`` for the positive class (label 1); NaN when only one class is present."""
    y, s = np.asarray(labels), np.asarray(scores, dtype=np.float64)
    if y.shape != s.shape or y.ndim != 1:
        raise ValueError(f"scores and labels must be 1-D of the same length, got {s.shape} and {y.shape}")
    if not np.isfinite(s).all():
        raise ValueError("scores contain NaN or inf")
    if len(np.unique(y)) < 2:
        return math.nan
    return float(roc_auc_score(y, s))
