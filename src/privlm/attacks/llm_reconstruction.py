"""LM reconstruction of sanitised text (after arXiv 2508.18976): a causal language model restores each perturbed
token of a released prompt from the context left around it, on both sides.

For a released sequence r and a perturbed position i, the attacker shortlists the ``shortlist`` most likely
tokens under the left context, P_LM(y | r_<i) (special tokens excluded), adds r_i itself (a mechanism may release
the original), and ranks every candidate y by the log-likelihood of the whole sequence with y in place,

    score(y) = sum_t log P_LM(s_t | s_<t),      s = (bos, r_0 .. r_{i-1}, y, r_{i+1} .. r_{n-1}),

so the right context counts as much as the left. Every other position keeps its released token. Success at
position i: the original token is the best candidate (top-1) or among the ``top`` best (top-10). This is what an
adversary with a language model does to word-level DP text (Cape, cape-public, CUSTEXT+, SANTEXT+, InferDPT). The
candidates of a position share their left context: one pass over the released sequence scores it for all of them
(its key/value cache and prefix log-likelihoods), and only (y, r_{i+1} .. r_{n-1}) goes through the model per candidate.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from privlm._validation import check_positive_int
from privlm.attacks.results import AttackResult
from privlm.models.kv_cache import cache_of, with_cache

if TYPE_CHECKING:
    from transformers import Cache


@dataclass(frozen=True)
class Reconstruction:
    """Per attacked sequence: the candidates of each attacked position, best first, and the top-1 / top-k results."""

    ranked: tuple[torch.Tensor, ...]  # per sequence: (positions, top) token ids, best first
    top1: AttackResult
    topk: AttackResult

    @property
    def restored(self) -> tuple[torch.Tensor, ...]:
        """Per sequence, the best candidate of each attacked position."""
        return tuple(r[:, 0] for r in self.ranked)


def _token_log_probs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(target) under each row of ``logits`` (..., vocabulary), without materialising a log-softmax."""
    logits = logits.float()
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - logits.logsumexp(dim=-1)


def _suffix_log_likelihood(model: torch.nn.Module, cache: Cache, prefix: int, rows: torch.Tensor) -> torch.Tensor:
    """sum_t log p(s_t | prefix, s_<t) over t >= 1 of each row s, the prefix being the first ``prefix`` tokens of
    ``cache`` (one row, left as it is)."""
    cache = copy.deepcopy(cache)  # cropped, repeated and appended to below
    cache.crop(prefix - cache.get_seq_length())
    cache.batch_repeat_interleave(rows.shape[0])
    mask = torch.ones(rows.shape[0], cache.get_seq_length() + rows.shape[1], dtype=torch.long, device=rows.device)
    logits = model(input_ids=rows, attention_mask=mask, use_cache=True, **with_cache(model, cache)).logits[:, :-1]
    return _token_log_probs(logits, rows[:, 1:]).sum(dim=-1)


@torch.inference_mode()
def rank_candidates(model: torch.nn.Module, sequence: Sequence[int], positions: Sequence[int], *, start_id: int,
                    excluded: frozenset[int], shortlist: int, include_released: bool = True,
                    max_batch_tokens: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """Candidates of each position of ``positions`` in ``sequence`` (no start token), ranked by the whole-sequence
    log-likelihood: ids (m, k) and their scores (m, k), best first. ``include_released``: the released token is
    always a candidate (in place of the last of the shortlist when the left context does not rank it).

    One pass over the released sequence gives the shortlists and the log-likelihood of every prefix, which the
    candidates of a position share; then, per position, the candidates and their right context go through the model
    on that pass's key/value cache cut to the prefix, in passes of at most ``max_batch_tokens`` fed tokens."""
    device = next(model.parameters()).device
    base = torch.tensor([start_id, *sequence], device=device)
    at = torch.tensor(list(positions), device=device) + 1
    out = model(input_ids=base.unsqueeze(0), use_cache=True)
    logits = out.logits[0].float()
    # prefix[j]: log-likelihood of base[1..j] (prefix[0] = 0); position at's candidates share prefix[at - 1]
    prefix = torch.cat([logits.new_zeros(1), _token_log_probs(logits[:-1], base[1:]).cumsum(dim=0)])
    left = logits[at - 1]
    shortlisted = left.clone()
    shortlisted[:, [i for i in excluded if i < left.shape[-1]]] = -torch.inf
    k = min(shortlist, int(torch.isfinite(shortlisted[0]).sum()))
    candidates = shortlisted.topk(k, dim=-1).indices  # (m, k)
    if include_released:
        missing = ~(candidates == base[at, None]).any(dim=-1)
        candidates[missing, -1] = base[at][missing]
    scores = prefix[at - 1, None] + left.log_softmax(dim=-1).gather(1, candidates)  # ... + log p(y | prefix)
    cache = cache_of(model, out)
    for row, a in enumerate(at.tolist()):
        kept = candidates[row] == base[a]
        scores[row, kept] = prefix[-1]  # y = r_i: the released sequence, already scored
        changed = (~kept).nonzero().squeeze(-1)
        if a == len(base) - 1 or not len(changed):
            continue  # the last token has no right context
        rows = base[a:].repeat(len(changed), 1)
        rows[:, 0] = candidates[row, changed]
        per_pass = max(1, max_batch_tokens // rows.shape[1])
        right = [_suffix_log_likelihood(model, cache, a, part) for part in rows.split(per_pass)]  # prefix: bos..r_{i-1}
        scores[row, changed] += torch.cat(right)
    ordered, order = scores.sort(dim=-1, descending=True, stable=True)  # a tie keeps the left context's order
    return candidates.gather(1, order), ordered


def llm_reconstruction(original_ids: Sequence[Sequence[int]], released_ids: Sequence[Sequence[int]],
                       positions: Sequence[Sequence[int]], model: torch.nn.Module, *, start_id: int,
                       excluded: frozenset[int] = frozenset(), shortlist: int = 32, top: int = 10,
                       max_batch_tokens: int = 4096) -> Reconstruction:
    """The attack on released sequences (one id per original token, in the model's vocabulary) at the given
    perturbed positions of each; ``excluded``: ids never guessed (the special tokens); ``start_id``: the context's
    first token (bos). Success counts are over every attacked position (exact binomial CIs)."""
    shortlist, top = check_positive_int("shortlist", shortlist), check_positive_int("top", top)
    if top > shortlist:
        raise ValueError(f"top ({top}) must be at most shortlist ({shortlist})")
    if not (len(original_ids) == len(released_ids) == len(positions)):
        raise ValueError("need one original, one released sequence and one list of positions per prompt")
    ranked, hits1, hitsk, trials = [], 0, 0, 0
    for original, released, where in zip(original_ids, released_ids, positions, strict=True):
        if len(original) != len(released):
            raise ValueError(f"a released sequence has {len(released)} tokens, its original {len(original)}")
        if not where:
            ranked.append(torch.zeros((0, top), dtype=torch.long))
            continue
        ids, _ = rank_candidates(model, released, where, start_id=start_id, excluded=excluded, shortlist=shortlist,
                                 max_batch_tokens=max_batch_tokens)
        truth = torch.tensor([original[i] for i in where], device=ids.device)
        hits1 += int((ids[:, 0] == truth).sum())
        hitsk += int((ids[:, :top] == truth[:, None]).any(dim=-1).sum())
        trials += len(where)
        ranked.append(ids[:, :top].cpu())
    return Reconstruction(ranked=tuple(ranked),
                          top1=AttackResult(name="llm-reconstruction-top1", successes=hits1, trials=trials,
                                            chance=None),
                          topk=AttackResult(name=f"llm-reconstruction-top{top}", successes=hitsk, trials=trials,
                                            chance=None))
