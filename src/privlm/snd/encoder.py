"""The private-embedding pipeline, in-process: privatize -> server half -> denoise.

``SnDEncoder(model="minilm", eta=20).encode(texts)`` returns a float32 (n, d) array like
sentence-transformers' ``encode``; ``encode_with_report`` also returns what happened to the inputs.
Here the "server" is the same process; ``privlm.snd.Client`` puts a network between the two halves
without changing the math: it drives the same I/O-free steps (:class:`BaseEncoder`).

Everything one call needs (its tokens, its generator, its report) lives in that call, so one encoder
serves concurrent callers. With a ledger, the whole call's release is checked and spent first.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from privlm.accounting import Ledger, Receipt, charge
from privlm.mechanisms import NoiseSampler, make_generator
from privlm.models import SplitModel, TokenEmbedder, Tokens, TruncationPolicy
from privlm.models.batching import length_sorted_batches
from privlm.models.client import TRUNCATION_POLICIES
from privlm.snd.artefacts import default_denoiser_dir, load_denoiser, warn_if_outside_range
from privlm.snd.card import DenoiserCard
from privlm.snd.denoiser import Denoiser
from privlm.snd.privatizer import PrivateBatch, SnDPrivatizer
from privlm.validation import check_choice, check_positive_int

ServerFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (X~, mask) -> e_n
LOCAL_PRINCIPAL = "local"


@dataclass
class EncodeReport:
    """What happened to the inputs of one ``encode_with_report`` call."""

    texts: int = 0
    tokens: int = 0  # token rows privatized (special tokens included, truncated texts as cut)
    truncated: int = 0
    server_calls: int = 0
    truncated_indices: list[int] = field(default_factory=list)
    unknown_indices: list[int] = field(default_factory=list)  # texts with unknown tokens ([UNK])
    contentless_indices: list[int] = field(default_factory=list)  # texts that are special tokens only
    receipt: Receipt | None = None  # the ledger's record of this call's spend, when there is a ledger


@dataclass(frozen=True)
class Encoded:
    vectors: np.ndarray  # (n, d) float32, in the order of the texts
    report: EncodeReport


@dataclass
class EncodeCall:
    """The state of one call: its tokens, batches, generator and report (never shared between calls)."""

    tokens: Tokens
    batches: list[list[int]]
    generator: torch.Generator
    report: EncodeReport


@dataclass(frozen=True)
class EncoderOptions:
    """An encoder's rarely-set knobs. ``clip``: None follows the denoiser's training; True/False forces it.
    ``sampler``: how the noise is drawn. ``batch_size``: texts a batch. ``truncation``: over-long texts are cut with
    a warning, or refused."""

    clip: bool | None = None
    sampler: NoiseSampler = "gamma"
    batch_size: int = 64
    truncation: TruncationPolicy = "warn"


def resolve_model(model: str | Path | SplitModel, device: str | torch.device) -> SplitModel:
    return model if isinstance(model, SplitModel) else SplitModel.from_pretrained(model, device=device)


class BaseEncoder:
    """The I/O-free steps of Split-N-Denoise at privacy level ``eta`` (eta * d_chi-privacy per token): privatize,
    begin a call (tokenize, warn, spend), denoise. Releasing X~ to the server half is the driver's:
    :class:`SnDEncoder` in this process, ``privlm.snd.Client`` and ``AsyncClient`` over HTTP.

    ``denoiser``: ``"default"`` (the one shipped for a packaged model), a folder written by
    ``privlm snd train``, or None for no denoising (the clipped TokEmbPriv ablation).
    ``options``: clipping, the sampler, the batch size and the truncation policy (:class:`EncoderOptions`).
    ``generator``: one stream for every call (reproducible, but calls then share it); None gives each
    call a fresh OS-seeded generator.
    ``ledger``: every call's release (eta per token row) is spent there first, for the call's principal.
    """

    def __init__(self, model: TokenEmbedder, *, eta: float, denoiser: str | Path | None = "default",
                 generator: torch.Generator | None = None, ledger: Ledger | None = None,
                 options: EncoderOptions = EncoderOptions()) -> None:
        self.model = model
        self.batch_size = check_positive_int("batch_size", options.batch_size)
        self.truncation: TruncationPolicy = check_choice("truncation", options.truncation, ("warn", "error"))
        self.denoiser, self.card = self._load_denoiser(denoiser)
        clip = options.clip
        clip = self.card.training.clip if clip is None and self.card else (True if clip is None else clip)
        self.privatizer = SnDPrivatizer(self.model, eta=eta, clip=clip, sampler=options.sampler, generator=generator)
        if self.card:
            warn_if_outside_range(self.card, self.eta)
        self.ledger = ledger

    @property
    def eta(self) -> float:
        return float(self.privatizer.eta)

    @property
    def variant(self) -> str:
        return self.denoiser.config.variant if self.denoiser is not None else "none"

    @property
    def needs_server(self) -> bool:
        """False for the local-only model, which never calls the server (and so releases nothing)."""
        return self.variant != "local"

    def _load_denoiser(self, denoiser: str | Path | None) -> tuple[Denoiser | None, DenoiserCard | None]:
        if denoiser is None:
            return None, None
        if denoiser == "default":
            path = default_denoiser_dir(str(self.model.name))
            if not (path / "denoiser.json").exists():
                raise ValueError(f"no default denoiser ships for model {self.model.name!r}; pass denoiser=<folder> "
                                 "from `privlm snd train`, or denoiser=None")
            denoiser = path
        return load_denoiser(denoiser, model=self.model)

    # --- the I/O-free steps: privatize, begin a call, denoise ---------------------------------------
    def privatize(self, texts: Sequence[str] | Tokens, *, truncation: TruncationPolicy | None = None,
                  generator: torch.Generator | None = None) -> PrivateBatch:
        """Client: tokenize, embed, noise, clip."""
        return self.privatizer.privatize(texts, truncation=truncation or self.truncation, generator=generator)

    @torch.inference_mode()
    def denoise(self, private: PrivateBatch, e_n: torch.Tensor) -> torch.Tensor:
        """Client: D(e_n, X~, Z~), normalised like the base model's embeddings."""
        if self.denoiser is None:
            return e_n
        eta = torch.full((len(e_n),), self.eta, device=e_n.device)
        out = self.denoiser(e_n, private.noisy, private.noise, private.attention_mask, eta)
        return torch.nn.functional.normalize(out, dim=-1) if self.model.normalize else out

    def begin(self, texts: Iterable[str] | Tokens, *, batch_size: int | None = None,
              principal: str = LOCAL_PRINCIPAL, truncation: TruncationPolicy | None = None) -> EncodeCall:
        """Check and tokenize every text once, warn about (or refuse) over-long ones, spend the release."""
        tokens = texts if isinstance(texts, Tokens) else self.model.tokens(texts)
        long = tokens.longer_than(self.model.max_length)
        policy = check_choice("truncation", truncation or self.truncation, TRUNCATION_POLICIES)
        if long and policy != "count":
            message = (f"{len(long)} of {len(tokens)} texts are longer than max_length={self.model.max_length} "
                       f"tokens (indices {long[:10]}{'...' if len(long) > 10 else ''})")
            if policy == "error":
                raise ValueError(message + "; pass truncation='warn' to truncate them")
            warnings.warn(message + "; they were truncated", stacklevel=3)
        unknown, contentless = self.model.with_unknown_tokens(tokens), self.model.without_content(tokens)
        if policy != "count":
            for indices, what in ((unknown, "hold unknown tokens (over-long words, unseen characters)"),
                                  (contentless, "have no content tokens at all (only zero-width characters, say)")):
                if indices:
                    warnings.warn(f"texts {indices[:10]}{'...' if len(indices) > 10 else ''} {what}: their "
                                  "embeddings say little about them", stacklevel=3)
        lengths = [min(n, self.model.max_length) for n in tokens.counts]
        report = EncodeReport(texts=len(tokens), tokens=sum(lengths), truncated=len(long), truncated_indices=long,
                              unknown_indices=unknown, contentless_indices=contentless)
        if self.needs_server:
            report.receipt = next(iter(charge(self.ledger, principal, [self.privatizer.spend(lengths)],
                                              note="snd encode")), None)
        batches = list(length_sorted_batches(tokens.texts, batch_size or self.batch_size))
        generator = self.privatizer.generator or make_generator(device=self.model.device)
        return EncodeCall(tokens=tokens, batches=batches, generator=generator, report=report)

    def no_server_answer(self, private: PrivateBatch) -> torch.Tensor:
        """What the local-only model puts where e_n would be: zeros (its denoiser ignores them)."""
        return torch.zeros(len(private.noisy), self.model.hidden_size, device=self.model.device)

    def blank_rows(self, call: EncodeCall) -> np.ndarray:
        """The (n, d) float32 rows of a call, NaN until a batch fills them."""
        return np.full((len(call.tokens), self.model.hidden_size), np.nan, dtype=np.float32)


class SnDEncoder(BaseEncoder):
    """Split-N-Denoise sentence embeddings in this process (see :class:`BaseEncoder` for the settings).

    ``server``: the server half, (X~, mask) -> e_n; None: the model's own (a :class:`SplitModel`).
    """

    def __init__(self, model: str | Path | TokenEmbedder = "minilm", *, eta: float,
                 denoiser: str | Path | None = "default", device: str | torch.device = "auto",
                 generator: torch.Generator | None = None, server: ServerFn | None = None,
                 ledger: Ledger | None = None, options: EncoderOptions = EncoderOptions()) -> None:
        model = model if isinstance(model, TokenEmbedder) else resolve_model(model, device)
        if server is None:
            if not isinstance(model, SplitModel):
                raise ValueError("a client-only model needs a server function (see privlm.snd.Client)")
            server = model.encode
        self._server = server
        super().__init__(model, eta=eta, denoiser=denoiser, generator=generator, ledger=ledger, options=options)

    def server_encode(self, private: PrivateBatch) -> torch.Tensor:
        """Server: sees X~ and the mask only (in-process here; over HTTP in ``privlm.snd.Client``)."""
        return self._server(private.noisy, private.attention_mask).to(private.noisy.device)

    def encode(self, texts: Iterable[str], *, batch_size: int | None = None) -> np.ndarray:
        """(n, d) float32 private sentence embeddings, in the order of ``texts``."""
        return self.encode_with_report(texts, batch_size=batch_size).vectors

    def encode_with_report(self, texts: Iterable[str] | Tokens, *, batch_size: int | None = None,
                           principal: str = LOCAL_PRINCIPAL, truncation: TruncationPolicy | None = None) -> Encoded:
        """The embeddings and this call's report; ``texts`` may come tokenized already (``model.tokens``).
        ``truncation`` overrides the encoder's policy for this call ("count": cut and report, no warning)."""
        call = self.begin(texts, batch_size=batch_size, principal=principal, truncation=truncation)
        out = self.blank_rows(call)
        for indices in call.batches:
            out[indices] = self.encode_batch(call, indices)
        return Encoded(out, call.report)

    @torch.inference_mode()
    def encode_batch(self, call: EncodeCall, indices: Sequence[int]) -> np.ndarray:
        """One batch of a call: privatize, release to the server, denoise; (len(indices), d) float32."""
        private = self.privatize(call.tokens.subset(indices), generator=call.generator)
        return self.denoise(private, self._release(call, private)).float().cpu().numpy()

    def _release(self, call: EncodeCall, private: PrivateBatch) -> torch.Tensor:
        if not self.needs_server:
            return self.no_server_answer(private)
        call.report.server_calls += 1
        return self.server_encode(private)


class PlainEncoder:
    """The non-private reference (eta = infinity): the clean model, same ``encode`` interface."""

    def __init__(self, model: str | Path | SplitModel = "minilm", *, device: str | torch.device = "auto",
                 batch_size: int = 64) -> None:
        self.model = resolve_model(model, device)
        self.batch_size = batch_size
        self.eta = float("inf")

    def encode(self, texts: Iterable[str], *, batch_size: int | None = None) -> np.ndarray:
        return self.model.encode_texts(list(texts), batch_size=batch_size or self.batch_size).numpy()
