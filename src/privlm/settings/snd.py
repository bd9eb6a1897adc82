"""Split-N-Denoise's command options, declared once: :class:`SndServeSettings` (``privlm snd serve``, the vendor's
server) and :class:`SndTrainSettings` (``privlm snd train``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from privlm.settings.options import SettingError, check_fields, flag_of, option
from privlm.settings.service import DEVICES, ReplicatedSettings

__all__ = ["LAYOUTS", "READOUTS", "SOURCES", "VARIANTS", "Layout", "Readout", "SndServeSettings", "SndTrainSettings",
           "Variant"]

# The denoiser's shape (privlm.snd.denoiser reads them from here): who sees what, how rows are laid out, where
# the output is read.
Variant = Literal["snd", "server", "local"]
VARIANTS: tuple[Variant, ...] = get_args(Variant)
Layout = Literal["fused", "sequence"]
LAYOUTS: tuple[Layout, ...] = get_args(Layout)
Readout = Literal["e_n", "query"]
READOUTS: tuple[Readout, ...] = get_args(Readout)
SOURCES = ("wordnet", "fortunes", "tweets")
MAX_BATCH_ROWS = 64  # the server's micro-batch: sentences
MAX_WAIT_MS = 5.0  # the server's micro-batch: the longest wait for more


@dataclass(frozen=True)
class SndServeSettings(ReplicatedSettings):
    """The vendor's SnD server: noisy token embeddings in, pooled embeddings out."""

    model: str = option("minilm", help="Model name or path.")
    denoisers: tuple[str, ...] = option((), flag="denoiser", help="Denoiser folders to offer (repeatable; default: "
                                                                  "the shipped ones).")
    max_batch_rows: int = option(MAX_BATCH_ROWS, minimum=1, help="Micro-batch size bound (sentences).")
    max_wait_ms: float = option(MAX_WAIT_MS, positive=True, help="Micro-batch wait bound, in milliseconds.")


@dataclass(frozen=True)
class SndTrainSettings:
    """Training a denoiser on public text with synthetic d_chi noise."""

    out: str = option("runs/denoiser", help="Output folder (weights, card, checkpoints).")
    model: str = option("minilm", help="Base model name or path.")
    sources: tuple[str, ...] = option(("wordnet",), separator=",", help="Public corpus sources (wordnet, "
                                      "fortunes, tweets), comma-separated or repeated.")
    max_texts: int = option(60_000, minimum=1, help="Texts drawn from the corpus.")
    eta_min: float = option(10.0, positive=True, help="Smallest training eta (eta-conditioned model).")
    eta_max: float = option(200.0, positive=True, help="Largest training eta (eta-conditioned model).")
    etas: tuple[float, ...] = option((), separator=",", help="Train on these etas only (one model per eta group), "
                                                             "comma-separated or repeated; overrides the range.")
    variant: Variant = option("snd", choices=VARIANTS, help="snd, server (sees e_n and X~ only) or local (e_n zeroed).")
    clip: bool = option(True, help="Clip noisy embeddings to the vocabulary's max norm.")
    minutes: float = option(40.0, positive=True, help="Wall-clock budget.")
    max_steps: int = option(100_000, minimum=1, help="Step budget.")
    batch_size: int = option(32, minimum=1, help="Texts per step.")
    learning_rate: float = option(3e-4, positive=True, help="Peak AdamW learning rate.")
    max_tokens: int = option(64, minimum=1, help="Texts longer than this are left out (counted).")
    layout: Layout = option("fused", choices=LAYOUTS, help="fused (X~_i and Z~_i per row) or sequence ([e_n; X~; Z~] "
                                                        "as in the paper).")
    layers: int | None = option(None, minimum=1, help="Denoiser layers (default: sized after the paper).")
    heads: int | None = option(None, minimum=1, help="Denoiser attention heads.")
    d_ff: int | None = option(None, minimum=1, help="Denoiser feed-forward width.")
    residual: bool = option(True, help="Add the head's output to e_n (--no-residual: the paper's output at "
                                       "position 0 alone).")
    readout: Readout = option("e_n", choices=READOUTS, help="e_n (read at e_n's row, the paper) or query (an extra "
                                                        "learned row).")
    eval_every: int = option(250, minimum=1, help="Validate and checkpoint every N steps.")
    patience: int = option(6, minimum=1, help="Early stop after N evaluations without gain.")
    seed: int = option(0, minimum=0, help="Seed of the corpus draw, the split and training.")
    resume: bool = option(False, help="Continue from the checkpoint in --out.")
    device: str = option("auto", choices=DEVICES, help="auto, cpu or cuda.")

    def __post_init__(self) -> None:
        check_fields(self)
        unknown = sorted(set(self.sources) - set(SOURCES))
        if unknown or not self.sources:
            raise SettingError(f"sources are {', '.join(SOURCES)}; got {', '.join(unknown) or 'none'}",
                               flag_of(SndTrainSettings, "sources"))
        if any(not eta > 0 for eta in self.etas):
            raise SettingError(f"etas must be > 0, got {self.etas}", flag_of(SndTrainSettings, "etas"))

    def model_overrides(self) -> dict[str, object]:
        """The denoiser's shape as its config's overrides (sizes left out keep the paper's)."""
        sizes = {"n_layers": self.layers, "n_heads": self.heads, "d_ff": self.d_ff}
        return {"layout": self.layout, "residual": self.residual, "readout": self.readout} | {
            name: size for name, size in sizes.items() if size is not None}
