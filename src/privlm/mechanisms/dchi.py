"""The d_chi ("metric LDP") Laplace mechanism on embedding vectors.

Noise z in R^d has density proportional to exp(-eta * ||z||_2). It is sampled as
    r ~ Gamma(shape=d, scale=1/eta)      (one radius per vector)
    v = g / ||g||,  g ~ N(0, I_d)        (uniform direction on the sphere)
    z = r * v
so E||z|| = d / eta, and M(x) = x + z satisfies eta * ||x - x'||_2 -privacy.

``sampler="legacy"`` reproduces the public SnD reference code, which draws
Gamma(d, 1/eta) * Uniform[-1, 1] independently per coordinate. That is NOT the distribution
above (for d = 768 its noise is about 16x larger); it exists only to compare with the
paper's tables.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from privlm._validation import check_choice, check_float_tensor, check_positive_finite
from privlm.mechanisms.randomness import resolve_generator

SAMPLERS = ("gamma", "legacy")


def _gamma(shape: float, size: tuple[int, ...], *, scale: float, generator: torch.Generator,
           device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Gamma(shape, scale) samples, drawn in float64 from ``generator``.

    torch.distributions.Gamma cannot take a generator; its sampler ``torch._standard_gamma`` can.
    """
    concentration = torch.full(size, float(shape), device=device, dtype=torch.float64)
    return (torch._standard_gamma(concentration, generator=generator) * scale).to(dtype)


def sample_dchi_noise(
    size: tuple[int, ...] | torch.Size,
    *,
    eta: float,
    sampler: str = "gamma",
    generator: torch.Generator | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Noise of shape ``size`` (last axis = d) with density proportional to exp(-eta ||z||)."""
    eta = check_positive_finite("eta", eta)
    check_choice("sampler", sampler, SAMPLERS)
    size = tuple(size)
    if len(size) < 1 or any(n < 1 for n in size):
        raise ValueError(f"size must be a non-empty shape with positive sides, got {size}")
    device = torch.device(device)
    generator = resolve_generator(generator, device)
    *batch, d = size
    if sampler == "legacy":
        radius = _gamma(d, size, scale=1.0 / eta, generator=generator, device=device, dtype=dtype)
        uniform = torch.rand(size, generator=generator, device=device, dtype=dtype) * 2 - 1
        return radius * uniform
    radius = _gamma(d, tuple(batch), scale=1.0 / eta, generator=generator, device=device,
                                  dtype=dtype)
    direction = torch.randn(size, generator=generator, device=device, dtype=dtype)
    direction = direction / direction.norm(dim=-1, keepdim=True)
    return radius.unsqueeze(-1) * direction


@dataclass(frozen=True, kw_only=True)
class DChiLaplace:
    """The d_chi Laplace mechanism M(x) = x + z, with z as in :func:`sample_dchi_noise`.

    Parameters are keyword-only and validated on construction.
    """

    eta: float
    sampler: str = "gamma"

    def __post_init__(self) -> None:
        object.__setattr__(self, "eta", check_positive_finite("eta", self.eta))
        check_choice("sampler", self.sampler, SAMPLERS)

    def noise(self, like: torch.Tensor, *, generator: torch.Generator | None = None) -> torch.Tensor:
        """Noise with the shape, device and dtype of ``like`` (one radius per row)."""
        return sample_dchi_noise(like.shape, eta=self.eta, sampler=self.sampler, generator=generator,
                                 device=like.device, dtype=like.dtype)

    def randomise(self, x: torch.Tensor, *, generator: torch.Generator | None = None) -> torch.Tensor:
        """Return x + z for every vector along the last axis of ``x``."""
        check_float_tensor("x", x)
        return x + self.noise(x, generator=generator)

    def expected_noise_norm(self, dim: int) -> float:
        """E||z|| = d / eta for the correct sampler."""
        return dim / self.eta
