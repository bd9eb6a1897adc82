"""Training the tagger (``privlm detect train``): synthetic examples, frozen features, a small head, thresholds.

1. Examples of each split from :class:`privlm.detect.synthetic.Generator` (templates and values split apart).
2. Each token labelled with the kind of the marked span it overlaps (``O`` otherwise), its features computed
   once by the frozen encoder.
3. The head trained by cross-entropy on the train tokens (AdamW, a fixed number of epochs, batches of tokens).
4. Per-kind thresholds chosen on the validation split: for each kind, the threshold on P(kind) that maximises
   token-level F-beta with beta = ``beta`` (recall weighs beta² times precision: a missed detail leaks).
5. The test split is scored once, after everything is chosen, and written on the card; nothing is chosen on it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import asdict

import numpy as np
import torch

from privlm.detect.spans import KINDS, Kind
from privlm.detect.synthetic import COUNTRY, VOCABULARY_KINDS, Example, Generator
from privlm.detect.tagger import LABELS, TaggerCard, TaggerConfig, TaggerHead, TokenFeatures, write_tagger
from privlm.models.device import forked_rng
from privlm.settings.detect import TrainSettings

UNTUNED_THRESHOLD = 0.5  # a kind with no validation token (the card lists it)
THRESHOLD_GRID = tuple(round(t, 2) for t in np.arange(0.05, 0.96, 0.05))


def token_labels(offsets: np.ndarray, spans: Sequence[tuple[int, int, Kind]]) -> np.ndarray:
    """Each token's label index: the kind of a marked span it shares a character with, else 0 (``O``)."""
    labels = np.zeros(len(offsets), dtype=np.int64)
    for start, end, kind in spans:
        inside = (offsets[:, 1] > start) & (offsets[:, 0] < end) & (offsets[:, 1] > offsets[:, 0])
        labels[inside] = LABELS.index(kind.value)
    return labels


def token_dataset(features: TokenFeatures, examples: Sequence[Example], batch_size: int = 64
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Features (float16, to halve the memory) and labels of every token of ``examples``."""
    xs, ys = [], []
    for first in range(0, len(examples), batch_size):
        batch = examples[first:first + batch_size]
        for example, (offsets, feats) in zip(batch, features([e.text for e in batch]), strict=True):
            xs.append(feats.half())
            ys.append(torch.from_numpy(token_labels(offsets, example.spans)))
    return torch.cat(xs), torch.cat(ys)


def train_head(x: torch.Tensor, y: torch.Tensor, config: TaggerConfig, settings: TrainSettings) -> TaggerHead:
    generator = torch.Generator().manual_seed(settings.seed)
    with forked_rng(settings.seed):  # the head's initial weights, without touching the caller's global stream
        head = TaggerHead(x.shape[1], config.hidden)
    optimiser = torch.optim.AdamW(head.parameters(), lr=settings.learning_rate, weight_decay=0.01)
    steps = settings.epochs * max(1, len(x) // settings.batch_tokens)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimiser, settings.learning_rate, total_steps=steps)
    head.train()
    for _ in range(settings.epochs):
        order = torch.randperm(len(x), generator=generator)
        for first in range(0, len(x) - settings.batch_tokens + 1, settings.batch_tokens):
            rows = order[first:first + settings.batch_tokens]
            loss = torch.nn.functional.cross_entropy(head(x[rows].float()), y[rows])
            optimiser.zero_grad()
            loss.backward()
            optimiser.step()
            schedule.step()
    return head.eval()


@torch.inference_mode()
def probabilities(head: TaggerHead, x: torch.Tensor, batch: int = 65536) -> np.ndarray:
    return np.concatenate([torch.softmax(head(x[i:i + batch].float()), -1).numpy() for i in range(0, len(x), batch)])


def f_beta(tp: int, fp: int, fn: int, beta: float) -> float:
    b2 = beta * beta
    denominator = (1 + b2) * tp + b2 * fn + fp
    return (1 + b2) * tp / denominator if denominator else 0.0


def choose_thresholds(probs: np.ndarray, y: np.ndarray, beta: float) -> dict[Kind, float]:
    """Per kind, the grid threshold on P(kind) with the best token-level F-beta (the largest on a tie)."""
    chosen = {}
    for index, kind in enumerate(KINDS, start=1):
        gold = y == index
        scores = [(f_beta(int((gold & (probs[:, index] >= t)).sum()), int((~gold & (probs[:, index] >= t)).sum()),
                          int((gold & (probs[:, index] < t)).sum()), beta), t) for t in THRESHOLD_GRID]
        chosen[kind] = max(scores)[1] if gold.any() else UNTUNED_THRESHOLD
    return chosen


def token_scores(probs: np.ndarray, y: np.ndarray, thresholds: Mapping[Kind, float]) -> dict[str, dict[str, float]]:
    """Token-level recall and precision per kind, and recall of "any kind" (what redaction needs)."""
    limits = np.array([thresholds[kind] for kind in KINDS])
    flagged = probs[:, 1:] >= limits
    report: dict[str, dict[str, float]] = {}
    for index, kind in enumerate(KINDS, start=1):
        gold, predicted = y == index, flagged[:, index - 1]
        report[kind.value] = {"tokens": int(gold.sum()),
                              "recall": float((gold & predicted).sum() / max(1, gold.sum())),
                              "precision": float((gold & predicted).sum() / max(1, predicted.sum()))}
    personal = y > 0
    report["any"] = {"tokens": int(personal.sum()),
                     "recall": float((personal & flagged.any(1)).sum() / max(1, personal.sum())),
                     "precision": float((personal & flagged.any(1)).sum() / max(1, flagged.any(1).sum()))}
    return report


def training_vocabularies(entries: Iterable[tuple[Kind, str, str]]) -> dict[str, list[str]]:
    """The generator's vocabularies from the gazetteers' entries ``(kind, text, source)``: cities and towns as
    locations, countries on their own, and every entry of the other vocabulary kinds (names, organizations and
    numbers are drawn by the generator itself). Within a vocabulary each source weighs the same: a small one (the
    lay names of conditions) is repeated up to the size of the largest (ICD-10-CM's), so that drawing uniformly
    gives "asthma" as often as the clinical titles."""
    by_source: dict[str, dict[str, set[str]]] = {}
    for kind, text, source in entries:
        city = source.startswith(("geonames:cities", "geonames:towns"))
        if source == "geonames:countries":
            key = COUNTRY
        elif kind in VOCABULARY_KINDS and (city or kind is not Kind.LOCATION):
            key = kind.value
        else:
            continue
        by_source.setdefault(key, {}).setdefault(source, set()).add(text)
    vocabularies = {}
    for key, sources in sorted(by_source.items()):
        largest = max(len(values) for values in sources.values())
        vocabularies[key] = [value for _, values in sorted(sources.items())
                             for value in sorted(values) * max(1, largest // len(values))]
    return vocabularies


def train_tagger(features: TokenFeatures, fingerprint: str, *, vocabularies: Mapping[str, Sequence[str]],
                 negatives: Sequence[str], settings: TrainSettings, held_out: Collection[str] = ()
                 ) -> tuple[TaggerHead, TaggerCard]:
    """Train, choose thresholds on validation, score test once; the head and its card (not yet written).
    ``held_out``: values (and name parts) never drawn, in any split: the evaluation sets' own."""
    started = time.monotonic()
    data = {split: Generator(split, vocabularies, negatives, settings.seed, held_out).examples(n)
            for split, n in (("train", settings.train_examples), ("validation", settings.validation_examples),
                             ("test", settings.test_examples))}
    tokens = {split: token_dataset(features, examples) for split, examples in data.items()}
    head = train_head(*tokens["train"], features.config, settings)
    val_probs = probabilities(head, tokens["validation"][0])
    thresholds = choose_thresholds(val_probs, tokens["validation"][1].numpy(), settings.beta)
    test_probs = probabilities(head, tokens["test"][0])
    # The settings as the card's JSON will hold them (tuples as lists).
    training = {"settings": json.loads(json.dumps(asdict(settings))), "seconds": round(time.monotonic() - started, 1),
                "tokens": {split: len(t[1]) for split, t in tokens.items()},
                "validation": token_scores(val_probs, tokens["validation"][1].numpy(), thresholds),
                "test": token_scores(test_probs, tokens["test"][1].numpy(), thresholds),
                "vocabulary_sizes": {str(k): len(set(v)) for k, v in vocabularies.items()},
                "held_out_values": len(set(held_out)),
                "thresholds_untuned": [kind.value for kind in KINDS  # no validation token: the default stands
                                       if not (tokens["validation"][1] == LABELS.index(kind.value)).any()]}
    card = TaggerCard(config=features.config, encoder_fingerprint=fingerprint,
                      thresholds={k.value: v for k, v in thresholds.items()}, training=training)
    return head, card


__all__ = ["THRESHOLD_GRID", "TrainSettings", "choose_thresholds", "f_beta", "token_dataset", "token_labels",
           "token_scores", "train_head", "train_tagger", "training_vocabularies", "write_tagger"]
