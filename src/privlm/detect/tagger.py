"""The learned layer: token classification over the kinds, a small head on the packaged MiniLM's frozen features.

Each token's features are the encoder's hidden states at :attr:`TaggerConfig.feature_layers`, concatenated; the
head (layer norm, one hidden layer, GELU, a linear map to ``O`` and the kinds) gives each token a probability per
label. A token is of kind k when P(k) reaches k's threshold (the largest such k when several do); runs of tokens
of one kind become spans, widened to whole words by the detector.

Text of any length: each text is tokenized whole (offsets into the original), cut into windows of
``window`` tokens that overlap by ``overlap``, and each token is read from the window in which it lies furthest
from an edge. The weights (``tagger.safetensors``) and their card (``tagger.json``) ship in the package; nothing
is trained at run time and nothing is unpickled.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from privlm.detect.spans import KINDS, Kind, Span
from privlm.models.device import resolve_device
from privlm.models.fingerprints import model_fingerprint
from privlm.models.loading import load_pretrained

LABELS: tuple[str, ...] = ("O", *(kind.value for kind in KINDS))
WEIGHTS_FILE, CARD_FILE = "tagger.safetensors", "tagger.json"
CARD_FORMAT = "privlm-detect-tagger/1"
# A run grows into neighbours whose probability of its kind reaches this share of the kind's threshold (decode).
# Chosen on the hand-written set's development quarter (`privlm bench detect-dev`) among 1 (no growth), 0.5, 0.3,
# 0.2, 0.1 and 0.05: recall rose from 95.2% to 96.8% at 0.1; 0.05 caught two spans more of 744 but redacted more
# characters that are no detail (character precision 64.6% against 65.5%). The thresholds come from validation.
EXTEND_RATIO = 0.1


@dataclass(frozen=True)
class TaggerConfig:
    encoder: str = "minilm"
    feature_layers: tuple[int, ...] = (2, 3)  # hidden-state indices (0 = embeddings); layers above are never run
    hidden: int = 256
    window: int = 128  # tokens per window, special tokens included
    overlap: int = 32
    batch_tokens: int = 1024  # padded tokens per forward pass (windows of like length go together)


@dataclass(frozen=True)
class TaggerCard:
    """What a shipped tagger is: its config, the encoder it reads, its thresholds and how it was made."""

    config: TaggerConfig
    encoder_fingerprint: str
    thresholds: dict[str, float]
    labels: tuple[str, ...] = LABELS
    training: dict[str, object] = field(default_factory=dict)
    format: str = CARD_FORMAT


class TaggerHead(nn.Module):
    def __init__(self, d_in: int, hidden: int, n_labels: int = len(LABELS)) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d_in)
        self.hidden = nn.Linear(d_in, hidden)
        self.out = nn.Linear(hidden, n_labels)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.out(nn.functional.gelu(self.hidden(self.norm(features))))


@dataclass(frozen=True)
class Window:
    """Tokens ``[start, stop)`` of the batch's text number ``text_index``; of them, ``[keep_from, keep_to)`` are read
    from this window."""

    text_index: int
    start: int
    stop: int
    keep_from: int
    keep_to: int


def windows(n_tokens: int, size: int, overlap: int, text_index: int = 0) -> list[Window]:
    """Cover ``n_tokens`` with windows of ``size`` overlapping by ``overlap``; each token kept in exactly one, the
    one in which it lies furthest from a cut edge."""
    if size <= overlap or overlap % 2:
        raise ValueError(f"need an even overlap smaller than the window, got {size=} {overlap=}")
    if n_tokens <= size:
        return [Window(text_index, 0, n_tokens, 0, n_tokens)]
    stride, half = size - overlap, overlap // 2
    starts = [*range(0, n_tokens - size, stride), n_tokens - size]
    result: list[Window] = []
    for i, start in enumerate(starts):
        keep_from = 0 if i == 0 else max(start + half, result[-1].keep_to)
        keep_to = n_tokens if i == len(starts) - 1 else start + size - half
        result.append(Window(text_index, start, start + size, keep_from, keep_to))
    return result


def _batches(cuts: list[Window], most: int, tokens: int) -> list[list[Window]]:
    """``cuts`` (sorted by length) in batches of at most ``most`` windows and ``tokens`` padded tokens: a batch
    pads every window to its longest, and on a CPU the padding costs as much as the text."""
    batches: list[list[Window]] = []
    for window in cuts:
        width = window.stop - window.start + 2
        if batches and len(batches[-1]) < most and width * (len(batches[-1]) + 1) <= tokens:
            batches[-1].append(window)
        else:
            batches.append([window])
    return batches


class TokenFeatures:
    """The frozen encoder's per-token features of texts of any length, with character offsets."""

    def __init__(self, encoder: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, config: TaggerConfig,
                 device: torch.device) -> None:
        self.encoder, self.tokenizer, self.config, self.device = encoder, tokenizer, config, device

    @property
    def dim(self) -> int:
        return int(self.encoder.config.hidden_size) * len(self.config.feature_layers)

    def __call__(self, texts: Sequence[str], batch_size: int = 32) -> list[tuple[np.ndarray, torch.Tensor]]:
        """For each text: its tokens' character offsets (n, 2) and their features (n, dim), on the CPU."""
        encoded = self.tokenizer(list(texts), add_special_tokens=False, return_offsets_mapping=True, verbose=False)
        size = self.config.window - 2  # room for [CLS] and [SEP]
        cuts = [w for i, ids in enumerate(encoded["input_ids"])
                for w in windows(len(ids), size, self.config.overlap, i)]
        features = [torch.zeros(len(ids), self.dim) for ids in encoded["input_ids"]]
        cuts.sort(key=lambda w: w.stop - w.start)
        for batch in _batches(cuts, batch_size, self.config.batch_tokens):
            hidden = self._encode([encoded["input_ids"][w.text_index][w.start:w.stop] for w in batch])
            for row, w in enumerate(batch):
                keep = slice(w.keep_from - w.start + 1, w.keep_to - w.start + 1)  # +1: after [CLS]
                features[w.text_index][w.keep_from:w.keep_to] = hidden[row, keep]
        return [(np.asarray(offsets, dtype=np.int64).reshape(-1, 2), feats)
                for offsets, feats in zip(encoded["offset_mapping"], features, strict=True)]

    @torch.inference_mode()
    def _encode(self, pieces: list[list[int]]) -> torch.Tensor:
        cls, sep, pad = self.tokenizer.cls_token_id, self.tokenizer.sep_token_id, self.tokenizer.pad_token_id
        length = max(len(p) for p in pieces) + 2
        ids = torch.full((len(pieces), length), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, piece in enumerate(pieces):
            ids[row, :len(piece) + 2] = torch.tensor([cls, *piece, sep])
            mask[row, :len(piece) + 2] = 1
        out = self.encoder(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                           output_hidden_states=True)
        return torch.cat([out.hidden_states[i] for i in self.config.feature_layers], dim=-1).float().cpu()


def load_features(config: TaggerConfig, device: str | torch.device = "auto") -> tuple[TokenFeatures, str]:
    """The encoder's feature extractor and the encoder's fingerprint."""
    resolved = resolve_device(device)
    loaded = load_pretrained(config.encoder, device=resolved, causal_lm_head=False)
    _drop_layers_above(loaded.model, max(config.feature_layers))
    embeddings = loaded.model.get_input_embeddings().weight
    assert isinstance(embeddings, torch.Tensor)
    fingerprint = model_fingerprint(embeddings, loaded.model.config.to_dict())
    return TokenFeatures(loaded.model, loaded.tokenizer, config, resolved), fingerprint


def _drop_layers_above(encoder: PreTrainedModel, keep: int) -> None:
    # The head reads no layer above ``keep``: not running them halves the time on a CPU (a BERT-like stack).
    body = getattr(encoder, "encoder", None)
    stack = getattr(body, "layer", None)
    if isinstance(body, nn.Module) and isinstance(stack, nn.ModuleList) and keep < len(stack):
        body.layer = stack[:keep]


def decode(text: str, offsets: np.ndarray, probabilities: np.ndarray, thresholds: Mapping[Kind, float],
           extend: float = EXTEND_RATIO) -> list[Span]:
    """Runs of tokens of one kind as spans, by hysteresis: a token whose probability of some kind reaches that
    kind's threshold is of the most probable such kind (a seed); a run then grows into each untagged neighbour
    whose probability of the run's kind reaches ``extend`` times the threshold ("Capital" seeds, "One" joins). A
    run never crosses a line break (a signature's name and the email under it are two details)."""
    limits = np.array([thresholds.get(kind, 0.5) for kind in KINDS])
    kind_probs = probabilities[:, 1:]
    passing = np.where(kind_probs >= limits, kind_probs, -1.0)
    best = passing.argmax(axis=1)
    label = np.where(passing[np.arange(len(best)), best] >= 0, best, -1)
    label[offsets[:, 1] <= offsets[:, 0]] = -1  # special and empty tokens are nobody's
    _grow(text, offsets, kind_probs, label, limits * extend)
    spans: list[Span] = []
    run: list[int] = []
    for i in range(len(offsets) + 1):
        tagged = i < len(offsets) and label[i] >= 0
        if tagged and run and label[run[-1]] == label[i] and _same_line(text, offsets, run[-1], i):
            run.append(i)
            continue
        if run:
            kind = int(label[run[0]])
            score = float(kind_probs[run, kind].max())
            spans.append(Span(int(offsets[run[0], 0]), int(offsets[run[-1], 1]), KINDS[kind], min(score, 1.0),
                              "tagger"))
        run = [i] if tagged else []
    return spans


def _same_line(text: str, offsets: np.ndarray, before: int, after: int) -> bool:
    return "\n" not in text[offsets[before, 1]:offsets[after, 0]]


def _grow(text: str, offsets: np.ndarray, kind_probs: np.ndarray, label: np.ndarray, floors: np.ndarray) -> None:
    """Grow every run of ``label`` (in place) into untagged neighbours on its line whose probability of the run's
    kind reaches that kind's floor, until none does."""
    frontier = [int(i) for i in np.flatnonzero(label >= 0)]
    while frontier:
        i = frontier.pop()
        for j in (i - 1, i + 1):
            if (0 <= j < len(label) and label[j] == -1 and offsets[j, 1] > offsets[j, 0]
                    and kind_probs[j, label[i]] >= floors[label[i]]
                    and _same_line(text, offsets, min(i, j), max(i, j))):
                label[j] = label[i]
                frontier.append(j)


class TaggerLayer:
    """The tagger as a detection layer."""

    name = "tagger"

    def __init__(self, features: TokenFeatures, head: TaggerHead, card: TaggerCard) -> None:
        self.features, self.head, self.card = features, head.to(features.device).eval(), card
        self.thresholds: dict[Kind, float] = {Kind(k): v for k, v in card.thresholds.items()}

    @classmethod
    def load(cls, directory: str | Path, *, device: str | torch.device = "auto") -> TaggerLayer:
        card = read_card(Path(directory))
        features, fingerprint = load_features(card.config, device)
        if fingerprint != card.encoder_fingerprint:
            raise ValueError(f"the tagger at {directory} was trained on another {card.config.encoder!r} "
                             f"(fingerprint {card.encoder_fingerprint[:12]}..., this one {fingerprint[:12]}...)")
        head = TaggerHead(features.dim, card.config.hidden)
        head.load_state_dict(load_file(str(Path(directory) / WEIGHTS_FILE)))
        return cls(features, head, card)

    @classmethod
    def packaged(cls, *, device: str | torch.device = "auto") -> TaggerLayer:
        return cls.load(packaged_dir(), device=device)

    @torch.inference_mode()
    def probabilities(self, texts: Sequence[str]) -> list[tuple[np.ndarray, np.ndarray]]:
        """Each text's token offsets and label probabilities (n, len(LABELS))."""
        result = []
        for offsets, feats in self.features(texts):
            probs = torch.softmax(self.head(feats.to(self.features.device)), dim=-1) if len(feats) else feats
            result.append((offsets, probs.float().cpu().numpy().reshape(len(offsets), len(LABELS))))
        return result

    def detect(self, texts: Sequence[str]) -> list[list[Span]]:
        return [decode(text, offsets, probs, self.thresholds)
                for text, (offsets, probs) in zip(texts, self.probabilities(texts), strict=True)]


def packaged_dir() -> Path:
    return Path(str(resources.files("privlm") / "detect" / "data"))


def write_tagger(directory: Path, head: TaggerHead, card: TaggerCard) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    weights = {k: v.detach().cpu().contiguous() for k, v in head.state_dict().items()}
    save_file(weights, str(directory / WEIGHTS_FILE), metadata={"format": CARD_FORMAT})
    (directory / CARD_FILE).write_text(json.dumps(asdict(card), indent=2, sort_keys=True) + "\n")


def read_card(directory: Path) -> TaggerCard:
    raw = json.loads((directory / CARD_FILE).read_text())
    if raw.get("format") != CARD_FORMAT:
        raise ValueError(f"{directory / CARD_FILE} is not a {CARD_FORMAT} card")
    if tuple(raw["labels"]) != LABELS:
        raise ValueError(f"{directory / CARD_FILE} has labels {raw['labels']}, this privlm knows {list(LABELS)}")
    config = TaggerConfig(**{**raw["config"], "feature_layers": tuple(raw["config"]["feature_layers"])})
    return TaggerCard(config=config, encoder_fingerprint=raw["encoder_fingerprint"], thresholds=raw["thresholds"],
                      labels=LABELS, training=raw.get("training", {}))


__all__ = ["LABELS", "TaggerCard", "TaggerConfig", "TaggerHead", "TaggerLayer", "TokenFeatures", "decode",
           "load_features", "packaged_dir", "read_card", "windows", "write_tagger"]
