"""Masked-token inference (MTI, Yue et al. 2021; the Cape paper's second attack).

For every attacked position i of a perturbed token sequence y, the attacker replaces y_i by the
mask token and predicts the original token from the perturbed context:

    x^_i = argmax_v  p_MLM(v | y_1..y_{i-1}, [MASK], y_{i+1}..y_n)      (special tokens excluded).

All masked copies of one sequence go through the model together (one row per masked position).
The reconstruction x^ (y with every attacked position replaced by its prediction) is scored
against the original x with

- token accuracy over the attacked positions, the success rate of the returned
  :class:`AttackResult` (exact binomial CI), and
- Rouge-L F1 between x and x^ over the whole sequence, as in Cape (privacy = 1 - Rouge-L);
  ``details["rouge_l"]`` is a :class:`ScoreResult` over sequences (bootstrap CI).

By default every non-special position is attacked, since the attacker does not know which
tokens were changed; pass ``attack_mask`` (e.g. ``perturbed != original``) to restrict it.

**Causal-LM stand-in** (``method="causal-lm-stand-in"``, recorded in ``details["method"]``). When
only a causal LM is at hand (SmolLM2), it stands in for the masked LM; it is *not* the attack of
the papers. For position i it takes the ``top_k`` candidates from the next-token logits of the
left context y_<i (one forward pass gives these for every position), then re-ranks each candidate
c by the log-likelihood of the whole sentence with c substituted,

    x^_i = argmax_c  sum_t log p_LM(s_t | s_<t),   s = (bos, y_1..y_{i-1}, c, y_{i+1}..y_n),

so the right context counts too. The candidate sentences are scored in batched forward passes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from numbers import Integral
from typing import Any, Literal

import torch
from transformers import PreTrainedTokenizerBase
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from privlm.attacks.llm_reconstruction import LLMReconstructionConfig, rank_candidates
from privlm.attacks.results import AttackResult, score_result
from privlm.attacks.text_metrics import rouge_l_f1
from privlm.validation import check_choice, check_positive_int

MtiMethod = Literal["auto", "masked-lm", "causal-lm-stand-in"]
MTI_METHODS: tuple[MtiMethod, ...] = ("auto", "masked-lm", "causal-lm-stand-in")
ROUGE_UNITS = ("words", "tokens")
_CAUSAL_CLASSES = frozenset(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())

Ids = Sequence[Sequence[int]] | torch.Tensor
Predictor = Callable[[torch.nn.Module, list[int], list[int]], list[int]]


# --- inputs ---------------------------------------------------------------------------------------
def _rows(name: str, value: object, attention_mask: torch.Tensor | None, *, flags: bool = False) -> list[list]:
    """Sequences as lists: a list of lists as is, a 2-D tensor row by row (kept where attention_mask is 1).

    Elements must be non-negative integer ids, or booleans when ``flags`` is true.
    """
    if isinstance(value, torch.Tensor):
        if value.ndim != 2:
            raise ValueError(f"{name} must be a 2-D tensor (batch, length), got shape {tuple(value.shape)}")
        if attention_mask is not None and attention_mask.shape != value.shape:
            raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}, expected {tuple(value.shape)}")
        keep = torch.ones_like(value, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        rows = [row[m.to(row.device)].tolist() for row, m in zip(value, keep, strict=True)]
    elif isinstance(value, str) or not isinstance(value, Sequence):
        raise ValueError(f"{name} must be a list of token-id sequences or a 2-D tensor, got {type(value).__name__}")
    else:
        rows = [row.tolist() if isinstance(row, torch.Tensor) else list(row) for row in value]
    if not rows:
        raise ValueError(f"{name} must not be empty")
    for i, row in enumerate(rows):
        valid = all(isinstance(t, bool) for t in row) if flags else all(_is_id(t) for t in row)
        if not row or not valid:
            kind = "booleans" if flags else "non-negative integer token ids"
            raise ValueError(f"{name}[{i}] must be a non-empty sequence of {kind}")
    return rows if flags else [[int(t) for t in row] for row in rows]


def _is_id(token: object) -> bool:
    return isinstance(token, Integral) and not isinstance(token, bool) and int(token) >= 0


def _attack_positions(attack_mask: object, attention_mask: torch.Tensor | None, perturbed: list[list[int]],
                      special: frozenset[int]) -> list[list[int]]:
    """Positions to attack per sequence: attack_mask's true flags, or every non-special token by default."""
    if attack_mask is None:
        positions = [[i for i, t in enumerate(row) if t not in special] for row in perturbed]
    else:
        rows = _rows("attack_mask", attack_mask, attention_mask, flags=True)
        if len(rows) != len(perturbed):
            raise ValueError(f"attack_mask has {len(rows)} sequences, perturbed_ids has {len(perturbed)}")
        positions = []
        for i, (flags, row) in enumerate(zip(rows, perturbed, strict=True)):
            if len(flags) != len(row):
                raise ValueError(f"attack_mask[{i}] has length {len(flags)}, perturbed_ids[{i}] has {len(row)}")
            positions.append([j for j, flag in enumerate(flags) if flag])
    if not any(positions):
        raise ValueError("attack_mask selects no positions (or every token is special)")
    return positions


def _resolve_method(method: MtiMethod, model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase) -> MtiMethod:
    check_choice("method", method, MTI_METHODS)
    if method != "auto":
        return method
    if type(model).__name__ in _CAUSAL_CLASSES:
        return "causal-lm-stand-in"
    if tokenizer.mask_token_id is not None:
        return "masked-lm"
    raise ValueError("method='auto' cannot tell a masked LM from a causal LM here; pass method= explicitly")


def _device(model: torch.nn.Module) -> torch.device:
    parameter = next(model.parameters(), None)
    return parameter.device if parameter is not None else torch.device("cpu")


def _exclude(logits: torch.Tensor, special: frozenset[int]) -> torch.Tensor:
    ids = [i for i in special if i < logits.shape[-1]]
    if ids:
        logits[..., ids] = -torch.inf
    return logits


# --- the two predictors -----------------------------------------------------------------------------
@torch.inference_mode()
def _predict_masked_lm(model: torch.nn.Module, sequence: list[int], positions: list[int], *, mask_id: int,
                       special: frozenset[int], max_batch_tokens: int) -> list[int]:
    """argmax_v of the MLM logits at each masked position; one row per position, rows batched."""
    device = _device(model)
    base = torch.tensor(sequence, device=device)
    rows_per_pass = max(1, max_batch_tokens // len(sequence))
    predictions: list[int] = []
    for start in range(0, len(positions), rows_per_pass):
        chunk = torch.tensor(positions[start:start + rows_per_pass], device=device)
        rows = base.repeat(len(chunk), 1)
        rows[torch.arange(len(chunk), device=device), chunk] = mask_id
        logits = model(input_ids=rows, attention_mask=torch.ones_like(rows)).logits
        picked = _exclude(logits[torch.arange(len(chunk), device=device), chunk].float(), special)
        predictions.extend(picked.argmax(dim=-1).tolist())
    return predictions


def _predict_causal_stand_in(model: torch.nn.Module, sequence: list[int], positions: list[int], *, start_id: int,
                             special: frozenset[int], top_k: int, max_batch_tokens: int) -> list[int]:
    """Top-k candidates from the left context, re-ranked by the full-sentence log-likelihood (the LM reconstruction
    attack's ranking, :func:`privlm.attacks.llm_reconstruction.rank_candidates`, without the released token)."""
    starts = sequence[0] == start_id
    if starts and 0 in positions:
        raise ValueError("attack_mask selects position 0, the context start token, which has no left context")
    body, where = (sequence[1:], [p - 1 for p in positions]) if starts else (sequence, positions)
    ids, _ = rank_candidates(model, body, where, start_id=start_id, excluded=special, include_released=False,
                             config=LLMReconstructionConfig(shortlist=top_k, max_batch_tokens=max_batch_tokens))
    return ids[:, 0].tolist()


# --- the attack ---------------------------------------------------------------------------------------
def _rouge_units(ids: list[int], tokenizer: PreTrainedTokenizerBase, unit: str, special: frozenset[int]) -> list:
    if unit == "words":
        return str(tokenizer.decode(ids, skip_special_tokens=True)).split()
    return [t for t in ids if t not in special]


@dataclass(frozen=True, kw_only=True)
class MaskedTokenConfig:
    """The predictor and the scoring of :func:`masked_token_inference` (see the module docstring)."""

    method: MtiMethod = "auto"  # "auto": the causal stand-in for causal-LM classes, else the masked LM
    top_k: int = 10  # candidates from the left context that the causal stand-in re-ranks
    exclude_special_tokens: bool = True  # never predict a special token
    rouge_on: Literal["words", "tokens"] = "words"  # decoded words (special tokens skipped) or non-special ids
    max_batch_tokens: int = 4096  # rows x length per forward pass
    context_start_id: int | None = None  # the stand-in's first context token; None: the tokenizer's bos, else eos


def masked_token_inference(
    original_ids: Ids,
    perturbed_ids: Ids,
    model: Any,
    tokenizer: PreTrainedTokenizerBase | None = None,
    *,
    attention_mask: torch.Tensor | None = None,
    attack_mask: Sequence[Sequence[bool]] | torch.Tensor | None = None,
    seed: int = 0,
    config: MaskedTokenConfig = MaskedTokenConfig(),
) -> AttackResult:
    """MTI on token-id sequences (in the attacker model's vocabulary); see the module docstring for the math.

    ``original_ids``/``perturbed_ids``: lists of equal-length id sequences, or 2-D tensors with an
    optional ``attention_mask`` (padding is dropped). ``model`` is a masked LM (``...ForMaskedLM``)
    or a causal LM, called as ``model(input_ids=..., attention_mask=...).logits``; a
    :class:`privlm.models.SplitModel` is unwrapped (its tokenizer is used when none is given).
    ``config`` chooses the method and its knobs (:class:`MaskedTokenConfig`); the causal stand-in's
    context starts with ``config.context_start_id``, prepended unless the sequence starts with it.
    ``seed`` seeds the bootstrap CI.
    """
    from privlm.models import SplitModel

    start = time.perf_counter()
    if isinstance(model, SplitModel):
        tokenizer = tokenizer or model.tokenizer
        model = model.model
    if tokenizer is None:
        raise ValueError("tokenizer is required (the model's tokenizer)")
    top_k = check_positive_int("top_k", config.top_k)
    max_batch_tokens = check_positive_int("max_batch_tokens", config.max_batch_tokens)
    rouge_on = config.rouge_on
    check_choice("rouge_on", rouge_on, ROUGE_UNITS)
    method = _resolve_method(config.method, model, tokenizer)
    original, perturbed = _paired_rows(original_ids, perturbed_ids, attention_mask)
    special = frozenset(tokenizer.all_special_ids)
    positions = _attack_positions(attack_mask, attention_mask, perturbed, special)
    predict = _predictor(method, tokenizer, special if config.exclude_special_tokens else frozenset(), top_k=top_k,
                         max_batch_tokens=max_batch_tokens, context_start_id=config.context_start_id)
    reconstructions = [_reconstruct(predict, model, y, where) for y, where in zip(perturbed, positions, strict=True)]
    hits = [guess[p] == x[p] for x, guess, where in zip(original, reconstructions, positions, strict=True)
            for p in where]
    units = [(_rouge_units(x, tokenizer, rouge_on, special), _rouge_units(guess, tokenizer, rouge_on, special))
             for x, guess in zip(original, reconstructions, strict=True)]
    rouge = [rouge_l_f1(reference, hypothesis) for reference, hypothesis in units]
    rouge_result = score_result(f"mti-rouge-l-{rouge_on}", rouge, seed=seed)
    details = {"method": method, "rouge_l": rouge_result, "rouge_l_f1": rouge_result.mean, "rouge_on": rouge_on,
               "predicted_ids": reconstructions, "top_k": top_k if method == "causal-lm-stand-in" else None,
               "seconds": time.perf_counter() - start}
    return AttackResult(name=f"mti-{method}", successes=sum(hits), trials=len(hits), chance=None, details=details)


def _paired_rows(original_ids: Ids, perturbed_ids: Ids,
                 attention_mask: torch.Tensor | None) -> tuple[list[list[int]], list[list[int]]]:
    original = _rows("original_ids", original_ids, attention_mask)
    perturbed = _rows("perturbed_ids", perturbed_ids, attention_mask)
    if len(original) != len(perturbed):
        raise ValueError(f"perturbed_ids has {len(perturbed)} sequences, original_ids has {len(original)}")
    for i, (x, y) in enumerate(zip(original, perturbed, strict=True)):
        if len(x) != len(y):
            raise ValueError(f"perturbed_ids[{i}] has length {len(y)}, original_ids[{i}] has {len(x)}")
    return original, perturbed


def _reconstruct(predict: Predictor, model: torch.nn.Module, perturbed: list[int], positions: list[int]) -> list[int]:
    """The perturbed sequence with every attacked position replaced by the attacker's prediction."""
    guess = list(perturbed)
    if positions:
        for position, token in zip(positions, predict(model, perturbed, positions), strict=True):
            guess[position] = token
    return guess


def _predictor(method: str, tokenizer: PreTrainedTokenizerBase, special: frozenset[int], *, top_k: int,
               max_batch_tokens: int, context_start_id: int | None) -> Predictor:
    """A function (model, sequence, positions) -> predicted ids for the chosen method."""
    if method == "masked-lm":
        if tokenizer.mask_token_id is None:
            raise ValueError("method='masked-lm' needs a tokenizer with a mask token")
        mask_id = tokenizer.mask_token_id
        return lambda model, seq, where: _predict_masked_lm(model, seq, where, mask_id=mask_id, special=special,
                                                            max_batch_tokens=max_batch_tokens)
    start_id = next((i for i in (context_start_id, tokenizer.bos_token_id, tokenizer.eos_token_id) if i is not None),
                    None)
    if start_id is None:
        raise ValueError("method='causal-lm-stand-in' needs a tokenizer with a bos or eos token to start the context")
    return lambda model, seq, where: _predict_causal_stand_in(model, seq, where, start_id=start_id, special=special,
                                                              top_k=top_k, max_batch_tokens=max_batch_tokens)
