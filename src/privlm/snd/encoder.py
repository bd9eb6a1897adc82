"""The private-embedding pipeline, in-process: privatize -> server half -> denoise.

``SnDEncoder(model="minilm", eta=50).encode(texts)`` returns a float32 (n, d) array like
sentence-transformers' ``encode``. Here the "server" is the same process; ``privlm.serve`` puts
a network between the two halves without changing the math.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from privlm._validation import check_choice, check_positive_int
from privlm.mechanisms import make_generator
from privlm.models import SplitModel, TokenEmbedder
from privlm.models.batching import map_in_length_order
from privlm.models.client import check_texts
from privlm.snd.artefacts import default_denoiser_dir, load_denoiser, warn_if_outside_range
from privlm.snd.denoiser import Denoiser
from privlm.snd.privatizer import PrivateBatch, SnDPrivatizer

ServerFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (X~, mask) -> e_n


@dataclass
class EncodeReport:
    """What happened to the inputs of the last ``encode`` call."""

    texts: int = 0
    tokens: int = 0
    truncated: int = 0
    server_calls: int = 0
    truncated_indices: list[int] = field(default_factory=list)


def resolve_model(model: str | Path | SplitModel, device: str | torch.device) -> SplitModel:
    return model if isinstance(model, SplitModel) else SplitModel.from_pretrained(model, device=device)


class SnDEncoder:
    """Split-N-Denoise sentence embeddings at privacy level ``eta`` (eta * d_chi-privacy per token).

    ``denoiser``: ``"default"`` (the one shipped for a packaged model), a folder written by
    ``privlm snd train``, or None for no denoising (the clipped TokEmbPriv ablation).
    ``clip``: None follows the denoiser's training; True/False forces it.
    """

    def __init__(self, model: str | Path | TokenEmbedder = "minilm", *, eta: float,
                 denoiser: str | Path | None = "default", clip: bool | None = None, sampler: str = "gamma",
                 device: str | torch.device = "auto", batch_size: int = 64, truncation: str = "warn",
                 generator: torch.Generator | None = None, server: ServerFn | None = None) -> None:
        self.model = model if isinstance(model, TokenEmbedder) else resolve_model(model, device)
        if server is None and not isinstance(self.model, SplitModel):
            raise ValueError("a client-only model needs a server function (see privlm.snd.Client)")
        self._server = server or self.model.encode  # type: ignore[union-attr]
        self.batch_size = check_positive_int("batch_size", batch_size)
        self.truncation = check_choice("truncation", truncation, ("warn", "error"))
        self.denoiser, self.card = self._load_denoiser(denoiser)
        if clip is None:
            clip = bool(self.card["training"]["clip"]) if self.card else True  # type: ignore[index]
        self.privatizer = SnDPrivatizer(self.model, eta=eta, clip=clip, sampler=sampler,
                                        generator=generator or make_generator(device=self.model.device))
        if self.card:
            warn_if_outside_range(self.card, self.privatizer.eta)
        self.last_report = EncodeReport()

    @property
    def eta(self) -> float:
        return self.privatizer.eta

    @property
    def variant(self) -> str:
        return self.denoiser.config.variant if self.denoiser is not None else "none"

    def _load_denoiser(self, denoiser: str | Path | None) -> tuple[Denoiser | None, dict | None]:
        if denoiser is None:
            return None, None
        if denoiser == "default":
            path = default_denoiser_dir(str(self.model.name))
            if not (path / "denoiser.json").exists():
                raise ValueError(f"no default denoiser ships for model {self.model.name!r}; pass denoiser=<folder> "
                                 "from `privlm snd train`, or denoiser=None")
            denoiser = path
        return load_denoiser(denoiser, model=self.model)

    # --- the three steps ------------------------------------------------------------------------
    def privatize(self, texts: Sequence[str], *, truncation: str | None = None) -> PrivateBatch:
        """Client: tokenize, embed, noise, clip."""
        return self.privatizer.privatize(texts, truncation=truncation or self.truncation)

    def server_encode(self, private: PrivateBatch) -> torch.Tensor:
        """Server: sees X~ and the mask only (in-process here; over HTTP in ``privlm.snd.Client``)."""
        self.last_report.server_calls += 1
        return self._server(private.noisy, private.attention_mask).to(private.noisy.device)

    @torch.inference_mode()
    def denoise(self, private: PrivateBatch, e_n: torch.Tensor) -> torch.Tensor:
        """Client: D(e_n, X~, Z~), normalised like the base model's embeddings."""
        if self.denoiser is None:
            return e_n
        eta = torch.full((len(e_n),), self.eta, device=e_n.device)
        out = self.denoiser(e_n, private.noisy, private.noise, private.attention_mask, eta)
        return torch.nn.functional.normalize(out, dim=-1) if self.model.normalize else out

    @torch.inference_mode()
    def encode_batch(self, texts: Sequence[str]) -> np.ndarray:
        private = self.privatize(texts, truncation="count")  # encode() has already reported truncation
        self._count(private)
        if self.variant == "local":  # the local-only model never needs the server
            e_n = torch.zeros(len(texts), self.model.hidden_size, device=self.model.device)
        else:
            e_n = self.server_encode(private)
        return self.denoise(private, e_n).float().cpu().numpy()

    def encode(self, texts: Sequence[str], *, batch_size: int | None = None) -> np.ndarray:
        """(n, d) float32 private sentence embeddings, in the order of ``texts``."""
        texts = self.prepare(texts)
        return map_in_length_order(texts, self.encode_batch, batch_size=batch_size or self.batch_size)

    def prepare(self, texts: Sequence[str]) -> list[str]:
        """Check every text before any work; warn about (or refuse) over-long ones; reset the report."""
        texts = list(texts) if not isinstance(texts, str) else texts
        self.last_report = EncodeReport()
        check_texts(texts)
        long = [i for i, n in enumerate(self.model.token_counts(texts)) if n > self.model.max_length]
        if long:
            message = (f"{len(long)} of {len(texts)} texts are longer than max_length={self.model.max_length} "
                       f"tokens (indices {long[:10]}{'...' if len(long) > 10 else ''})")
            if self.truncation == "error":
                raise ValueError(message + "; pass truncation='warn' to truncate them")
            warnings.warn(message + "; they were truncated", stacklevel=3)
        self.last_report.truncated_indices = long
        return texts

    def _count(self, private: PrivateBatch) -> None:
        report = self.last_report
        report.texts += len(private.batch.truncated)
        report.tokens += int(private.attention_mask.sum())
        report.truncated += private.batch.n_truncated


class PlainEncoder:
    """The non-private reference (eta = infinity): the clean model, same ``encode`` interface."""

    def __init__(self, model: str | Path | SplitModel = "minilm", *, device: str | torch.device = "auto",
                 batch_size: int = 64) -> None:
        self.model = resolve_model(model, device)
        self.batch_size = batch_size
        self.eta = float("inf")

    def encode(self, texts: Sequence[str], *, batch_size: int | None = None) -> np.ndarray:
        return self.model.encode_texts(list(texts), batch_size=batch_size or self.batch_size).numpy()
