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

**Knowing the mechanism** (``released_log_odds``). The LM alone ignores what the release says about position i:
a mechanism that keeps most tokens (InferDPT, SANTEXT+) makes r_i the likeliest original whatever the context. The
Bayes attacker ranks by log P(r_i | y) + score(y). Word-level mechanisms have no tractable P(r_i | y) over the
candidates, so privlm models it by one number: P(r_i | y) is rho when y = r_i and (1 - rho) / m otherwise, which
adds the log-odds b = log(rho m / (1 - rho)) to the released candidate's score and nothing to the others. b is
fitted by :func:`fit_released_log_odds` on releases the attacker makes itself (it knows the mechanism and epsilon)
of its own public text: the b that maximises top-1 recovery there. b = 0 is the LM alone; b = +inf reads the
release as it is (the retention; the grid stands for it with 1e4), so with b fitted on the attacker's data the
attack is at least as good as the better of the two on data like its own.

Whole-prompt restoration (the paper's second attack; it needs no token alignment, so it also applies to a paraphrase
such as DP-Prompt's): a chat model is asked, with the fixed instruction :data:`REWRITE_INSTRUCTION` ("Some words of
the text below were replaced by other words. Rewrite it as the original text. Answer with the rewritten text only."
followed by the released text), to write the original back, greedily and in a bounded number of tokens. The rewrite
h is scored against the original x by Rouge-L F1 on Rouge's own words (rouge-score's default tokenisation: lower
case, every maximal run of [a-z0-9] one word),

    F1(x, h) = 2 P R / (P + R),   P = LCS(x, h) / |h|,   R = LCS(x, h) / |x|,

and beside it the released text r itself, F1(x, r): what an attacker who only reads the release gets. Both are
means over prompts with a bootstrap interval (:func:`~privlm.attacks.results.score_result`).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from privlm.attacks.results import AttackResult, ScoreResult, score_result
from privlm.attacks.text_metrics import rouge_l_f1, rouge_words
from privlm.models.chat import ChatModel, check_sampling
from privlm.models.kv_cache import cache_of, with_cache
from privlm.validation import check_positive_int

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


@dataclass(frozen=True, kw_only=True)
class LLMReconstructionConfig:
    """The candidates and their ranking in :func:`llm_reconstruction`, :func:`fit_released_log_odds` and
    :func:`rank_candidates`."""

    shortlist: int = 32  # candidates per position: the likeliest under the left context
    top: int = 10  # top-k success: the original among the ``top`` best candidates (llm_reconstruction only)
    released_log_odds: float = 0.0  # b, the mechanism's term (module docstring); 0: the LM alone
    max_batch_tokens: int = 4096  # fed tokens per forward pass


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
                    excluded: frozenset[int], include_released: bool = True,
                    config: LLMReconstructionConfig = LLMReconstructionConfig()) -> tuple[torch.Tensor, torch.Tensor]:
    """Candidates of each position of ``positions`` in ``sequence`` (no start token), ranked by the whole-sequence
    log-likelihood: ids (m, k) and their scores (m, k), best first. ``include_released``: the released token is
    always a candidate (in place of the last of the shortlist when the left context does not rank it).
    ``config``: the shortlist k, the released token's log-odds and the tokens per pass (``top`` is not used).

    One pass over the released sequence gives the shortlists and the log-likelihood of every prefix, which the
    candidates of a position share; then, per position, the candidates and their right context go through the model
    on that pass's key/value cache cut to the prefix, in passes of at most ``config.max_batch_tokens`` fed tokens."""
    shortlist, released_log_odds = config.shortlist, config.released_log_odds
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
        per_pass = max(1, config.max_batch_tokens // rows.shape[1])
        right = [_suffix_log_likelihood(model, cache, a, part) for part in rows.split(per_pass)]  # prefix: bos..r_{i-1}
        scores[row, changed] += torch.cat(right)
    if not math.isfinite(released_log_odds):  # inf * 0 is NaN, which would sort first
        raise ValueError(f"released_log_odds must be finite (1e4 reads the release), got {released_log_odds!r}")
    scores = scores + released_log_odds * (candidates == base[at, None])  # log P(r_i | y): see the module docstring
    ordered, order = scores.sort(dim=-1, descending=True, stable=True)  # a tie keeps the left context's order
    return candidates.gather(1, order), ordered


def llm_reconstruction(original_ids: Sequence[Sequence[int]], released_ids: Sequence[Sequence[int]],
                       positions: Sequence[Sequence[int]], model: torch.nn.Module, *, start_id: int,
                       excluded: frozenset[int] = frozenset(),
                       config: LLMReconstructionConfig = LLMReconstructionConfig()) -> Reconstruction:
    """The attack on released sequences (one id per original token, in the model's vocabulary) at the given
    perturbed positions of each; ``excluded``: ids never guessed (the special tokens); ``start_id``: the context's
    first token (bos); ``config.released_log_odds``: the mechanism's term (module docstring; 0: the LM alone, and
    the results are named ``llm-reconstruction``, else ``llm-reconstruction-aware``). Success counts are over every
    attacked position (exact binomial CIs)."""
    shortlist, top = check_positive_int("shortlist", config.shortlist), check_positive_int("top", config.top)
    released_log_odds = config.released_log_odds
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
        ids, _ = rank_candidates(model, released, where, start_id=start_id, excluded=excluded, config=config)
        truth = torch.tensor([original[i] for i in where], device=ids.device)
        hits1 += int((ids[:, 0] == truth).sum())
        hitsk += int((ids[:, :top] == truth[:, None]).any(dim=-1).sum())
        trials += len(where)
        ranked.append(ids[:, :top].cpu())
    name = "llm-reconstruction" if released_log_odds == 0 else "llm-reconstruction-aware"
    details = {"released_log_odds": released_log_odds, "shortlist": shortlist}
    return Reconstruction(ranked=tuple(ranked),
                          top1=AttackResult(name=f"{name}-top1", successes=hits1, trials=trials, chance=None,
                                            details=details),
                          topk=AttackResult(name=f"{name}-top{top}", successes=hitsk, trials=trials, chance=None,
                                            details=details))


LOG_ODDS_GRID = (*(x / 2 for x in range(-8, 49)), 1e4)  # -4 .. 24 nats by halves, and "read the release" (1e4)


def fit_released_log_odds(original_ids: Sequence[Sequence[int]], released_ids: Sequence[Sequence[int]],
                          positions: Sequence[Sequence[int]], model: torch.nn.Module, *, start_id: int,
                          excluded: frozenset[int] = frozenset(), grid: Sequence[float] = LOG_ODDS_GRID,
                          config: LLMReconstructionConfig = LLMReconstructionConfig()) -> float:
    """The log-odds b of the released token (module docstring) that recovers the most originals top-1 on the
    attacker's own releases (originals it knows): one ranking pass at b = 0, then every b of ``grid`` re-ranks the
    same scores. Ties go to the b nearest 0 (the least trust in the release). ``config`` gives the shortlist and
    the tokens per pass (its ``released_log_odds`` is what this fits, so it is not used)."""
    if not grid or not all(math.isfinite(float(b)) for b in grid):
        raise ValueError("grid must hold at least one log-odds, all finite (1e4 reads the release)")
    at_zero = replace(config, released_log_odds=0.0)
    hits = torch.zeros(len(grid), dtype=torch.long)
    offsets = torch.tensor([float(b) for b in grid], dtype=torch.float64)
    for original, released, where in zip(original_ids, released_ids, positions, strict=True):
        if not where:
            continue
        ids, scores = rank_candidates(model, released, where, start_id=start_id, excluded=excluded, config=at_zero)
        kept = (ids == torch.tensor([released[i] for i in where], device=ids.device)[:, None]).cpu().double()
        truth = torch.tensor([original[i] for i in where])
        shifted = scores.cpu().double()[None] + offsets[:, None, None] * kept[None]  # (grid, m, k)
        best = ids.cpu().gather(1, shifted.argmax(dim=-1).T).T  # (grid, m): the top-1 under each b
        hits += (best == truth[None]).sum(dim=-1)
    order = sorted(range(len(grid)), key=lambda j: (-int(hits[j]), abs(float(grid[j]))))
    return float(grid[order[0]])


# ------------------------------------------------------------------------------------------ whole-prompt restoration
REWRITE_INSTRUCTION = ("Some words of the text below were replaced by other words. Rewrite it as the original text. "
                       "Answer with the rewritten text only.\n\n{text}")
Rewriter = Callable[[Sequence[str]], Sequence[str]]
"""The attacker's chat model: user messages in, its answers out, in order."""


def chat_rewriter(chat: ChatModel, *, max_tokens: int = 96, batch_size: int = 16) -> Rewriter:
    """``chat``'s greedy answers (no randomness) of at most ``max_tokens`` tokens, ``batch_size`` messages a pass.

    The messages are rendered by ``chat``'s template (:meth:`ChatModel.prompt_ids`), left-padded into one batch
    and decoded greedily by the model's own ``generate`` until each meets an end token or ``max_tokens``: what
    :meth:`ChatModel.generate` at temperature 0 answers, but a batch at a time (a decode step of a small model costs
    nearly the same for one row as for sixteen). ``max_tokens`` and each prompt's length are checked as
    :meth:`ChatModel.stream` checks them: a :class:`~privlm.models.chat.ChatRequestError` (a ValueError), or its
    subclass :class:`~privlm.models.chat.ContextLengthError` for a prompt that leaves fewer than ``max_tokens``
    places in the context."""
    max_tokens = check_sampling(max_tokens=max_tokens, temperature=0.0, top_p=1.0, stop=(),
                                context_length=chat.context_length).max_tokens
    batch_size = check_positive_int("batch_size", batch_size)
    model: Any = chat.language_model.model  # a Hugging Face causal LM: its generate()
    tokenizer = chat.language_model.tokenizer
    eos = sorted(chat.eos_ids)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]

    @torch.inference_mode()
    def rewrite(messages: Sequence[str]) -> list[str]:
        answers: list[str] = []
        for start in range(0, len(messages), batch_size):
            prompts = [chat.checked_prompt_ids([{"role": "user", "content": m}], max_tokens=max_tokens)
                       for m in messages[start:start + batch_size]]
            width = max(len(p) for p in prompts)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=chat.device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=chat.device)
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=max_tokens,
                                 eos_token_id=eos, pad_token_id=pad, temperature=None, top_p=None, top_k=None)
            answers += [_until_end(row.tolist(), eos, tokenizer) for row in out[:, width:]]
        return answers

    return rewrite


def _until_end(ids: list[int], eos: Sequence[int], tokenizer: Any) -> str:
    """The text of ``ids`` up to its first end token (a finished row of a batch is padded after it)."""
    end = next((i for i, token in enumerate(ids) if token in eos), len(ids))
    return str(tokenizer.decode(ids[:end], skip_special_tokens=True, clean_up_tokenization_spaces=False))


@dataclass(frozen=True)
class PromptRestoration:
    """The rewrites, their Rouge-L F1 against the originals (``restored``) and the released texts' (``released``)."""

    rewrites: tuple[str, ...]
    restored: ScoreResult
    released: ScoreResult


def prompt_restoration(originals: Sequence[str], released: Sequence[str], rewrite: Rewriter, *,
                       instruction: str = REWRITE_INSTRUCTION, seed: int = 0,
                       confidence: float = 0.95) -> PromptRestoration:
    """Ask ``rewrite`` (e.g. :func:`chat_rewriter`) for the original of each released text (``instruction`` with
    ``{text}`` filled in) and score each rewrite, and each released text as it is, by Rouge-L F1 against its
    original; ``seed`` fixes the bootstrap's resamples."""
    if len(originals) != len(released) or not originals:
        raise ValueError(f"need one released text per original, and at least one: got {len(originals)} originals "
                         f"and {len(released)} released texts")
    if "{text}" not in instruction:
        raise ValueError("instruction must hold {text}, where the released text goes")
    rewrites = tuple(str(text) for text in rewrite([instruction.replace("{text}", text) for text in released]))
    if len(rewrites) != len(released):
        raise ValueError(f"the rewriter answered {len(rewrites)} of {len(released)} messages")
    truth = [rouge_words(text) for text in originals]

    def scored(name: str, texts: Sequence[str]) -> ScoreResult:
        values = [rouge_l_f1(x, rouge_words(h)) for x, h in zip(truth, texts, strict=True)]
        return score_result(name, values, seed=seed, confidence=confidence,
                            details={"tokenisation": "rouge words: lower case, runs of [a-z0-9]"})

    return PromptRestoration(rewrites=rewrites, restored=scored("prompt-restoration-rouge-l", rewrites),
                             released=scored("released-text-rouge-l", released))
