"""The SnD denoiser: a small transformer that turns the server's noisy sentence embedding back
into an estimate of the clean one, using what only the client knows.

Two input layouts:
  - ``sequence`` (the paper): H0 = [e_n ; X~_1..n ; Z~_1..n], 2n + 1 rows, with learned segment
    embeddings telling e_n, X~ and Z~ apart (the reference code has none) and token-position
    embeddings shared by X~_i and Z~_i so that row i of each can be paired;
  - ``fused`` (privlm's default): H0 = [e_n ; W [X~_i ; Z~_i]], n + 1 rows. Same inputs, but each
    token's X~_i and Z~_i enter together, so X_i = X~_i - Z~_i is one linear map away; W starts
    as [I, -I], i.e. the rows start as the user's clean token embeddings. Half the sequence length.
    In the sequence layout the model must learn to subtract rows n positions apart, which it does
    slowly (see README, "Denoiser layout").
Both add segment and position embeddings and, optionally, an embedding of log(eta), so one model
serves a range of privacy levels. L pre-LN transformer layers with a padding mask; the output is
read at position 0 and added to e_n (a residual: at weak noise the best answer is close to e_n);
``residual=False`` reads position 0 alone, as the paper does. ``readout="query"`` prepends a
learned query row and reads the output there, so e_n is an ordinary input row.

Variants (same architecture and training; ``variant``):
  - ``snd``:    [e_n ; X~ ; Z~]            the user-side denoiser of the paper
  - ``server``: [e_n ; X~]                 what the server itself could do: it never sees Z~ or X
  - ``local``:  [0 ; X~ ; Z~]              e_n zeroed: a small local model of the user's own text
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Self

import torch
from pydantic import BaseModel, ConfigDict, Field, PositiveInt, model_validator
from torch import nn

from privlm.settings.snd import Layout, Readout, Variant

_ETA_FREQUENCIES = 8
EtaBound = Annotated[float, Field(gt=0, allow_inf_nan=False)]


class DenoiserConfig(BaseModel):
    """The denoiser's architecture, part of its card: checked on construction and on every read."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    dim: PositiveInt
    n_layers: PositiveInt = 3
    n_heads: PositiveInt = 6
    d_ff: PositiveInt = 768
    dropout: Annotated[float, Field(ge=0, lt=1)] = 0.1
    max_tokens: PositiveInt = 512
    variant: Variant = "snd"
    layout: Layout = "fused"
    eta_conditioned: bool = True
    residual: bool = True  # output = e_n + head(h_0); False: head(h_0) alone, as in the paper
    readout: Readout = "e_n"  # read at e_n's row (the paper), or at an extra learned query row before it
    eta_min: EtaBound = 10.0
    eta_max: EtaBound = 200.0

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if self.dim % self.n_heads:
            raise ValueError(f"dim={self.dim} must be divisible by n_heads={self.n_heads}")
        if self.eta_min > self.eta_max:
            raise ValueError(f"eta_min={self.eta_min} must be <= eta_max={self.eta_max}")
        return self

    @classmethod
    def for_model(cls, dim: int, **overrides: Any) -> DenoiserConfig:
        """Sizes after the SnD paper's Table 8, scaled to the model width (MiniLM: 384 -> 3 layers, 6 heads)."""
        heads = next(h for h in ((6, 8) if dim <= 512 else (8, 12, 16)) + (4, 2, 1) if dim % h == 0)
        return cls(**{"dim": dim, "n_heads": heads, "d_ff": 2 * dim, "n_layers": 3 if dim <= 512 else 6} | overrides)


class Denoiser(nn.Module):
    def __init__(self, config: DenoiserConfig) -> None:
        super().__init__()
        self.config = config
        d = config.dim
        self.segment = nn.Embedding(3, d)
        self.position = nn.Embedding(config.max_tokens, d)
        if config.layout == "fused":
            sees_noise = config.variant != "server"
            self.token_in = nn.Linear(2 * d if sees_noise else d, d)
            with torch.no_grad():  # start from X = X~ - Z~ (or from X~ when Z~ is not seen)
                eye = torch.eye(d)
                self.token_in.weight.copy_(torch.cat([eye, -eye], dim=1) if sees_noise else eye)
                self.token_in.bias.zero_()
        if config.readout == "query":
            self.query = nn.Parameter(torch.randn(d) * 0.02)
        self.eta_embedding = nn.Sequential(nn.Linear(2 * _ETA_FREQUENCIES, d), nn.GELU(), nn.Linear(d, d))
        layer = nn.TransformerEncoderLayer(d, config.n_heads, config.d_ff, config.dropout, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.layers = nn.TransformerEncoder(layer, config.n_layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, d)
        # Small learned embeddings (BERT's std 0.02): nn.Embedding's default N(0, 1) rows have norm ~sqrt(d)
        # and would drown token vectors of norm ~1.
        nn.init.normal_(self.segment.weight, std=0.02)
        nn.init.normal_(self.position.weight, std=0.02)
        if config.residual:
            nn.init.zeros_(self.head.weight)  # start as the identity on e_n
            nn.init.zeros_(self.head.bias)

    def eta_features(self, eta: torch.Tensor) -> torch.Tensor:
        """Fourier features of log(eta) rescaled to [0, 1] over the training range."""
        low, high = math.log(self.config.eta_min), math.log(self.config.eta_max)
        t = (eta.clamp_min(1e-12).log() - low) / max(high - low, 1e-6)
        k = torch.arange(1, _ETA_FREQUENCIES + 1, device=eta.device, dtype=eta.dtype)
        angles = t.unsqueeze(-1) * k * math.pi
        return torch.cat([angles.sin(), angles.cos()], dim=-1)

    def forward(self, e_n: torch.Tensor, noisy: torch.Tensor, noise: torch.Tensor,
                attention_mask: torch.Tensor, eta: torch.Tensor | None = None) -> torch.Tensor:
        """e_n (B, d), noisy X~ and noise Z~ (B, n, d), mask (B, n), eta (B,) -> denoised (B, d)."""
        batch, n, _ = noisy.shape
        if n > self.config.max_tokens:
            raise ValueError(f"sequence of {n} tokens exceeds the denoiser's max_tokens={self.config.max_tokens}")
        if self.config.variant == "local":
            e_n = torch.zeros_like(e_n)
        segments = self.segment.weight
        positions = self.position.weight[:n]
        sees_noise = self.config.variant != "server"
        parts = [(e_n + segments[0]).unsqueeze(1)]
        valid = [torch.ones(batch, 1, dtype=torch.bool, device=noisy.device), attention_mask.bool()]
        if self.config.layout == "fused":
            tokens = self.token_in(torch.cat([noisy, noise], dim=-1) if sees_noise else noisy)
            parts.append(tokens + positions + segments[1])
        else:
            parts.append(noisy + positions + segments[1])
            if sees_noise:
                parts.append(noise + positions + segments[2])
                valid.append(attention_mask.bool())
        if self.config.readout == "query":  # e_n becomes one input row among others; it can be ignored
            parts.insert(0, self.query.expand(batch, 1, -1))
            valid.insert(0, valid[0])
        h = torch.cat(parts, dim=1)
        if self.config.eta_conditioned:
            if eta is None:
                raise ValueError("this denoiser is eta-conditioned: pass eta")
            h = h + self.eta_embedding(self.eta_features(eta.to(h.dtype))).unsqueeze(1)
        h = self.layers(h, src_key_padding_mask=~torch.cat(valid, dim=1))
        out = self.head(self.norm(h[:, 0]))
        return e_n + out if self.config.residual else out
