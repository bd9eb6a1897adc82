"""cape-public: a context-aware token mechanism whose context is public, so each perturbed token costs exactly eps.

At each perturbed position i, the causal device model reads the *released* prefix [bos] r_0 .. r_{i-1} (the
non-sensitive tokens as they are, the perturbed ones as drawn), never a private token. Its next-token
distribution pi_i over the candidate set C is then a function of earlier outputs only: public. The token sent is
drawn from

    P(y | x_i)  proportional to  mu_i(y) exp(eps s(x_i, y) / 2),      mu_i = (pi_i restricted to top_p)^tau

with s(x_i, y) in [0, 1] Cape's per-token normalised embedding similarity (:func:`privlm.cape.utility.
distance_scores`) and the top-p restriction the smallest set of candidates holding at least ``top_p`` of pi_i's
mass (computed from pi_i alone). This is the exponential mechanism over a public base measure
(:class:`~privlm.mechanisms.BaseMeasureExponentialMechanism`, sensitivity 1).

Guarantee (docs/cape.md proves it). Neighbouring relation: Cape's, two prompts with the same token count and the
same non-sensitive tokens in the same places (both are revealed). Given the released prefix, position i is
eps-DP in x_i, and it reads no other private token; by adaptive composition the whole release is (n eps)-DP,
n the number of perturbed positions: for every released sequence r,

    ln P(r | x) - ln P(r | x') = sum_i ln P_i(r_i | x_i, r_<i) - ln P_i(r_i | x'_i, r_<i)  <=  n eps.

No ln |C| or ln N_b term, since the context is not private. ``tau`` and ``top_p`` change utility, never the bound.
Also revealed: timing (one decode step per perturbed position). A prompt longer than the device model's context is
cut into chunks, each released from its own bos.

Cost: one forward pass over the released prefix with a KV cache, in one step per perturbed position; the prompts
(chunks) of a batch advance together, each step feeding every row its run of tokens since its last draw.

Rounds (``rounds=k``): at most k forward passes, whatever n. The perturbed positions are drawn in rounds: a position's
round is its index within its run of consecutive perturbed positions, capped at k - 1 (a run's first token in round
0, its second in round 1, ...). In round r the device model reads the chunk with every position of round >= r
replaced by a fixed ``placeholder`` token and every earlier round's position as released: public again (the
non-sensitive tokens, the layout of the perturbed positions, which both are revealed, and earlier outputs), so the
bound is the same n eps. ``rounds=None`` (the default) is the released-prefix context above: each position its
own round, in order.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from privlm.accounting import Ledger
from privlm.cape.utility import Query, candidate_columns, context_room, device_logits, distance_scores, wrapping
from privlm.mechanisms import BaseMeasureExponentialMechanism, PrivacyUnit
from privlm.mechanisms.randomness import resolve_generator
from privlm.models import check_texts
from privlm.models.batching import pad_ids
from privlm.models.kv_cache import cache_of, with_cache
from privlm.models.language import LanguageModel
from privlm.models.perturbation import (
    NOTHING_SPENT,
    Accounting,
    PerturbedPrompt,
    PromptReport,
    TokenOutcome,
    charge_prompts,
    perturb_one,
    released_text,
    token_records,
)
from privlm.models.prompts import NonSensitiveTokens, PromptTokens, tokenize_prompt
from privlm.models.text_mechanisms import check_epsilon
from privlm.models.vocabulary import CandidateVocabulary
from privlm.validation import check_in_interval

PRIVLM = Accounting.PRIVLM
PLACEHOLDERS = (" ___", " _", "_")  # a blank, in the order tried when no placeholder is given
GUARANTEE = ("privlm: the 'privlm' total is an epsilon-DP bound for this release against any neighbouring prompt "
             "(same token count, same non-sensitive tokens in the same places; both are revealed): each perturbed "
             "position is eps-DP given {context}, which is public, and positions compose adaptively")
RELEASED_PREFIX = "the released prefix"
EARLIER_ROUNDS = "the tokens released in earlier rounds (a placeholder where a position is not released yet)"


def public_base(logits: torch.Tensor, *, tau: float, top_p: float) -> torch.Tensor:
    """ln mu = tau ln pi on the top-p set of pi = softmax(``logits``), -inf elsewhere (float64, rows of ``logits``).

    The top-p set is the smallest set of the most likely candidates whose mass reaches ``top_p`` (at least one).
    """
    log_pi = torch.log_softmax(logits.to(torch.float64), dim=-1)
    if top_p < 1.0:
        order = log_pi.argsort(dim=-1, descending=True)
        mass_before = log_pi.gather(-1, order).exp().cumsum(dim=-1) - log_pi.gather(-1, order).exp()
        outside = torch.zeros_like(log_pi, dtype=torch.bool).scatter_(-1, order, mass_before >= top_p)
        log_pi = log_pi.masked_fill(outside, -math.inf)
    return torch.where(torch.isneginf(log_pi), log_pi, tau * log_pi)


@dataclass
class _Chunk:
    """One chunk of one prompt being released: its original ids, its perturbed positions and what was drawn."""

    prompt: int
    offset: int  # the chunk's first token, in the prompt
    ids: list[int]
    positions: list[int]  # local, ascending
    released: list[int]
    rounds: list[int]  # the round of each position (empty without rounds)


def run_rounds(positions: Sequence[int], rounds: int) -> list[int]:
    """Each position's round: its index within its run of consecutive positions, capped at ``rounds`` - 1."""
    out, index = [], 0
    for k, position in enumerate(positions):
        index = index + 1 if k and position == positions[k - 1] + 1 else 0
        out.append(min(index, rounds - 1))
    return out


def round_query(released: Sequence[int], positions: Sequence[int], rounds_of: Sequence[int], round_: int,
                placeholder: int) -> Query:
    """What round ``round_`` reads of a chunk: ``released`` with every position of that round or later replaced by
    ``placeholder`` (so no private token is read), and the positions it draws."""
    ids = list(released)
    for position, r in zip(positions, rounds_of, strict=True):
        if r >= round_:
            ids[position] = placeholder
    return Query(ids=tuple(ids), positions=tuple(p for p, r in zip(positions, rounds_of, strict=True) if r == round_))


def placeholder_id(device_model: LanguageModel, placeholder: str | None) -> int:
    """The token id of ``placeholder`` (one token of the device model), or of the first of PLACEHOLDERS that is one,
    else of its unknown token."""
    tokenizer = device_model.tokenizer
    for text in (placeholder,) if placeholder is not None else PLACEHOLDERS:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) == 1:
            return int(ids[0])
    if placeholder is None and tokenizer.unk_token_id is not None:
        return int(tokenizer.unk_token_id)
    raise ValueError(f"the placeholder must be one token of the device model; {placeholder!r} is not"
                     if placeholder is not None else "the device model's tokenizer has no one-token placeholder "
                     f"({', '.join(map(repr, PLACEHOLDERS))}) and no unknown token: pass placeholder=")


def _check_causal(device_model: LanguageModel) -> None:
    if device_model.kind != "causal":
        raise ValueError("cape-public conditions the device model on the released prefix, which a masked LM "
                         f"cannot do ({device_model.name} is {device_model.kind}): use a causal "
                         "device model, or cape, whose masked-LM context is private")


@dataclass(frozen=True, kw_only=True)
class PublicContextOptions:
    """cape-public's knobs. ``tau`` >= 0 and ``top_p`` in (0, 1]: the public base measure (see the module doc; the
    defaults, tau 2 and top-p 1, are ``privlm bench chat-quality``'s choice on its training prompts); ``rounds``: None
    (one decode step per perturbed position, on the released prefix) or k >= 1 (at most k forward passes, with
    ``placeholder``, one token, where a position is not released yet; see the module doc; None: the first of
    PLACEHOLDERS that is one token of the device model, else its unknown token); ``non_sensitive``: the tokens that
    pass unchanged (None: English stopwords and punctuation); ``batch_size``: chunks per forward pass."""

    tau: float = 2.0
    top_p: float = 1.0
    rounds: int | None = None
    placeholder: str | None = None
    non_sensitive: NonSensitiveTokens | None = None
    batch_size: int = 16

    def __post_init__(self) -> None:
        object.__setattr__(self, "tau", check_in_interval("tau", self.tau, 0, math.inf, high_open=True))
        object.__setattr__(self, "top_p", check_in_interval("top_p", self.top_p, 0, 1, low_open=True))
        if not isinstance(self.batch_size, int) or isinstance(self.batch_size, bool) or self.batch_size < 1:
            raise ValueError(f"batch_size must be an integer >= 1, got {self.batch_size!r}")
        rounds = self.rounds
        if rounds is not None and (not isinstance(rounds, int) or isinstance(rounds, bool) or rounds < 1):
            raise ValueError(f"rounds must be None or an integer >= 1, got {rounds!r}")


class PublicContextCape:
    """cape-public on a causal device model. ``epsilon``: per perturbed token (what the ledger is charged per
    token); ``options``: the base measure, the rounds and the rest (:class:`PublicContextOptions`);
    ``generator``: the only source of randomness (OS-seeded when None); ``ledger``: charged
    (perturbed tokens) x epsilon per prompt under ``principal``, before anything is drawn."""

    name = "cape-public"
    unit = PrivacyUnit.EPSILON

    def __init__(self, device_model: str | LanguageModel = "smollm2", *, epsilon: float,
                 options: PublicContextOptions | None = None, generator: torch.Generator | None = None,
                 ledger: Ledger | None = None, principal: str = "local", device: str = "auto") -> None:
        self.epsilon = check_epsilon(epsilon)
        options = options or PublicContextOptions()
        self.tau, self.top_p, self.rounds = options.tau, options.top_p, options.rounds
        self.batch_size = options.batch_size
        self.device_model = (device_model if isinstance(device_model, LanguageModel)
                             else LanguageModel.from_pretrained(device_model, device=device))
        _check_causal(self.device_model)
        self.room = context_room(self.device_model)
        self.placeholder_id = -1 if options.rounds is None else placeholder_id(self.device_model, options.placeholder)
        self.non_sensitive = options.non_sensitive or NonSensitiveTokens.english()
        self.generator = resolve_generator(generator, self.device_model.device)
        self.ledger, self.principal = ledger, principal

    @staticmethod
    def check(device_model: LanguageModel, *, epsilon: float, options: PublicContextOptions | None = None) -> None:
        """Refuse what the constructor would refuse for these arguments, building nothing: epsilon out of range, a
        masked device model, a placeholder that is not one token of it."""
        check_epsilon(epsilon)
        _check_causal(device_model)
        options = options or PublicContextOptions()
        if options.rounds is not None:
            placeholder_id(device_model, options.placeholder)

    @property
    def vocabulary(self) -> CandidateVocabulary:
        return self.device_model.vocabulary

    def __repr__(self) -> str:
        return (f"PublicContextCape({self.device_model.name}, |C|={self.vocabulary.size}, epsilon={self.epsilon:g}, "
                f"tau={self.tau:g}, top_p={self.top_p:g}"
                + (f", rounds={self.rounds}" if self.rounds is not None else "") + ")")

    def mechanism(self, logits: torch.Tensor) -> BaseMeasureExponentialMechanism:
        """The mechanism at positions whose device-model logits over C (given their released prefixes) are
        ``logits``: its utility rows are the similarities s(x_i, .)."""
        return BaseMeasureExponentialMechanism(epsilon=self.epsilon, sensitivity=1.0,
                                               log_base=public_base(logits, tau=self.tau, top_p=self.top_p))

    def tokenize(self, text: str) -> PromptTokens:
        return tokenize_prompt(self.vocabulary.tokenizer, text, self.non_sensitive)

    def similarity(self, token_ids: Sequence[int]) -> torch.Tensor:
        """(n, |C|) float32: s(x, y) in [0, 1] for each token x of ``token_ids``."""
        if not token_ids:
            return torch.zeros((0, self.vocabulary.size), device=self.vocabulary.device)
        ids = torch.tensor(list(token_ids), dtype=torch.long, device=self.vocabulary.device)
        return distance_scores(self.vocabulary.distances(ids))

    # --- release ------------------------------------------------------------------------------
    def perturb(self, text: str) -> PerturbedPrompt:
        return perturb_one(self, text)

    def perturb_batch(self, texts: Sequence[str]) -> list[PerturbedPrompt]:
        """Charge every prompt (perturbed tokens) x epsilon in one transaction, then release them all."""
        check_texts(texts)
        prompts = [self.tokenize(text) for text in texts]
        totals = [len(p.sensitive_positions) * self.epsilon for p in prompts]
        spent = charge_prompts(self.ledger, self.principal, self.unit, totals, note=self.name)
        chunks = [chunk for i, p in enumerate(prompts) for chunk in self._chunks(i, p)]
        release = self._release_chunks if self.rounds is None else self._release_in_rounds
        for start in range(0, len(chunks), self.batch_size):
            release(chunks[start:start + self.batch_size])
        released: list[list[int]] = [[] for _ in prompts]
        for chunk in chunks:
            released[chunk.prompt].extend(chunk.released)
        return [self._report(p, r, total, charged)
                for p, r, total, charged in zip(prompts, released, totals, spent, strict=True)]

    def _chunks(self, index: int, prompt: PromptTokens) -> list[_Chunk]:
        chunks = []
        for offset in range(0, max(len(prompt), 1), self.room):
            ids = list(prompt.ids[offset:offset + self.room])
            positions = [i - offset for i in prompt.sensitive_positions if offset <= i < offset + self.room]
            rounds = [] if self.rounds is None else run_rounds(positions, self.rounds)
            chunks.append(_Chunk(prompt=index, offset=offset, ids=ids, positions=positions, released=list(ids),
                                 rounds=rounds))
        return chunks

    @torch.no_grad()
    def _release_chunks(self, chunks: list[_Chunk]) -> None:
        """Draw every perturbed position of ``chunks``, left to right, one decode step per position (all chunks
        advance together; a chunk with no position left feeds padding)."""
        model, (bos,) = self.device_model, wrapping(self.device_model)[0]
        pad = int(model.tokenizer.pad_token_id if model.tokenizer.pad_token_id is not None else bos)
        cache, mask, seen = None, None, [0] * len(chunks)  # seen: real tokens in the cache, per chunk
        similarity = self._similarity_rows(chunks)
        for step in range(max(len(c.positions) for c in chunks)):
            runs = [self._run(c, step, bos) for c in chunks]
            ids, step_mask = _left_padded(runs, pad, model.device)
            mask = step_mask if mask is None else torch.cat([mask, step_mask], dim=1)
            positions = (torch.tensor(seen, device=model.device)[:, None] + step_mask.cumsum(dim=1) - 1).clamp_min(0)
            out = model.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                              logits_to_keep=1, **with_cache(model.model, cache))
            cache = cache_of(model.model, out)
            seen = [n + len(run) for n, run in zip(seen, runs, strict=True)]
            active = [j for j, c in enumerate(chunks) if step < len(c.positions)]
            logits = candidate_columns(out.logits[active, -1], self.vocabulary)
            utility = torch.stack([similarity[chunks[j].ids[chunks[j].positions[step]]] for j in active])
            draws = self.mechanism(logits).sample(utility, generator=self.generator)
            for j, draw in zip(active, self.vocabulary.candidate_ids[draws].tolist(), strict=True):
                chunks[j].released[chunks[j].positions[step]] = int(draw)

    @torch.no_grad()
    def _release_in_rounds(self, chunks: list[_Chunk]) -> None:
        """Draw every perturbed position of ``chunks`` in at most ``rounds`` forward passes (one per round, every
        chunk with a position in that round in it)."""
        similarity = self._similarity_rows(chunks)
        for round_ in range(max((max(c.rounds, default=-1) for c in chunks), default=-1) + 1):
            asked = [(c, round_query(c.released, c.positions, c.rounds, round_, self.placeholder_id)) for c in chunks]
            asked = [(c, query) for c, query in asked if query.positions]
            logits = device_logits(self.device_model, [query for _, query in asked])
            utility = torch.stack([similarity[c.ids[p]] for c, query in asked for p in query.positions])
            draws = iter(self.vocabulary.candidate_ids[self.mechanism(logits).sample(utility, generator=self.generator)]
                         .tolist())
            for c, query in asked:
                for position in query.positions:
                    c.released[position] = int(next(draws))

    def _similarity_rows(self, chunks: list[_Chunk]) -> dict[int, torch.Tensor]:
        """s(x, .) for every distinct original token at a perturbed position of ``chunks``."""
        originals = sorted({c.ids[i] for c in chunks for i in c.positions})
        return dict(zip(originals, self.similarity(originals), strict=True))

    @staticmethod
    def _run(chunk: _Chunk, step: int, bos: int) -> list[int]:
        """The tokens a chunk feeds at ``step``: what was released since its last draw (bos first), up to the
        position to draw; nothing once it has drawn every position."""
        if step >= len(chunk.positions):
            return []
        start = 0 if step == 0 else chunk.positions[step - 1]
        return [*([bos] if step == 0 else []), *chunk.released[start:chunk.positions[step]]]

    def _report(self, prompt: PromptTokens, released: list[int], total: float,
                charged: float | None) -> PerturbedPrompt:
        outcomes = [TokenOutcome.UNKNOWN if unknown else TokenOutcome.NON_SENSITIVE if kept else TokenOutcome.PERTURBED
                    for kept, unknown in zip(prompt.non_sensitive, prompt.unknown, strict=True)]
        epsilon = [None if kept else self.epsilon for kept in prompt.non_sensitive]
        records = token_records(prompt, self.vocabulary, released, outcomes, epsilon=epsilon,
                                chunks=[i // self.room for i in range(len(prompt))])
        notes = [] if prompt.sensitive_positions else [NOTHING_SPENT]
        if prompt.uncovered:
            notes.append(f"{len(prompt.uncovered)} character span(s) no token covers were dropped by the tokenizer "
                         "and are not in the released text (see uncovered)")
        report = PromptReport(mechanism=self.name, tokens=records, candidate_set_size=self.vocabulary.size,
                              accounting={PRIVLM: total},
                              guarantee=GUARANTEE.format(context=RELEASED_PREFIX if self.rounds is None
                                                         else EARLIER_ROUNDS),
                              chunks=max(1, math.ceil(len(prompt) / self.room)), uncovered=prompt.uncovered,
                              spent=charged, notes=tuple(notes))
        return PerturbedPrompt(text=released_text(self.vocabulary, released), report=report)

    # --- the exact distributions, for checks and attacks ----------------------------------------
    @torch.no_grad()
    def position_log_probabilities(self, text: str, released_ids: Sequence[int]) -> tuple[tuple[int, ...],
                                                                                         torch.Tensor]:
        """The perturbed positions of ``text`` and, at each, the mechanism's exact log-probabilities over C
        (float64) given what it reads of ``released_ids``: the released prefix ``released_ids[:i]`` (one
        teacher-forced forward pass per chunk), or with rounds, round r's context (one pass per chunk and round).

        ``released_ids``: a release of ``text`` (or of a neighbour): one id per token. With them,
        ln P(r | x) = sum over the positions of the row's entry at r_i.
        """
        prompt = self.tokenize(text)
        if len(released_ids) != len(prompt):
            raise ValueError(f"need one released id per token ({len(prompt)}), got {len(released_ids)}")
        positions = tuple(prompt.sensitive_positions)
        if not positions:
            return positions, torch.zeros((0, self.vocabulary.size), dtype=torch.float64)
        queries: list[Query] = []
        order: list[int] = []  # the prompt position of each logits row
        for offset in range(0, len(prompt), self.room):
            local = [i - offset for i in positions if offset <= i < offset + self.room]
            ids = [int(i) for i in released_ids[offset:offset + self.room]]
            if not local:
                continue
            if self.rounds is None:
                asked = [Query(ids=tuple(ids), positions=tuple(local))]
            else:
                rounds_of = run_rounds(local, self.rounds)
                asked = [round_query(ids, local, rounds_of, r, self.placeholder_id) for r in range(max(rounds_of) + 1)]
            queries.extend(asked)
            order.extend(offset + p for query in asked for p in query.positions)
        logits = device_logits(self.device_model, queries)[torch.tensor(order).argsort()]
        utility = self.similarity([prompt.ids[i] for i in positions])
        return positions, self.mechanism(logits).log_probabilities(utility)


def _left_padded(runs: list[list[int]], pad: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Runs of different lengths as one (rows, longest) batch padded on the left, so that every row that fed a
    token ends on it (the logits kept are the last column's); a row with no run is all padding."""
    width = max(len(run) for run in runs)
    ids, mask = pad_ids([[pad] * (width - len(run)) + run for run in runs], pad, device)
    starts = torch.tensor([width - len(run) for run in runs], device=device)
    return ids, (torch.arange(width, device=device)[None, :] >= starts[:, None]).to(mask.dtype)
