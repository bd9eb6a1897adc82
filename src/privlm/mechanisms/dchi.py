"""The d_chi ("metric LDP") Laplace mechanism on embedding vectors.

Noise z in R^d has density proportional to exp(-eta * ||z||_2). It is sampled as
    r ~ Gamma(shape=d, scale=1/eta)      (one radius per vector)
    v = g / ||g||,  g ~ N(0, I_d)        (uniform direction on the sphere)
    z = r * v
so E||z|| = d / eta, and M(x) = x + z satisfies eta * ||x - x'||_2 -privacy. Since
Gamma(d, 1/eta) = Gamma(d, 1) / eta, noise at any eta is unit noise divided by eta; that is how a
per-row eta (a tensor) is applied, and why one seeded generator gives the same unit draw at every eta.

``sampler="legacy"`` reproduces the public SnD reference code, which draws
Gamma(d, 1/eta) * Uniform[-1, 1] independently per coordinate. That is NOT the distribution
above (for d = 768 its noise is about 16x larger); it exists only to compare with the
paper's tables.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

from privlm.mechanisms.protocol import OutputKind, PrivacyUnit, Spend
from privlm.mechanisms.randomness import resolve_generator
from privlm.validation import check_choice, check_float_tensor, check_level, check_positive_int

NoiseSampler = Literal["gamma", "legacy"]
SAMPLERS: tuple[NoiseSampler, ...] = ("gamma", "legacy")


def _standard_gamma(shape: float, size: tuple[int, ...], *, generator: torch.Generator, device: torch.device,
                    dtype: torch.dtype) -> torch.Tensor:
    """Gamma(shape, 1) samples, drawn in float64 from ``generator``.

    torch.distributions.Gamma cannot take a generator; its sampler ``torch._standard_gamma`` can.
    """
    concentration = torch.full(size, float(shape), device=device, dtype=torch.float64)
    return torch._standard_gamma(concentration, generator=generator).to(dtype)


def _unit_noise(size: tuple[int, ...], sampler: NoiseSampler, generator: torch.Generator, device: torch.device,
                dtype: torch.dtype) -> torch.Tensor:
    """Noise at eta = 1."""
    *batch, d = size
    if sampler == "legacy":
        radius = _standard_gamma(d, size, generator=generator, device=device, dtype=dtype)
        return radius * (torch.rand(size, generator=generator, device=device, dtype=dtype) * 2 - 1)
    radius = _standard_gamma(d, tuple(batch), generator=generator, device=device, dtype=dtype)
    direction = torch.randn(size, generator=generator, device=device, dtype=dtype)
    return radius.unsqueeze(-1) * (direction / direction.norm(dim=-1, keepdim=True))


def _per_vector(eta: float | torch.Tensor, batch: tuple[int, ...], device: torch.device, dtype: torch.dtype
                ) -> float | torch.Tensor:
    """eta as a divisor of (..., d) noise: a float, or a tensor broadcast over the batch axes."""
    if not isinstance(eta, torch.Tensor):
        return eta
    try:
        torch.broadcast_shapes(eta.shape, batch)
    except RuntimeError as error:
        raise ValueError(f"eta of shape {tuple(eta.shape)} does not broadcast to the rows {batch}") from error
    return eta.to(device=device, dtype=dtype).unsqueeze(-1)


def sample_dchi_noise(
    size: tuple[int, ...] | torch.Size,
    *,
    eta: float | torch.Tensor,
    sampler: NoiseSampler = "gamma",
    generator: torch.Generator | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Noise of shape ``size`` (last axis = d) with density proportional to exp(-eta ||z||).

    ``eta`` is a number, or a tensor of one level per row that broadcasts to ``size[:-1]``.
    """
    eta = check_level("eta", eta)
    check_choice("sampler", sampler, SAMPLERS)
    size = tuple(size)
    if len(size) < 1 or any(n < 1 for n in size):
        raise ValueError(f"size must be a non-empty shape with positive sides, got {size}")
    device = torch.device(device)
    generator = resolve_generator(generator, device)
    return _unit_noise(size, sampler, generator, device, dtype) / _per_vector(eta, size[:-1], device, dtype)


@dataclass(frozen=True, kw_only=True, eq=False)
class DChiLaplace:
    """The d_chi Laplace mechanism M(x) = x + z, with z as in :func:`sample_dchi_noise`.

    ``eta`` is one level for every row, or a tensor of levels that broadcasts to the rows ``x.shape[:-1]``.
    Neighbouring relation: any two inputs of the same shape; the claim for x, x' is
    sum over rows i of eta_i * ||x_i - x'_i||_2 (composition over rows).
    """

    unit: ClassVar[PrivacyUnit] = PrivacyUnit.ETA_TOKEN  # what spend counts: eta per row
    eta: float | torch.Tensor
    sampler: NoiseSampler = "gamma"

    def __post_init__(self) -> None:
        object.__setattr__(self, "eta", check_level("eta", self.eta))
        check_choice("sampler", self.sampler, SAMPLERS)

    @property
    def output_kind(self) -> OutputKind:
        return "continuous"

    def noise(self, like: torch.Tensor, *, generator: torch.Generator | None = None) -> torch.Tensor:
        """Noise with the shape, device and dtype of ``like`` (one radius per row)."""
        return sample_dchi_noise(like.shape, eta=self.eta, sampler=self.sampler, generator=generator,
                                 device=like.device, dtype=like.dtype)

    def sample(self, x: torch.Tensor, *, num_samples: int | None = None,
               generator: torch.Generator | None = None) -> torch.Tensor:
        """x + z for every vector along the last axis of ``x``; ``num_samples=n`` stacks n releases first."""
        check_float_tensor("x", x)
        if num_samples is not None:
            x = x.expand(check_positive_int("num_samples", num_samples), *x.shape)
        return x + self.noise(x, generator=generator)

    def randomise(self, x: torch.Tensor, *, generator: torch.Generator | None = None) -> torch.Tensor:
        """Deprecated name of :meth:`sample` (every mechanism now samples through the one protocol)."""
        warnings.warn("DChiLaplace.randomise is deprecated; use DChiLaplace.sample", DeprecationWarning, stacklevel=2)
        return self.sample(x, generator=generator)

    def privacy_bound(self, x: torch.Tensor, x_prime: torch.Tensor) -> float:
        """sum_i eta_i ||x_i - x'_i||_2 over the rows of two inputs of the same shape."""
        if x.shape != x_prime.shape:
            raise ValueError(f"x and x_prime must have the same shape, got {tuple(x.shape)} and "
                             f"{tuple(x_prime.shape)}")
        distances = (x.to(torch.float64) - x_prime.to(torch.float64)).norm(dim=-1)
        return float((self._eta_per_row(distances.shape) * distances).sum())

    def spend(self, x: torch.Tensor) -> Spend:
        """One release of x: eta per row (eta-token units)."""
        return Spend(self.unit, float(self._eta_per_row(x.shape[:-1]).sum()))

    def expected_noise_norm(self, dim: int) -> float:
        """E||z|| = d / eta for the correct sampler and one eta."""
        if isinstance(self.eta, torch.Tensor):
            raise ValueError("expected_noise_norm needs a single eta, not one per row")
        return dim / self.eta

    def _eta_per_row(self, rows: torch.Size | tuple[int, ...]) -> torch.Tensor:
        eta = self.eta if isinstance(self.eta, torch.Tensor) else torch.tensor(self.eta, dtype=torch.float64)
        return torch.broadcast_to(eta.detach().to("cpu", torch.float64), tuple(rows))
