"""``privlm bench attacks``, released prompts: the strongest attacks on what Cape and its baselines send a chat API.

Each mechanism releases, in this process and seeded, the attacked test tweets and the canaried ones
(:func:`privlm_bench.attacks.data.attack_texts`) with SmolLM2-135M-Instruct as the device model (B calibrated on the
chat bench's public sample prompts, as the gateway is). The attacker holds the released texts, knows the mechanism and
its epsilon, and has the same small model. Rows per (mechanism, epsilon), ``system`` "cape", ``setting`` the mechanism:

- ``tokens`` (aligned mechanisms): at ``attack_positions`` perturbed positions per tweet (drawn by the seed), "before"
  = KNN top-10 on the released ids (:func:`~privlm.attacks.token_id_inversion`, k = 10: the Cape paper's attack and
  our tables'; its rate over every perturbed position is in ``knn_all_rate``), "strongest" = LM reconstruction
  that knows the mechanism, top-10 (ten guesses each: like for like; :func:`~privlm.attacks.llm_reconstruction`
  with ``released_log_odds`` fitted by :func:`~privlm.attacks.fit_released_log_odds` on the attacker's own releases
  of its public text), "other" = its top-1, the LM alone (top-1, top-10) and the retention (the share of perturbed
  tokens released as themselves);
- ``prompt``: whole-prompt restoration (:func:`~privlm.attacks.prompt_restoration`: SmolLM2 asked to rewrite the
  release "as the original", greedy), Rouge-L F1 against the original ("strongest"), beside the Rouge-L of the
  released text itself ("before": what an attacker who only reads it gets);
- ``canaries``: exact recovery of each planted secret (a card-like number or a full name), one guess per canary
  fixed beforehand. "before": the secret is in the released text verbatim (whole words, case kept). "strongest":
  where tokens align, every token of its span restored top-1 by the mechanism-aware LM reconstruction (a token the
  mechanism passed through counts as restored as released; the positions are ranked one by one, stopping at the
  first miss, each with the others as released, so the order changes nothing); for DP-Prompt, the secret verbatim
  in the rewrite. "other": verbatim in the rewrite, and "any guess" (release, rewrite or LM, the truth choosing: an
  upper bound, not an attack);
- ``attribute``: the airline a tweet @-mentions (only tweets that mention exactly one of
  :data:`privlm_bench.sap.sweep.AIRLINES`), DP-Prompt's author/attribute metric: the attacker releases public airline
  tweets (the train part) through the same mechanism at the same epsilon, trains MiniLM embeddings + logistic
  regression (:func:`~privlm.attacks.attribute_inference`) on them, and predicts the airline of the released test
  tweets ("strongest"; chance = the share of the attacker's majority airline among the test tweets). "other": reading
  the first airline @-mention left in the release.

DP-Prompt paraphrases the whole prompt: no released token stands for an original one, so it has no ``tokens`` rows
and its canaries are recovered by verbatim matches only (its rows say so in ``note``).

Epsilons (:data:`POINTS`): Cape at 6 (the gateway's default, docs/chat.md), cape-public at 8 (the chat-quality
bench's best private point), CUSTEXT+ at 6, SANTEXT+ at 6, InferDPT at 14 and DP-Prompt at 200: points that
``privlm bench chat-quality`` compares (benchmarks/chat-quality), one per mechanism. Quick mode takes the first
epsilon of each.


"""

from __future__ import annotations

import re
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

import privlm.baselines
import privlm.cape  # noqa: F401 (the registry's mechanisms)
from privlm.attacks import (
    REWRITE_INSTRUCTION,
    AttackResult,
    AttributeInferenceConfig,
    LLMReconstructionConfig,
    attribute_inference,
    chat_rewriter,
    fit_released_log_odds,
    llm_reconstruction,
    prompt_restoration,
    token_id_inversion,
)
from privlm.attacks.llm_reconstruction import Rewriter
from privlm.cape import Cape
from privlm.cape.utility import wrapping
from privlm.mechanisms import make_generator
from privlm.models import SplitModel
from privlm.models.chat import ChatModel
from privlm.models.language import LanguageModel
from privlm.models.perturbation import PerturbedPrompt
from privlm.models.prompts import NonSensitiveTokens, tokenize_prompt
from privlm.models.text_mechanisms import MechanismContext, text_mechanism
from privlm_bench.attacks.data import AttackTexts, Planted, attack_texts
from privlm_bench.attacks.rows import Row, attack_row
from privlm_bench.cape.sweep import TokenView
from privlm_bench.chat.load import CALIBRATION_PROMPTS
from privlm_bench.chat.quality import verbatim
from privlm_bench.chat.quality_prompts import Span
from privlm_bench.data.spans import span_token_positions
from privlm_bench.sap.sweep import AIRLINES, airline_of

SYSTEM = "cape"
POINTS: tuple[tuple[str, tuple[float, ...]], ...] = (
    ("cape", (6.0,)), ("cape-public", (8.0,)), ("custext+", (6.0,)), ("santext+", (6.0,)),
    ("inferdpt", (14.0,)), ("dp-prompt", (200.0,)))
NO_ALIGNMENT = ("the mechanism rewrites the whole prompt: no released token stands for an original one, so there are "
                "no token rows, and canaries are recovered by verbatim matches only")


@dataclass(frozen=True)
class PromptSizes:
    """How much each point attacks."""

    n_test: int
    n_canaries: int
    n_attribute_train: int  # public airline tweets the attacker releases to train its classifier
    shortlist: int  # LM reconstruction candidates per position
    attack_positions: int  # perturbed positions per test tweet attacked (LM reconstruction is the slow part)
    rewrite_tokens: int  # the rewrite's bound
    public_limit: int | None  # cap on each public source (attack_texts): enough train tweets for the classifier


QUICK = PromptSizes(n_test=3, n_canaries=2, n_attribute_train=8, shortlist=10, attack_positions=1, rewrite_tokens=32,
                    public_limit=1000)
FULL = PromptSizes(n_test=40, n_canaries=20, n_attribute_train=90, shortlist=16, attack_positions=2,
                   rewrite_tokens=64, public_limit=None)  # about 40 minutes on one core


def airlines_in(text: str) -> set[int]:
    """Every airline of :data:`AIRLINES` the text @-mentions, by :func:`airline_of`'s rule applied to each mention."""
    return {a for mention in re.findall(r"@\w+", text) if (a := airline_of(mention)) is not None}


def sole_airline(text: str) -> int | None:
    """The airline a text mentions when it mentions exactly one, else None."""
    found = airlines_in(text)
    return next(iter(found)) if len(found) == 1 else None


class PromptAttacks:
    """Models and texts shared by every point."""

    def __init__(self, sizes: PromptSizes, *, seed: int, device: str = "cpu",
                 log: Callable[[str], None] = lambda _: None) -> None:
        self.sizes, self.seed, self.log = sizes, seed, log
        self.texts: AttackTexts = attack_texts(n_test=sizes.n_test, n_canaries=sizes.n_canaries, seed=seed,
                                               public_limit=sizes.public_limit)
        self.lm = LanguageModel.from_pretrained("smollm2", device=device)
        self.encoder = SplitModel.from_pretrained("minilm", device=device)
        self.context = MechanismContext(self.lm, Cape(self.lm, epsilon=1.0).calibrate(list(CALIBRATION_PROMPTS)))
        self.rewrite = chat_rewriter(ChatModel(self.lm), max_tokens=sizes.rewrite_tokens)
        self.start_id = wrapping(self.lm)[0][0]
        self.special = frozenset(int(i) for i in self.lm.tokenizer.all_special_ids)
        self.non_sensitive = NonSensitiveTokens.english()
        tagged = [(text, sole_airline(text)) for text in self.texts.public]
        train = [(text, a) for text, a in tagged if a is not None][: sizes.n_attribute_train]
        if len({a for _, a in train}) < 2:
            raise ValueError(f"the public text holds {len(train)} single-airline tweets of fewer than two airlines")
        self.attribute_train = train
        self.attribute_test = [(i, a) for i, text in enumerate(self.texts.test.texts)
                               if (a := sole_airline(text)) is not None]

    def generator(self, *stream: object) -> torch.Generator:
        key = "/".join(str(part) for part in ("attacks/prompts", *stream))
        return make_generator(zlib.crc32(key.encode()) ^ self.seed)

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        return self.encoder.encode_texts([t if t.strip() else "" for t in texts]).numpy()

    def prefetched(self, released: Sequence[str]) -> Rewriter:
        """The rewriter, with the rewrites of ``released`` asked for at once (later calls read them)."""
        messages = [REWRITE_INSTRUCTION.replace("{text}", text) for text in released]
        answers = dict(zip(messages, self.rewrite(messages), strict=True))
        return lambda asked: [answers[m] if m in answers else self.rewrite([m])[0] for m in asked]

    def draw(self, positions: list[int], n: int, *stream: object) -> list[int]:
        """At most ``n`` of ``positions``, uniformly by the seed."""
        order = torch.randperm(len(positions), generator=self.generator(*stream)).tolist()
        return sorted(positions[i] for i in order[:n])

    # --- one point ------------------------------------------------------------------------------------------------
    def point_rows(self, mechanism: str, epsilon: float) -> list[Row]:
        chosen = text_mechanism(mechanism)
        started = time.perf_counter()
        perturber = chosen.build(self.context, epsilon=epsilon, generator=self.generator("release", mechanism, epsilon))
        test_texts, canaries = list(self.texts.test.texts), self.texts.canaries
        parts: dict[str, float] = {}

        def timed(part: str, began: float) -> None:
            parts[part] = round(time.perf_counter() - began, 2)

        released = perturber.perturb_batch([*test_texts, *(c.text for c in canaries)])
        tests, planted = released[: len(test_texts)], released[len(test_texts):]
        timed("release", started)
        common: dict[str, Any] = {"system": SYSTEM, "setting": f"{chosen.key}, epsilon={epsilon:g}",
                                  "level_name": "epsilon", "level": epsilon,
                                  "mechanism": chosen.name}
        if chosen.rewrites:
            common["note"] = NO_ALIGNMENT
        began = time.perf_counter()
        attacker = chosen.build(self.context, epsilon=epsilon,
                                generator=self.generator("attacker", chosen.name, epsilon))
        own = attacker.perturb_batch([text for text, _ in self.attribute_train])  # its public text, released by it
        timed("attacker_release", began)
        began = time.perf_counter()
        log_odds = None if chosen.rewrites else self.fit_log_odds([t for t, _ in self.attribute_train], own)
        timed("fit", began)
        began = time.perf_counter()
        rows = [] if log_odds is None else self.token_rows(test_texts, tests, log_odds, common)
        timed("tokens", began)
        began = time.perf_counter()
        rewrite = self.prefetched([p.text for p in released])  # the test and canaried releases in one set of batches
        prompt = prompt_restoration(test_texts, [p.text for p in tests], rewrite, seed=self.seed)
        rows += [attack_row(prompt.released, target="prompt", role="before", **common),
                 attack_row(prompt.restored, target="prompt", role="strongest", **common)]
        timed("prompt", began)
        began = time.perf_counter()
        rows += self.canary_rows(canaries, planted, rewrite, log_odds=log_odds, common=common)
        timed("canaries", began)
        began = time.perf_counter()
        rows += self.attribute_rows(own, tests, common)
        timed("attribute", began)
        seconds = time.perf_counter() - started
        self.log(f"{chosen.name} eps {epsilon:g}: {len(rows)} rows in {seconds:.0f} s ({parts})")
        return [row | {"seconds": seconds, "seconds_by_part": parts} for row in rows]

    def fit_log_odds(self, texts: Sequence[str], released: Sequence[PerturbedPrompt]) -> float:
        """The released token's log-odds (:func:`~privlm.attacks.fit_released_log_odds`), fitted on the attacker's
        own releases of its public text, at as many positions as the test tweets get."""
        view = TokenView.of(released)
        through = [[i for i, f in enumerate(flags) if f] for flags in view.through]
        positions = [self.draw(w, self.sizes.attack_positions, "fit", k) for k, w in enumerate(through)]
        budget = self.sizes.n_test  # texts: the fit costs what the test attack costs
        return fit_released_log_odds(view.original[:budget], view.released[:budget], positions[:budget],
                                     self.lm.model, start_id=self.start_id, excluded=self.special,
                                     config=LLMReconstructionConfig(shortlist=self.sizes.shortlist))

    def token_rows(self, texts: Sequence[str], released: Sequence[PerturbedPrompt], log_odds: float,
                   common: dict[str, Any]) -> list[Row]:
        view = TokenView.of(released)
        tokens = [tokenize_prompt(self.lm.tokenizer, t, self.non_sensitive) for t in texts]
        if [len(o) for o in view.original] != [len(t) for t in tokens]:
            raise ValueError("a mechanism's report does not hold one record per token of the prompt")
        through = [[i for i, f in enumerate(flags) if f] for flags in view.through]
        attacked = [self.draw(w, self.sizes.attack_positions, "attack", k) for k, w in enumerate(through)]
        if not any(attacked):
            return []
        table = self.lm.vocabulary.embeddings
        chosen = [[i in set(a) for i in range(len(o))] for a, o in zip(attacked, view.original, strict=True)]
        knn = token_id_inversion(*view.flat(chosen), table, k=10)
        knn_all = token_id_inversion(*view.flat(view.through), table, k=10)
        kept, total = view.flat(view.through)
        retention = AttackResult(name="retention", successes=int((kept == total).sum()), trials=int(kept.numel()))
        aware, alone = (llm_reconstruction(view.original, view.released, attacked, self.lm.model,
                                           start_id=self.start_id, excluded=self.special,
                                           config=LLMReconstructionConfig(shortlist=self.sizes.shortlist, top=10,
                                                                          released_log_odds=b))
                        for b in (log_odds, 0.0))
        extra = {**common, "shortlist": self.sizes.shortlist, "positions_per_prompt": self.sizes.attack_positions,
                 "knn_all_rate": knn_all.rate, "knn_all_trials": knn_all.trials, "released_log_odds": log_odds}
        return [attack_row(knn, target="tokens", role="before", attack="knn-top10", **extra),  # ten guesses each
                attack_row(aware.topk, target="tokens", role="strongest", **extra),
                attack_row(aware.top1, target="tokens", role="other", **extra),
                attack_row(alone.top1, target="tokens", role="other", **extra),
                attack_row(alone.topk, target="tokens", role="other", **extra),
                attack_row(retention, target="tokens", role="other", **extra)]

    def canary_rows(self, canaries: Sequence[Planted], released: Sequence[PerturbedPrompt], rewrite: Rewriter, *,
                    log_odds: float | None, common: dict[str, Any]) -> list[Row]:
        """``log_odds``: the token attack's fitted term (None: no token alignment, verbatim matches only)."""
        aligned = log_odds is not None
        if not canaries:
            return []
        rewrites = prompt_restoration([c.text for c in canaries], [p.text for p in released], rewrite,
                                      seed=self.seed).rewrites
        view = TokenView.of(released) if aligned else None
        in_release, in_rewrite, by_lm, recovered = [], [], [], []
        for k, (canary, release, rewritten) in enumerate(zip(canaries, released, rewrites, strict=True)):
            span = Span(canary.start, canary.end, canary.kind, canary.secret)
            in_release.append(verbatim(span, release.text))
            in_rewrite.append(verbatim(span, rewritten))
            by_lm.append(log_odds is not None and view is not None and self.span_restored(canary, view, k, log_odds))
            recovered.append(in_release[-1] or in_rewrite[-1] or by_lm[-1])
        kinds = [c.kind for c in canaries]

        def result(name: str, hits: Sequence[bool]) -> AttackResult:
            by_kind = {kind: sum(h for h, k in zip(hits, kinds, strict=True) if k == kind) for kind in set(kinds)}
            return AttackResult(name=name, successes=sum(hits), trials=len(canaries),
                                details={"recovered_by_kind": by_kind})

        # One guess per canary, fixed beforehand: the LM's restoration where tokens align, else the rewrite.
        strongest = result("canary-lm-restored", by_lm) if aligned else result("canary-in-rewrite", in_rewrite)
        rows = [attack_row(result("canary-verbatim-in-release", in_release), target="canaries", role="before",
                           **common),
                attack_row(strongest, target="canaries", role="strongest", **common),
                attack_row(result("canary-any-guess", recovered), target="canaries", role="other",
                           **common, note_any="release, rewrite or LM: the truth picks among the guesses, an "
                                              "upper bound")]
        if aligned:
            rows.append(attack_row(result("canary-in-rewrite", in_rewrite), target="canaries", role="other",
                                   **common))
        return rows

    def span_restored(self, canary: Planted, view: TokenView, k: int, log_odds: float) -> bool:
        """Every token of the secret's span restored top-1 (one position at a time, stopping at the first miss)."""
        tokens = tokenize_prompt(self.lm.tokenizer, canary.text, self.non_sensitive)
        original, released, through = view.original[k], view.released[k], view.through[k]
        if len(original) != len(tokens):
            raise ValueError("a mechanism's report does not hold one record per token of the prompt")
        for i in span_token_positions(tokens.spans, canary.start, canary.end):
            if not through[i]:
                if released[i] != original[i]:
                    return False
                continue
            found = llm_reconstruction([original], [released], [[i]], self.lm.model, start_id=self.start_id,
                                       excluded=self.special,
                                       config=LLMReconstructionConfig(shortlist=self.sizes.shortlist, top=1,
                                                                      released_log_odds=log_odds))
            if found.top1.successes == 0:
                return False
        return True

    def attribute_rows(self, train: Sequence[PerturbedPrompt], tests: Sequence[PerturbedPrompt],
                       common: dict[str, Any]) -> list[Row]:
        """``train``: the attacker's releases of its public airline tweets (:attr:`attribute_train`)."""
        if not self.attribute_test:
            return []
        test_texts = [tests[i].text for i, _ in self.attribute_test]
        labels = np.array([a for _, a in self.attribute_test])
        result = attribute_inference(self.embed([p.text for p in train]),
                                     np.array([a for _, a in self.attribute_train]), self.embed(test_texts), labels,
                                     seed=self.seed, config=AttributeInferenceConfig(classifier="logistic"))
        read = [airline_of(text) == a for text, a in zip(test_texts, labels.tolist(), strict=True)]
        reading = AttackResult(name="attribute-read-mention", successes=sum(read), trials=len(read),
                               chance=result.chance)
        extra = {**common, "attribute": "airline @-mentioned (exactly one of " + ", ".join(AIRLINES) + ")",
                 "n_attacker_train": len(train)}
        return [attack_row(result, target="attribute", role="strongest", attack="attribute-minilm-logistic", **extra),
                attack_row(reading, target="attribute", role="other", **extra)]


def prompt_rows(*, quick: bool, seed: int, points: Sequence[tuple[str, Sequence[float]]] = POINTS,
                device: str = "cpu", log: Callable[[str], None] = lambda _: None) -> list[Row]:
    """Every point's rows (quick: :data:`QUICK` sizes and the first epsilon of each mechanism, else :data:`FULL`)."""
    bench = PromptAttacks(QUICK if quick else FULL, seed=seed, device=device, log=log)
    rows: list[Row] = []
    for mechanism, epsilons in points:
        for epsilon in list(epsilons)[:1] if quick else epsilons:
            rows += bench.point_rows(mechanism, float(epsilon))
    return rows
