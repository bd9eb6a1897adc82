"""``privlm bench chat-quality``: what a private prompt's answer is worth, and what its personal details are worth
to an attacker, for every registered text mechanism (Cape's paper, section 5.1.2, made measurable here).

Prompts: :mod:`privlm_bench.chat.quality_prompts` (``benchmarks/chat-quality/prompts.jsonl``), personal details
marked, split by template. Nothing is chosen on the test split: cape-public's free choices (tau, top-p) are picked
on ``n_select`` training prompts (:func:`select_public`), and the run says whether the shipped defaults are them.

Every answer comes from ``privlm serve-llm`` (SmolLM2, greedy, ``max_tokens``). A mechanism's prompts reach it
through a real ``privlm gateway --mechanism NAME --restore --chat-memory off`` (one gateway per mechanism, each
request at its own epsilon, the report in the body; no memory, so that each epsilon draws its own release of the
same prompt): the answer to the released prompt is the upstream's (``privlm.restore.upstream_content``), the
restored one the gateway's ``content``. The gateway skips restore under ``--extract``, so the extraction runs here,
on the same device model, by the same call the gateway's ``--extract`` makes
(``AnswerExtractor.extract(prompt, upstream answer, limit=max_tokens)``: the request's ``max_tokens`` is the
gateway's limit), so ``extracted_similarity`` means what it meant when the gateway extracted. Per (mechanism,
epsilon), over ``n_test`` test prompts:

Utility
- ``answer_similarity``: MiniLM cosine between the answer to the released prompt and the answer to the original
  (serve-llm, directly); ``restored_similarity``: the same after the gateway's restore (``restored``: replacements
  written back per prompt; ``restore_gain_se``: the standard error of the per-prompt difference, a paired one);
  ``extracted_similarity``: the same after the extraction. The floor is the answer to an unrelated prompt (the
  next test prompt's), the ceiling 1 (greedy: the original's answer again);
- ``released_perplexity``: the device model's perplexity of the released prompt (median over prompts);
- ``classifier_auc``: on ``n_tweets`` tweets, as ``privlm bench cape`` measures it (MiniLM + logistic
  regression trained on clean tweets, applied to the released ones).

Privacy
- ``span_verbatim``: the share of marked personal spans that reach the upstream verbatim (a whole-word match in
  the text the gateway sent); ``prompts_leaking``: the share of prompts with at least one;
- ``lm_top1`` / ``lm_top10``: LM reconstruction (:func:`privlm.attacks.llm_reconstruction`, SmolLM2 ranking
  ``shortlist`` candidates by the whole sequence's likelihood) of the perturbed tokens inside marked spans, at most
  ``attack_positions`` of them per prompt, drawn uniformly by the seed (the attack costs a batched forward pass of
  the right context per candidate set);
- ``knn_success``: KNN top-10 on every perturbed token (as ``privlm bench cape``).

The gateway's report carries the text it sent, not token ids, so the two token-level attacks run on the
mechanism's release of the same prompts drawn in this process, with the same device model, bound and epsilon (the
same law, other draws). DP-Prompt rewrites the prompt, so no released token stands for an original one: for it
``lm_top1`` is the share of span tokens whose id appears anywhere in the paraphrase (the attacker reads the text;
a weaker attack than the others get), and KNN does not apply.

Controls: ``original`` (the prompt as it is: spans all verbatim) and ``placeholders`` (every marked span replaced
by ``[KIND]``, as a PII redactor does; sent to serve-llm directly, extracted in this process by the same
extractor). The placeholder control has an oracle detector here: it leaks nothing because it misses nothing; a
real detector leaks what it misses. Their restore columns are NaN: they pass through no gateway, and no
mechanism's report maps their text back (writing the spans back over ``[KIND]`` would be the oracle again).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import tempfile
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import torch
from rich.console import Console

import privlm.baselines
import privlm.cape  # noqa: F401 (the registry's mechanisms)
from privlm.attacks import LLMReconstructionConfig, llm_reconstruction
from privlm.cape import Cape, PublicContextCape, PublicContextOptions
from privlm.cape.utility import wrapping
from privlm.chat.extraction import AnswerExtractor
from privlm.mechanisms import make_generator
from privlm.models.chat import ChatModel
from privlm.models.language import LanguageModel
from privlm.models.perturbation import PerturbedPrompt
from privlm.models.prompts import NonSensitiveTokens, PromptTokens, tokenize_prompt
from privlm.models.text_mechanisms import MechanismContext, text_mechanism
from privlm.provenance import provenance
from privlm.service.process import free_port
from privlm_bench.cape.sweep import CapeBench, CapeSetting, TokenView
from privlm_bench.chat.load import CALIBRATION_PROMPTS, running, serve_llm_args
from privlm_bench.chat.quality_prompts import PROMPTS_FILE, QualityPrompt, Span, read_prompts
from privlm_bench.data.spans import span_token_positions
from privlm_bench.harness.json_values import from_json
from privlm_bench.harness.probes import classification_metrics

NAME = "chat-quality"
ORIGINAL, PLACEHOLDERS = "original", "placeholders"
# (mechanism, epsilons): each mechanism's own scale; chosen to span the attack range of privlm bench cape.
# The four of the matched comparison first: a run cut short still has them.
DEFAULT_POINTS: tuple[tuple[str, tuple[float, ...]], ...] = (
    ("cape-public", (8.0, 16.0, 32.0, 64.0)), ("cape", (6.0, 14.0)), ("custext+", (2.0, 6.0)),
    ("dp-prompt", (100.0, 200.0)), ("cape-distance", (6.0,)), ("cape-unbucketed", (14.0,)), ("custext", (6.0,)),
    ("santext+", (6.0,)), ("santext", (6.0,)), ("inferdpt", (14.0,)), ("text2text", (20.0,)),
    ("cape-public-fast", (8.0, 16.0, 32.0)))
SELECT_TAUS = (0.5, 1.0, 2.0)
SELECT_TOP_PS = (0.9, 1.0)
VERBATIM_GOAL = 0.05  # the bar: at most 5% of personal spans verbatim


@dataclass(frozen=True, kw_only=True)
class QualitySetting:
    """Everything the run records in ``results.json``."""

    points: tuple[tuple[str, tuple[float, ...]], ...] = DEFAULT_POINTS
    n_test: int = 24
    n_select: int = 12
    select_epsilon: float = 16.0
    select_taus: tuple[float, ...] = SELECT_TAUS
    select_top_ps: tuple[float, ...] = SELECT_TOP_PS
    n_tweets: int = 100
    max_tokens: int = 24
    shortlist: int = 16
    top: int = 10
    attack_positions: int = 3  # perturbed span tokens attacked per prompt, drawn by the seed (the attack is slow)
    prompts_file: str = str(PROMPTS_FILE)
    device_model: str = "smollm2"
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("n_test", "n_select", "n_tweets", "max_tokens", "shortlist", "top", "attack_positions"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.top > self.shortlist:
            raise ValueError(f"top ({self.top}) must be at most shortlist ({self.shortlist})")
        if not (math.isfinite(self.select_epsilon) and self.select_epsilon > 0):
            raise ValueError(f"select_epsilon must be finite and > 0, got {self.select_epsilon}")
        if not self.select_taus or any(not (math.isfinite(t) and t >= 0) for t in self.select_taus):
            raise ValueError(f"select_taus must be finite and >= 0, got {self.select_taus}")
        if not self.select_top_ps or any(not 0 < p <= 1 for p in self.select_top_ps):
            raise ValueError(f"select_top_ps must lie in (0, 1], got {self.select_top_ps}")
        for mechanism, epsilons in self.points:
            text_mechanism(mechanism)  # an unknown name is refused here
            if not epsilons or any(not (math.isfinite(e) and e > 0) for e in epsilons):
                raise ValueError(f"{mechanism}: epsilons must be finite and > 0, got {epsilons}")

    def key(self) -> str:
        """What a resumed run must share with the partial rows it keeps: every setting but the points (a row is one
        point, so a run may add points to a partial one)."""
        shared = {name: value for name, value in asdict(self).items() if name != "points"}
        return hashlib.sha256(json.dumps(shared, sort_keys=True).encode()).hexdigest()[:16]


def parse_points(spec: str) -> tuple[tuple[str, tuple[float, ...]], ...]:
    """``"cape-public:4,8;cape:6"`` -> the points of :class:`QualitySetting`."""
    points = []
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        name, _, levels = part.partition(":")
        if not levels:
            raise ValueError(f"{part!r}: give NAME:EPS[,EPS...]")
        points.append((name.strip(), tuple(float(level) for level in levels.split(","))))
    if not points:
        raise ValueError("no points given")
    return tuple(points)


# --------------------------------------------------------------------------------------------- text measures
def verbatim(span: Span, text: str) -> bool:
    """The span's text appears in ``text`` as whole words (case kept: "Seattle", not "seattle")."""
    return re.search(rf"(?<!\w){re.escape(span.text)}(?!\w)", text) is not None


def with_placeholders(prompt: QualityPrompt) -> str:
    """Every marked span replaced by ``[KIND]``, as a PII redactor does."""
    out, end = [], 0
    for span in prompt.spans:
        out += [prompt.text[end:span.start], f"[{span.kind.upper()}]"]
        end = span.end
    return "".join([*out, prompt.text[end:]])


def span_positions(tokens: PromptTokens, spans: Sequence[Span]) -> list[int]:
    """Token positions whose characters overlap a marked span (:func:`span_token_positions`, span by span)."""
    return sorted({i for s in spans for i in span_token_positions(tokens.spans, s.start, s.end)})


def mean_and_error(values: Sequence[float]) -> tuple[float, float]:
    """Mean and its standard error."""
    array = np.asarray(values, dtype=float)
    if array.size == 0:
        return math.nan, math.nan
    error = float(array.std(ddof=1) / math.sqrt(array.size)) if array.size > 1 else math.nan
    return float(array.mean()), error


@dataclass(frozen=True)
class Restored:
    """Per prompt: the restored answer's similarity, the replacements restored, and those restorable."""

    similarities: Sequence[float]
    restorations: Sequence[int]
    replacements: Sequence[int]


RESTORE_COLUMNS = ("restored_similarity", "restored_similarity_se", "restore_gain_se", "restored",
                   "restore_replacements")


def restore_measures(answered: Sequence[float], restored: Restored | None) -> dict[str, float]:
    """The restore columns: the restored answers' similarity (and its error), the standard error of the per-prompt
    difference to the answers' (paired: one upstream answer, restored or not), and the mean replacements restored
    and restorable per prompt; all NaN without restore."""
    if restored is None:
        return dict.fromkeys(RESTORE_COLUMNS, math.nan)
    mean, error = mean_and_error(restored.similarities)
    _, gain_error = mean_and_error([r - a for a, r in zip(answered, restored.similarities, strict=True)])
    return {"restored_similarity": mean, "restored_similarity_se": error, "restore_gain_se": gain_error,
            "restored": float(np.mean(restored.restorations)),
            "restore_replacements": float(np.mean(restored.replacements))}


# --------------------------------------------------------------------------------------------- the upstream
@dataclass
class Upstream:
    """serve-llm at temperature 0, directly or through a gateway."""

    url: str
    model: str
    max_tokens: int
    http: httpx.Client = field(default_factory=lambda: httpx.Client(timeout=600.0))

    def body(self, text: str, **extra: Any) -> dict[str, Any]:
        return {"model": self.model, "messages": [{"role": "user", "content": text}], "temperature": 0.0,
                "max_tokens": self.max_tokens, **extra}

    def answer(self, text: str) -> str:
        response = self.http.post(f"{self.url}/v1/chat/completions", json=self.body(text))
        response.raise_for_status()
        return str(response.json()["choices"][0]["message"]["content"])

    def private(self, gateway_url: str, text: str, epsilon: float) -> dict[str, Any]:
        """One request through a gateway at ``epsilon``: sent text, upstream answer, restored answer, spend."""
        response = self.http.post(f"{gateway_url}/v1/chat/completions",
                                  json=self.body(text, privlm={"epsilon": epsilon, "report": True}))
        if response.status_code != 200:
            raise RuntimeError(f"the gateway answered {response.status_code}: {response.text[:500]}")
        body = response.json()
        message, report = body["choices"][0]["message"], body["privlm"]
        restore = report.get("restore")
        if not isinstance(restore, dict) or "upstream_content" not in restore:
            raise RuntimeError("the gateway's report has no restore: it must run with --restore, without --extract")
        if report["texts_remembered"]:  # a repeat sent as released before: not a draw at this epsilon
            raise RuntimeError("the gateway sent a remembered release: it must run with --chat-memory off")
        restored = str(message["content"])
        upstream = restore["upstream_content"][0]
        return {"sent": report["texts"][0]["sent"], "answer": restored if upstream is None else str(upstream),
                "restored_answer": restored, "restored": int(restore["restored"]),
                "replacements": int(restore["replacements"]), "spent": float(report["epsilon_spent"]),
                "perturbed": int(report["tokens_perturbed"]), "epsilon": float(report["epsilon"])}


# --------------------------------------------------------------------------------------------- the bench
class QualityBench:
    """Models, prompts, the tweets classifier and the answers to the original prompts, shared by every point."""

    def __init__(self, setting: QualitySetting, work: Path, log: Callable[[str], None]) -> None:
        self.setting = s = setting
        self.log = log
        train, test = read_prompts(s.prompts_file)
        self.test = self._sample(test, s.n_test, "test")
        self.select = self._sample(train, s.n_select, "select")
        log(f"loading models; tweets classifier on {s.n_tweets} test tweets")
        self.tweets = CapeBench(CapeSetting(mechanisms=("cape-distance",), n_test=s.n_tweets, zero_shot_texts=0,
                                            mti_sentences=0, nw_tokens=0, int8_epsilons=(),
                                            device_model=s.device_model, seed=s.seed, device="cpu"))
        self.lm: LanguageModel = self.tweets.lm
        self.bound = Cape(self.lm, epsilon=1.0).calibrate(list(CALIBRATION_PROMPTS))
        self.bound_path = work / "logit_bound.json"
        self.bound.save(self.bound_path)
        self.context = MechanismContext(self.lm, self.bound)
        self.extractor = AnswerExtractor(ChatModel(self.lm), max_tokens=s.max_tokens)
        self.non_sensitive = NonSensitiveTokens.english()
        self.start_id = wrapping(self.lm)[0][0]
        self.special = frozenset(int(i) for i in self.lm.tokenizer.all_special_ids)
        self.reference: dict[str, str] = {}
        self.reference_embedding: dict[str, np.ndarray] = {}

    def _sample(self, prompts: Sequence[QualityPrompt], n: int, stream: str) -> list[QualityPrompt]:
        order = torch.randperm(len(prompts), generator=self.generator(stream)).tolist()
        return [prompts[i] for i in sorted(order[:n])]

    def generator(self, *stream: object) -> torch.Generator:
        key = "/".join(str(part) for part in (NAME, *stream))
        return make_generator(zlib.crc32(key.encode()) ^ self.setting.seed)

    # --- measures ---------------------------------------------------------------------------------
    def embed(self, texts: Sequence[str]) -> np.ndarray:
        vectors = self.tweets.embed(texts)
        return vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)

    def answer_references(self, upstream: Upstream, prompts: Sequence[QualityPrompt]) -> None:
        todo = [p.text for p in prompts if p.text not in self.reference]
        for text in todo:
            self.reference[text] = upstream.answer(text)
        if todo:
            self.reference_embedding.update(zip(todo, self.embed([self.reference[t] for t in todo]), strict=True))

    def similarities(self, prompts: Sequence[QualityPrompt], answers: Sequence[str]) -> list[float]:
        """MiniLM cosine of each answer to the answer to its original prompt."""
        vectors = self.embed(answers)
        return [float(v @ self.reference_embedding[p.text]) for p, v in zip(prompts, vectors, strict=True)]

    def floor(self, prompts: Sequence[QualityPrompt]) -> list[float]:
        """The answer to the next prompt against each prompt's own: what an unrelated answer scores."""
        return [float(self.reference_embedding[p.text] @ self.reference_embedding[prompts[(i + 1) % len(prompts)].text])
                for i, p in enumerate(prompts)]

    @torch.inference_mode()
    def perplexity(self, text: str) -> float:
        ids = self.lm.tokenizer(text, add_special_tokens=False)["input_ids"]
        rows = torch.tensor([[self.start_id, *ids]], device=self.lm.device)
        logits = self.lm.model(input_ids=rows).logits[0, :-1].float()
        return float(torch.nn.functional.cross_entropy(logits, rows[0, 1:]).exp()) if ids else math.nan

    def text_measures(self, prompts: Sequence[QualityPrompt], sent: Sequence[str], answers: Sequence[str],
                      extracted: Sequence[str] | None, restore: Sequence[dict[str, Any]] | None = None
                      ) -> dict[str, float]:
        """``restore``: per prompt, the gateway's call (:meth:`Upstream.private`); None: no restore (NaN)."""
        leaked = [[verbatim(s, text) for s in p.spans] for p, text in zip(prompts, sent, strict=True)]
        each = self.similarities(prompts, answers)
        similarity = mean_and_error(each)
        extraction = mean_and_error(self.similarities(prompts, extracted)) if extracted else (math.nan, math.nan)
        restored = None if restore is None else Restored(
            self.similarities(prompts, [c["restored_answer"] for c in restore]),
            [c["restored"] for c in restore], [c["replacements"] for c in restore])
        return {"answer_similarity": similarity[0], "answer_similarity_se": similarity[1],
                **restore_measures(each, restored),
                "extracted_similarity": extraction[0], "extracted_similarity_se": extraction[1],
                "span_verbatim": float(np.mean([x for row in leaked for x in row])),
                "spans": float(sum(len(row) for row in leaked)),
                "prompts_leaking": float(np.mean([any(row) for row in leaked])),
                "released_perplexity": float(np.nanmedian([self.perplexity(t) for t in sent])),
                "n_prompts": float(len(prompts))}

    def token_attacks(self, prompts: Sequence[QualityPrompt], released: Sequence[PerturbedPrompt],
                      rewrites: bool) -> dict[str, float]:
        """LM reconstruction of the perturbed span tokens, and KNN on every perturbed token."""
        tokens = [tokenize_prompt(self.lm.tokenizer, p.text, self.non_sensitive) for p in prompts]
        where = [span_positions(t, p.spans) for t, p in zip(tokens, prompts, strict=True)]
        if rewrites:
            found = [[t.ids[i] in set(self.lm.tokenizer(r.text, add_special_tokens=False)["input_ids"]) for i in w]
                     for t, r, w in zip(tokens, released, where, strict=True)]
            hits = [x for row in found for x in row]
            return {"lm_top1": float(np.mean(hits)), "lm_top10": math.nan, "lm_trials": float(len(hits)),
                    "knn_success": math.nan}
        view = TokenView.of(released)
        if [len(o) for o in view.original] != [len(t) for t in tokens]:
            raise ValueError("a mechanism's report does not hold one record per token of the prompt")
        attacked = [self._draw([i for i in w if flags[i]], self.setting.attack_positions, "attack", k)
                    for k, (w, flags) in enumerate(zip(where, view.through, strict=True))]
        result = llm_reconstruction(view.original, view.released, attacked, self.lm.model, start_id=self.start_id,
                                    excluded=self.special,
                                    config=LLMReconstructionConfig(shortlist=self.setting.shortlist,
                                                                   top=self.setting.top))
        knn = self.tweets.knn.attack(*view.flat(view.through))
        return {"lm_top1": result.top1.rate, "lm_top10": result.topk.rate, "lm_trials": float(result.top1.trials),
                "knn_success": knn.rate}

    def _draw(self, positions: list[int], n: int, *stream: object) -> list[int]:
        """At most ``n`` of ``positions``, uniformly (the same ones for every mechanism that perturbs them all)."""
        order = torch.randperm(len(positions), generator=self.generator(*stream)).tolist()
        return sorted(positions[i] for i in order[:n])

    def tweets_auc(self, texts: Sequence[str]) -> dict[str, float]:
        labels = self.tweets.labels["test"]
        auc = classification_metrics(labels, self.tweets.classifier.predict_proba(self.tweets.embed(texts)))["auc"]
        return {"classifier_auc": auc, "n_positive": float((labels == 1).sum()),
                "n_negative": float((labels == 0).sum())}

    # --- points -----------------------------------------------------------------------------------
    def original_row(self) -> dict[str, Any]:
        prompts = self.test
        row = self.text_measures(prompts, [p.text for p in prompts], [self.reference[p.text] for p in prompts], None)
        floor = mean_and_error(self.floor(prompts))
        return {"method": ORIGINAL, "epsilon": math.inf, **row, "unrelated_similarity": floor[0],
                "unrelated_similarity_se": floor[1], "spend_per_prompt": 0.0,
                **self.tweets_auc(self.tweets.texts["test"])}

    def placeholder_row(self, upstream: Upstream) -> dict[str, Any]:
        prompts = self.test
        sent = [with_placeholders(p) for p in prompts]
        answers = [upstream.answer(t) for t in sent]
        return {"method": PLACEHOLDERS, "epsilon": math.inf, "spend_per_prompt": 0.0,
                **self.text_measures(prompts, sent, answers, self.extract(prompts, answers))}

    def extract(self, prompts: Sequence[QualityPrompt], answers: Sequence[str]) -> list[str]:
        """Each answer rewritten for its original prompt: the call the gateway's ``--extract`` makes (the user's
        prompt, the upstream's answer, the request's ``max_tokens`` as the limit)."""
        limit = self.setting.max_tokens
        return [self.extractor.extract(p.text, a, limit=limit) for p, a in zip(prompts, answers, strict=True)]

    def point_row(self, upstream: Upstream, gateway_url: str, mechanism: str, epsilon: float) -> dict[str, Any]:
        chosen = text_mechanism(mechanism)
        prompts, started = self.test, time.perf_counter()
        calls = [upstream.private(gateway_url, p.text, epsilon) for p in prompts]
        gateway_seconds = time.perf_counter() - started
        answers = [c["answer"] for c in calls]
        extracted = self.extract(prompts, answers)
        row = self.text_measures(prompts, [c["sent"] for c in calls], answers, extracted, calls)
        spend = [c["spent"] for c in calls]
        exact = all(math.isclose(c["spent"], c["perturbed"] * epsilon, rel_tol=1e-9, abs_tol=1e-12) for c in calls)
        perturber = chosen.build(self.context, epsilon=epsilon, generator=self.generator(mechanism, epsilon))
        released = perturber.perturb_batch([p.text for p in prompts])
        row |= self.token_attacks(prompts, released, chosen.rewrites)
        tweets = perturber.perturb_batch(self.tweets.texts["test"])
        row |= self.tweets_auc([t.text for t in tweets])
        return {"method": chosen.key, "mechanism": chosen.name, "epsilon": epsilon, **row,
                "spend_per_prompt": float(np.mean(spend)),
                "perturbed_per_prompt": float(np.mean([c["perturbed"] for c in calls])),
                "spend_is_perturbed_times_epsilon": exact, "unit": str(chosen.unit),
                "seconds": time.perf_counter() - started, "gateway_seconds": gateway_seconds,
                "examples": [{"original": p.text, "sent": c["sent"], "answer": c["answer"],
                              "restored": c["restored_answer"], "extracted": x}
                             for p, c, x in zip(prompts[:2], calls[:2], extracted[:2], strict=True)]}


# --------------------------------------------------------------------------------------------- selection
def select_public(bench: QualityBench, upstream: Upstream) -> dict[str, Any]:
    """cape-public's tau and top-p on training prompts: the highest answer similarity among the pairs that keep
    personal spans verbatim at most :data:`VERBATIM_GOAL` of the time (none does: the fewest spans verbatim)."""
    s, prompts = bench.setting, bench.select
    bench.answer_references(upstream, prompts)
    grid = []
    for tau in s.select_taus:
        for top_p in s.select_top_ps:
            perturber = PublicContextCape(bench.lm, epsilon=s.select_epsilon,
                                          options=PublicContextOptions(tau=tau, top_p=top_p),
                                          generator=bench.generator("select", tau, top_p))
            sent = [r.text for r in perturber.perturb_batch([p.text for p in prompts])]
            answers = [upstream.answer(t) for t in sent]
            measures = bench.text_measures(prompts, sent, answers, None)
            grid.append({"tau": tau, "top_p": top_p, **{k: measures[k] for k in (
                "answer_similarity", "answer_similarity_se", "span_verbatim", "released_perplexity")}})
            bench.log(f"select tau={tau:g} top_p={top_p:g}: similarity {measures['answer_similarity']:.3f}, "
                      f"verbatim {measures['span_verbatim']:.3f}")
    within = [g for g in grid if g["span_verbatim"] <= VERBATIM_GOAL]
    best = (max(within, key=lambda g: g["answer_similarity"]) if within
            else min(grid, key=lambda g: g["span_verbatim"]))
    defaults = PublicContextCape(bench.lm, epsilon=1.0)
    return {"epsilon": s.select_epsilon, "n_prompts": len(prompts), "grid": grid,
            "chosen": {"tau": best["tau"], "top_p": best["top_p"]},
            "shipped": {"tau": defaults.tau, "top_p": defaults.top_p},
            "rule": f"highest answer similarity with span_verbatim <= {VERBATIM_GOAL}"}


# --------------------------------------------------------------------------------------------- the run
@contextmanager
def _gateway(bench: QualityBench, upstream_url: str, mechanism: str, epsilon: float) -> Iterator[str]:
    port = free_port()
    # --chat-memory off: a prompt sent again at another epsilon is drawn again, not sent as first released
    args = ["gateway", "--chat-upstream", upstream_url, "--mechanism", mechanism, "--epsilon", f"{epsilon!r}",
            "--device-model", bench.setting.device_model, "--restore", "--chat-memory", "off", "--port", str(port),
            "--max-in-flight", "4"]
    if text_mechanism(mechanism).needs_logit_bound:
        args += ["--logit-bound", str(bench.bound_path)]
    with running(args, f"http://127.0.0.1:{port}/health"):
        yield f"http://127.0.0.1:{port}"


def _partial(path: Path, key: str) -> dict[tuple[str, float], dict[str, Any]]:
    if not path.exists():
        return {}
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {(r["method"], float(r["epsilon"])): r for r in rows if r.get("setting_key") == key}


def _finished(out_dir: Path, setting: QualitySetting) -> dict[tuple[str, float], dict[str, Any]]:
    """The rows a resumed run keeps: those of ``results.json`` when it was run with the same settings (but perhaps
    other points), then those of ``partial.jsonl`` (a run cut short); the original prompt's row is always redone,
    and so is a row of an older run that lacks a column rows have now (:data:`RESTORE_COLUMNS`)."""
    payload = _saved(out_dir, setting)
    done = {} if payload is None else {(r["method"], float(r["epsilon"])): r for r in payload["rows"]
                                       if r["method"] != ORIGINAL}
    return _current(done) | _current(_partial(out_dir / "partial.jsonl", setting.key()))


def _saved(out_dir: Path, setting: QualitySetting) -> dict[str, Any] | None:
    """``results.json`` when it was run with the same settings (perhaps other points); else None."""
    results = out_dir / "results.json"
    if not results.exists():
        return None
    payload: Any = from_json(json.loads(results.read_text()))
    return payload if QualitySetting(**_setting_fields(payload["setting"])).key() == setting.key() else None


def _current(rows: dict[tuple[str, float], dict[str, Any]]) -> dict[tuple[str, float], dict[str, Any]]:
    """The rows that have every column a row has now."""
    return {point: row for point, row in rows.items() if all(column in row for column in RESTORE_COLUMNS)}


def _setting_fields(saved: dict[str, Any]) -> dict[str, Any]:
    """A saved setting (JSON lists) as :class:`QualitySetting`'s fields (tuples)."""
    fields = {name: tuple(value) if isinstance(value, list) else value for name, value in saved.items()}
    fields["points"] = tuple((name, tuple(epsilons)) for name, epsilons in saved["points"])
    return fields


def run_quality_bench(setting: QualitySetting, out_dir: Path, console: Console, *, resume: bool = False,
                      select_only: bool = False) -> list[Path]:
    """The whole benchmark; writes results.json, results.md and the plots in ``out_dir``."""
    with tempfile.TemporaryDirectory(prefix="privlm-chat-quality-") as work:  # the logit bound the gateways read
        return _run(setting, out_dir, Path(work), console, resume=resume, select_only=select_only)


def _run(setting: QualitySetting, out_dir: Path, work: Path, console: Console, *, resume: bool,
         select_only: bool) -> list[Path]:
    from privlm_bench.chat.quality_report import write_quality_report

    meta = provenance(seed=setting.seed)
    started = time.perf_counter()

    def log(message: str) -> None:
        console.log(message, highlight=False)

    out_dir.mkdir(parents=True, exist_ok=True)
    partial_path = out_dir / "partial.jsonl"
    done = _finished(out_dir, setting) if resume else {}
    # the choice is a function of the settings and the training prompts (seeded draws, greedy answers): kept
    kept_selection = (_saved(out_dir, setting) or {}).get("selection") if resume and not select_only else None
    partial_path.unlink(missing_ok=True)
    for row in done.values():  # rewritten whole, so that a resumed run cut short loses nothing it kept
        _keep(partial_path, setting, row)
    bench = QualityBench(setting, work, log)
    port = free_port()
    llm_url = f"http://127.0.0.1:{port}"
    rows: list[dict[str, Any]] = []
    with running(serve_llm_args(port), f"{llm_url}/health"):
        upstream = Upstream(llm_url, _first_model(llm_url), setting.max_tokens)
        log(f"answers to {len(bench.test)} original test prompts")
        bench.answer_references(upstream, bench.test)
        if kept_selection is not None:
            log("cape-public's tau and top-p: kept from the run resumed (same settings)")
            selection = kept_selection
        else:
            log(f"choosing cape-public's tau and top-p on {len(bench.select)} training prompts")
            selection = select_public(bench, upstream)
        if select_only:
            path = out_dir / "selection.json"
            path.write_text(json.dumps({"metadata": meta | {"sweep": NAME}, "setting": asdict(setting),
                                        "selection": selection}, indent=2))
            return [path]
        n_points = 2 + sum(len(epsilons) for _, epsilons in setting.points)

        def report() -> list[Path]:  # after every point: a run stopped early still has its report, marked partial
            payload = {"metadata": meta | {"sweep": NAME, "seconds": time.perf_counter() - started},
                       "setting": asdict(setting), "complete": len(rows) == n_points,
                       "logit_bound": {"value": bench.bound.value, "n_texts": bench.bound.n_texts},
                       "selection": selection, "rows": rows,
                       "prompts": {"file": setting.prompts_file, "test": len(bench.test), "select": len(bench.select)}}
            return write_quality_report(out_dir, payload)

        rows.append(bench.original_row())
        rows.append(done.get((PLACEHOLDERS, math.inf)) or _keep(partial_path, setting, bench.placeholder_row(upstream)))
        report()
        for mechanism, epsilons in setting.points:
            todo = [e for e in epsilons if (text_mechanism(mechanism).key, e) not in done]
            rows += [done[(text_mechanism(mechanism).key, e)] for e in epsilons if e not in todo]
            if not todo:
                continue
            log(f"{mechanism}: gateway at epsilon {max(todo):g}")
            with _gateway(bench, llm_url, mechanism, max(todo)) as gateway_url:
                for epsilon in todo:
                    row = _keep(partial_path, setting, bench.point_row(upstream, gateway_url, mechanism, epsilon))
                    log(f"{mechanism} eps {epsilon:g}: similarity {row['answer_similarity']:.3f} (restored "
                        f"{row['restored_similarity']:.3f}, {row['restored']:.1f} per prompt), verbatim "
                        f"{row['span_verbatim']:.3f}, LM top-1 {row['lm_top1']:.3f}, AUC {row['classifier_auc']:.3f}"
                        f", spend {row['spend_per_prompt']:.1f} ({row['seconds']:.0f} s)")
                    rows.append(row)
                    report()
    files = report()
    partial_path.unlink(missing_ok=True)  # the run is whole: results.json holds every row
    return files


def _keep(path: Path, setting: QualitySetting, row: dict[str, Any]) -> dict[str, Any]:
    """Append a finished row to the partial file (a resumed run keeps it)."""
    with path.open("a", encoding="utf-8") as handle:
        handle.write(json.dumps(row | {"setting_key": setting.key()}) + "\n")  # inf as Infinity: read back as inf
    return row


def _first_model(url: str) -> str:
    response = httpx.get(f"{url}/v1/models", timeout=30)
    response.raise_for_status()
    return str(response.json()["data"][0]["id"])
