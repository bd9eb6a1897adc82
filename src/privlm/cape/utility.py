"""Cape's utility: the device model's contextual logits mixed with embedding distance (privlm's definition).

The paper gives no formulas; privlm defines them as follows. For a sensitive position i of a prompt,
with original token x_i, and every candidate y of the candidate set C (the device model's vocabulary
minus its special tokens: fixed, public, the same for every input):

    L(y)      = the device model's logit for y at position i, given the context:
                - causal LM: the logits predicting position i from the prefix [bos] t_0 ... t_{i-1}
                  (the tokenizer's bos token, else its eos token, so that position 0 has a context);
                - masked LM: the sequence [CLS] t_0 ... [MASK] ... [SEP] with position i masked;
    L~(y)     = (clip(L(y), -B, B) + B) / (2B)                                  in [0, 1]
    s(x_i, y) = 1 - (d(x_i, y) - min_y d) / (max_y d - min_y d)                 in [0, 1] (1 when max = min)
                with d the Euclidean distance between the two embedding rows;
    u(x_i, y) = lambda_L L~(y) + lambda_D s(x_i, y)                             in [0, Delta]

with Delta = lambda_L + lambda_D. Whatever B is and whatever the context, every utility lies in
[0, Delta]: the guarantee rests on that alone, not on B being well chosen.

A prompt longer than the device model's context (less the room its bos, or [CLS] and [SEP], take) is
cut into consecutive chunks; each chunk is its own context. All the queries of a batch of prompts
go through one forward pass (right padding with an attention mask; for a masked LM, one masked copy
per position); distances are one matrix product against the candidates' embedding table.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from weakref import WeakKeyDictionary

import torch
import transformers
from transformers import PreTrainedTokenizerBase

from privlm.models.batching import pad_ids
from privlm.models.language import LanguageModel
from privlm.models.vocabulary import CandidateVocabulary


@dataclass(frozen=True)
class Query:
    """One context (a chunk of a prompt's token ids) and the positions in it whose logits are wanted."""

    ids: tuple[int, ...]
    positions: tuple[int, ...]  # ascending, local to the chunk


def wrapping(model: LanguageModel) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The ids a context starts and ends with: (bos,) and () for a causal LM; ([CLS],), ([SEP],) for BERT."""
    tokenizer = model.tokenizer
    if model.kind == "causal":
        start = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
        if start is None:
            raise ValueError("a causal device model needs a tokenizer with a bos or an eos token to start a context")
        return (int(start),), ()
    return _special_wrapping(tokenizer)


def _special_wrapping(tokenizer: PreTrainedTokenizerBase) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """What the tokenizer puts around one sequence (its special tokens), found by encoding the mask token."""
    marker = tokenizer.mask_token_id
    if marker is None:
        raise ValueError("a masked device model needs a tokenizer with a mask token; this one has none")
    built = [int(i) for i in tokenizer(tokenizer.mask_token, add_special_tokens=True)["input_ids"]]
    if built.count(marker) != 1:
        raise ValueError(f"cannot tell how {type(tokenizer).__name__} wraps a sequence in special tokens")
    at = built.index(marker)
    return tuple(built[:at]), tuple(built[at + 1:])


def context_room(model: LanguageModel) -> int:
    """Prompt tokens one context holds: the model's context length less its wrapping tokens."""
    start, end = wrapping(model)
    room = model.context_length - len(start) - len(end)
    if room < 1:
        raise ValueError(f"the device model's context ({model.context_length} tokens) leaves no room for a prompt")
    return room


def chunk_of(n_tokens: int, room: int) -> list[int]:
    """The chunk index of every token: consecutive runs of ``room`` tokens."""
    return [i // room for i in range(n_tokens)]


def _pad_id(tokenizer: PreTrainedTokenizerBase) -> int:
    for pad in (tokenizer.pad_token_id, tokenizer.eos_token_id, 0):
        if pad is not None:
            return int(pad)
    return 0


def causal_inputs(model: LanguageModel, queries: list[Query]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One row per query: [bos] + the chunk up to its last wanted position (later tokens cannot matter).

    The logits at input index l predict chunk token l: they see bos, t_0 .. t_{l-1}.
    """
    start, _ = wrapping(model)
    rows = [[*start, *q.ids[:max(q.positions)]] for q in queries]
    ids, mask = pad_ids(rows, _pad_id(model.tokenizer), model.device)
    keep = torch.zeros_like(mask, dtype=torch.bool)
    for row, q in enumerate(queries):
        keep[row, list(q.positions)] = True
    return ids, mask, keep


def masked_inputs(model: LanguageModel, queries: list[Query]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One row per wanted position: [CLS] + chunk + [SEP] with that position masked."""
    start, end = wrapping(model)
    mask_id = model.tokenizer.mask_token_id
    if mask_id is None:
        raise ValueError("a masked device model needs a tokenizer with a mask token; this one has none")
    rows, at = [], []
    for q in queries:
        for position in q.positions:
            row = [*start, *q.ids, *end]
            row[len(start) + position] = mask_id
            rows.append(row)
            at.append(len(start) + position)
    ids, mask = pad_ids(rows, _pad_id(model.tokenizer), model.device)
    keep = torch.zeros_like(mask, dtype=torch.bool)
    keep[torch.arange(len(rows)), torch.tensor(at, dtype=torch.long)] = True
    return ids, mask, keep


def candidate_columns(matrix: torch.Tensor, vocabulary: CandidateVocabulary) -> torch.Tensor:
    """The candidate columns of (n, n_ids) rows: a view when the candidates are one run of ids (no copy)."""
    ids = vocabulary.candidate_ids
    first, last = int(ids[0]), int(ids[-1])
    return matrix[:, first:last + 1] if last - first + 1 == ids.numel() else matrix[:, ids]


def _accepts_logits_to_keep(model: torch.nn.Module) -> bool:
    """A boolean position mask as ``logits_to_keep``: transformers 5 understands it; 4.x slices with it (wrongly)."""
    major = int(transformers.__version__.split(".", 1)[0])
    return major >= 5 and "logits_to_keep" in inspect.signature(model.forward).parameters


@torch.no_grad()
def device_logits(model: LanguageModel, queries: list[Query]) -> torch.Tensor:
    """(n, |C|) float32 logits over the candidates, one row per wanted position (queries in order).

    One forward pass. Where the model supports it (``logits_to_keep``), its head runs only at the wanted
    positions; otherwise the full logits are computed and the wanted rows taken.
    """
    build = causal_inputs if model.kind == "causal" else masked_inputs
    ids, mask, keep = build(model, queries)
    extra = {"logits_to_keep": keep} if _accepts_logits_to_keep(model.model) else {}
    logits = model.model(input_ids=ids, attention_mask=mask, **extra).logits
    rows = logits if logits.ndim == 2 else logits[keep]
    return candidate_columns(rows, model.vocabulary).float()


_TIED_HEADS: WeakKeyDictionary[torch.nn.Module, torch.Tensor | None] = WeakKeyDictionary()


def tied_head(model: LanguageModel) -> torch.Tensor | None:
    """W (n_ids, d) when a causal model's logits are exactly hidden @ W.T, W its input embedding table; else None.

    Then the head and the distances share one matrix product, [hidden; embedding rows] @ W.T, so the
    table is read once. Checked once per model against its own logits on a probe input: a head with a
    bias, a scale or soft-capping, or a quantized one, keeps the generic path.
    """
    if model.kind != "causal":
        return None
    if model.model not in _TIED_HEADS:
        _TIED_HEADS[model.model] = _probe_tied_head(model)
    return _TIED_HEADS[model.model]


@torch.no_grad()
def _probe_tied_head(model: LanguageModel) -> torch.Tensor | None:
    head, table = model.model.get_output_embeddings(), model.model.get_input_embeddings()
    if not (isinstance(head, torch.nn.Linear) and isinstance(table, torch.nn.Embedding) and head.bias is None
            and head.weight.data_ptr() == table.weight.data_ptr() and head.weight.dtype == torch.float32):
        return None
    start, _ = wrapping(model)
    probe = torch.tensor([[*start, int(model.vocabulary.candidate_ids[0])]], device=model.device)
    full = model.model(input_ids=probe).logits[0]
    ours = model.model.base_model(input_ids=probe).last_hidden_state[0] @ head.weight.T
    same = torch.allclose(full, ours, rtol=1e-4, atol=1e-4 * float(full.abs().max()))
    return head.weight.detach() if same else None


@torch.no_grad()
def logits_and_distances(model: LanguageModel, head: torch.Tensor | None, queries: list[Query] | None,
                         token_ids: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Candidate logits at the queries' wanted positions, and distances from ``token_ids``: (n, |C|) float32 each.

    With a tied head (:func:`tied_head`) and both wanted: one forward pass of the base model, then one
    matrix product for the logits and the distances' dot products together (d^2 = |q|^2 + |c|^2 - 2 q.c).
    Otherwise: :func:`device_logits` and ``vocabulary.distances`` (one matrix product).
    """
    vocabulary = model.vocabulary
    if head is None or not queries or token_ids is None:
        logits = device_logits(model, queries) if queries else None
        return logits, (vocabulary.distances(token_ids) if token_ids is not None else None)
    ids, mask, keep = causal_inputs(model, queries)
    hidden = model.model.base_model(input_ids=ids, attention_mask=mask).last_hidden_state[keep]
    rows = vocabulary.rows_of(token_ids)
    products = candidate_columns(torch.cat([hidden.float(), rows]) @ head.T, vocabulary)
    logits, dots = products.split([hidden.shape[0], rows.shape[0]])
    return logits, vocabulary.distances_from_products(token_ids, dots)


def logit_scores(logits: torch.Tensor, bound: float, weight: float = 1.0) -> torch.Tensor:
    """weight * L~, with L~ = (clip(L, -B, B) + B) / (2B) in [0, 1] (in place on ``logits``)."""
    return logits.clamp_(-bound, bound).add_(bound).mul_(weight / (2 * bound))


def distance_scores(distances: torch.Tensor, weight: float = 1.0) -> torch.Tensor:
    """weight * s, with s = 1 - (d - min d) / (max d - min d) = (max d - d) / (max d - min d) per row, in [0, 1];
    s = 1 where the row is constant (in place on ``distances``). The clamp absorbs float32 rounding only (span times
    its rounded reciprocal may exceed 1 by an ulp): a score above ``weight`` would break the sensitivity."""
    low, high = distances.amin(dim=-1, keepdim=True), distances.amax(dim=-1, keepdim=True)
    span = high - low
    scores = distances.sub_(high).mul_(-weight / span.clamp_min(torch.finfo(distances.dtype).tiny))
    scores = scores if bool((span > 0).all()) else torch.where(span > 0, scores, weight)
    return scores.clamp_(0.0, largest_float32_at_most(weight).item())


def largest_float32_at_most(value: float) -> torch.Tensor:
    """The largest float32 <= ``value``: a clamp bound that float32 rounding cannot push above ``value``."""
    bound = torch.tensor(value, dtype=torch.float32)
    return torch.nextafter(bound, torch.tensor(0.0)) if bound.item() > value else bound


def hybrid_utility(logit_part: torch.Tensor | None, distance_part: torch.Tensor | None, *,
                   sensitivity: float) -> torch.Tensor:
    """u = lambda_L L~ + lambda_D s from the weighted parts, clamped to [0, Delta] (in place).

    The clamp only absorbs float32 rounding: its upper end is the largest float32 <= Delta.
    """
    parts = [part for part in (logit_part, distance_part) if part is not None]
    if not parts:
        raise ValueError("the utility needs a logit part (lambda_L > 0) or a distance part (lambda_D > 0)")
    utility = parts[0] if len(parts) == 1 else parts[0].add_(parts[1])
    return utility.clamp_(0.0, largest_float32_at_most(sensitivity).item())
