"""The embedding-row section of ``privlm bench attacks``: SnD's uploaded token rows and Text2Text's released tokens.

Both systems release MiniLM word-embedding rows after d_chi noise at level eta: SnD the noisy rows clipped to the
vocabulary's largest norm C (what ``privlm serve`` receives), Text2Text the id of the vocabulary row nearest to the
noisy row. Per eta, on the content tokens of the test tweets (the special tokens carry no text) and of the
canaried tweets, with one seeded noise draw shared by every attack:

- ``before``: what our tables used, nearest neighbour (SnD: on the rows with the clip scale undone,
  :func:`~privlm.attacks.undo_clip_scale`; Text2Text: the released id itself, top-1);
- ``strongest``: :func:`privlm.attacks.lm_inversion`, the likelihood of the release (SnD: the exact clipped law,
  eta estimated from the rows, not told; Text2Text: the d_chi surrogate with its scale fitted to releases the
  attacker simulates at the known eta) and a trigram prior in MiniLM's own vocabulary fitted on the attacker's
  public text (train tweets, WordNet, fortunes; never the test tweets): SmolLM2 cannot be the prior, its tokenizer
  differs from MiniLM's;
- ``other``: the same exact likelihood with no prior (prior weight 0), which separates the two effects.

Canaries: a secret is recovered exactly when every token of its span is guessed right.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from privlm.attacks import (
    AttackResult,
    DChiNoise,
    Inversion,
    LMInversionConfig,
    NGramPrior,
    ReleasedTokenNoise,
    clip_rate,
    estimate_eta,
    lm_inversion,
    undo_clip_scale,
)
from privlm.baselines.text2text import release_nearest
from privlm.mechanisms import DChiLaplace, make_generator, nearest_neighbours
from privlm.models import SplitModel
from privlm.snd.privatizer import SnDPrivatizer
from privlm_bench.attacks.data import AttackTexts, canary_recovered
from privlm_bench.attacks.rows import Row, attack_row
from privlm_bench.data.spans import span_token_positions


@dataclass(frozen=True)
class Attacked:
    """Content-token ids of the attacked texts: the test tweets, then the canaried ones (with the secret's
    positions)."""

    ids: tuple[tuple[int, ...], ...]
    n_test: int
    canary_positions: tuple[tuple[int, ...], ...]


def attacked_ids(model: SplitModel, texts: AttackTexts, *, max_tokens: int) -> Attacked:
    """Every text's content ids (at most ``max_tokens``; a canary is planted at the end of its text, so a canaried
    text is cut from the front instead, keeping the secret)."""
    tokenizer = model.require_tokenizer()
    test = [ids[:max_tokens] for ids in model.content_ids(texts.test.texts)]
    canaried, positions = [], []
    for planted in texts.canaries:
        encoded = tokenizer(planted.text, add_special_tokens=False, return_offsets_mapping=True)
        cut = max(0, len(encoded["input_ids"]) - max_tokens)
        canaried.append(encoded["input_ids"][cut:])
        positions.append(tuple(p - cut for p in span_token_positions(encoded["offset_mapping"], planted.start,
                                                                      planted.end) if p >= cut))
    return Attacked(ids=tuple(tuple(i) for i in [*test, *canaried]), n_test=len(test),
                    canary_positions=tuple(positions))


def fit_prior(tokenizer: Any, public: Sequence[str], vocab_size: int, *, order: int = 3) -> NGramPrior:
    """The attacker's language prior in the tokenizer's vocabulary (MiniLM's), from its public text only."""
    ids = tokenizer(list(public), add_special_tokens=False)["input_ids"]
    return NGramPrior.fit(ids, vocab_size, order=order)


def _canaries(guesses: Sequence[torch.Tensor], attacked: Attacked, truth: Sequence[torch.Tensor], name: str
              ) -> AttackResult:
    hits = sum(canary_recovered(guess.cpu(), true.cpu(), where) for where, guess, true in
               zip(attacked.canary_positions, guesses[attacked.n_test:], truth[attacked.n_test:], strict=True))
    return AttackResult(name=name, successes=hits, trials=len(attacked.canary_positions), chance=None)


def _split_rows(flat: torch.Tensor, lengths: Sequence[int]) -> list[torch.Tensor]:
    return list(flat.split(list(lengths)))


def _nn_guesses(rows: Sequence[torch.Tensor], vocabulary: torch.Tensor) -> list[torch.Tensor]:
    flat, _ = nearest_neighbours(torch.cat(list(rows)), vocabulary, k=1)
    return _split_rows(flat[:, 0], [len(r) for r in rows])


def _hits(guesses: Sequence[torch.Tensor], truth: Sequence[torch.Tensor], n: int, name: str, vocab_size: int
          ) -> AttackResult:
    right = sum(int((g.cpu() == t.cpu()).sum()) for g, t in zip(guesses[:n], truth[:n], strict=True))
    return AttackResult(name=name, successes=right, trials=sum(len(t) for t in truth[:n]), chance=1 / vocab_size)


@dataclass(frozen=True)
class EmbeddingSetting:
    etas: tuple[float, ...]
    beam: int = 8
    shortlist: int = 64
    seed: int = 0


def embedding_rows(model: SplitModel, texts: AttackTexts, prior: NGramPrior, setting: EmbeddingSetting, *,
                   max_tokens: int = 48) -> list[Row]:
    """Every row of the SnD and Text2Text sections, eta by eta."""
    attacked = attacked_ids(model, texts, max_tokens=max_tokens)
    truth = [torch.tensor(ids, device=model.device) for ids in attacked.ids]
    vocabulary = model.embedding_matrix
    rows: list[Row] = []
    for eta in setting.etas:
        rows += _snd(model, attacked, truth, vocabulary, prior, setting, eta)
        rows += _text2text(attacked, truth, vocabulary, prior, setting, eta, model)
    return rows


def _levels(system: str, eta: float) -> dict[str, Any]:
    return {"system": system, "setting": f"eta={eta:g}", "level_name": "eta", "level": eta}


@torch.inference_mode()
def _snd(model: SplitModel, attacked: Attacked, truth: Sequence[torch.Tensor], vocabulary: torch.Tensor,
         prior: NGramPrior, setting: EmbeddingSetting, eta: float) -> list[Row]:
    privatizer = SnDPrivatizer(model, eta=eta)
    generator = make_generator(setting.seed, device=model.device)
    released = []
    for ids in truth:  # one text at a time: rows are independent, so this is the upload's law
        clean = model.embed_tokens(ids.unsqueeze(0))
        noisy, _ = privatizer.privatize_embeddings(clean, torch.ones_like(ids).unsqueeze(0), generator=generator)
        released.append(noisy[0])
    clip_norm = model.max_embedding_norm
    rate_clipped = clip_rate(torch.cat(released), clip_norm)
    n, vocab_size = attacked.n_test, vocabulary.shape[0]
    start = time.perf_counter()
    undone = [undo_clip_scale(r, eta=eta, clip_norm=clip_norm, vocabulary=vocabulary) for r in released]
    nn = _nn_guesses(undone, vocabulary)
    nn_seconds = time.perf_counter() - start
    before = _hits(nn, truth, n, "nn-undo-clip", vocab_size)
    estimated = estimate_eta(torch.cat(released[:n]), vocabulary, clip_norm=clip_norm,
                             frequencies=prior.token_counts,
                             generator=make_generator(setting.seed + 1, device=model.device))
    noise = DChiNoise(eta=estimated, clip_norm=clip_norm)
    strongest = lm_inversion(released, truth, vocabulary, noise=noise, prior=prior, name="lm-inversion",
                             config=LMInversionConfig(beam=setting.beam, shortlist=setting.shortlist))
    likelihood_only = lm_inversion(released, truth, vocabulary, noise=noise, prior=prior, name="exact-likelihood",
                                   config=LMInversionConfig(beam=1, shortlist=setting.shortlist, prior_weight=0.0))
    common: dict[str, Any] = {**_levels("snd", eta), "clip_rate": rate_clipped, "eta_estimated": estimated}
    test_only: dict[str, Any] = {"n_test": n}
    return [
        attack_row(before, **common, target="tokens", role="before", seconds=nn_seconds),
        attack_row(_test_part(strongest, truth, n, vocab_size), **common, target="tokens", role="strongest",
                   **test_only),
        attack_row(_test_part(likelihood_only, truth, n, vocab_size), **common, target="tokens", role="other",
                   **test_only),
        attack_row(_canaries(nn, attacked, truth, "nn-undo-clip"), **common, target="canaries", role="before"),
        attack_row(_canaries(strongest.guesses, attacked, truth, "lm-inversion"), **common, target="canaries",
                   role="strongest"),
    ]


def _test_part(inversion: Inversion, truth: Sequence[torch.Tensor], n: int, vocab_size: int) -> AttackResult:
    """The inversion's token recovery on the test tweets alone (the canaried texts are scored on their secrets)."""
    scored = _hits(inversion.guesses, truth, n, inversion.result.name, vocab_size)
    return AttackResult(name=scored.name, successes=scored.successes, trials=scored.trials, chance=scored.chance,
                        details=inversion.result.details)


@torch.inference_mode()
def _text2text(attacked: Attacked, truth: Sequence[torch.Tensor], vocabulary: torch.Tensor, prior: NGramPrior,
               setting: EmbeddingSetting, eta: float, model: SplitModel) -> list[Row]:
    generator = make_generator(setting.seed, device=vocabulary.device)
    flat = release_nearest(DChiLaplace(eta=eta), vocabulary[torch.cat(list(truth))], vocabulary, generator=generator)
    released_ids = _split_rows(flat, [len(t) for t in truth])
    n, vocab_size = attacked.n_test, vocabulary.shape[0]
    before = _hits(released_ids, truth, n, "released-id", vocab_size)
    rows_released = [vocabulary[ids] for ids in released_ids]
    noise = ReleasedTokenNoise.calibrated(vocabulary, eta, frequencies=prior.token_counts,
                                          generator=make_generator(setting.seed + 1, device=vocabulary.device))
    strongest = lm_inversion(rows_released, truth, vocabulary, noise=noise, prior=prior, name="lm-inversion-surrogate",
                             config=LMInversionConfig(beam=setting.beam, shortlist=setting.shortlist))
    common = {**_levels("text2text", eta), "surrogate_scale": noise.scale}
    return [
        attack_row(before, **common, target="tokens", role="before"),
        attack_row(_test_part(strongest, truth, n, vocab_size), **common, target="tokens", role="strongest"),
        attack_row(_canaries(released_ids, attacked, truth, "released-id"), **common, target="canaries",
                   role="before"),
        attack_row(_canaries(strongest.guesses, attacked, truth, "lm-inversion-surrogate"), **common,
                   target="canaries", role="strongest"),
    ]
