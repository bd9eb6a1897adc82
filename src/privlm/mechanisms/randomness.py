"""Random number generators: seeded from OS entropy unless a seed is asked for.

privlm never touches torch's global RNG. Every mechanism takes a ``generator``; when it is
``None`` a fresh generator is seeded with 64 bits from :func:`secrets.randbits` (the OS CSPRNG).
A seed is for explicit reproducibility only. Note that torch's generators are not themselves
cryptographically secure: the seed is unpredictable, the stream is a standard PRNG.
"""

from __future__ import annotations

import secrets

import torch


def make_generator(seed: int | None = None, *, device: torch.device | str = "cpu") -> torch.Generator:
    """A ``torch.Generator`` on ``device``; seeded from OS entropy when ``seed`` is None."""
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
        raise ValueError(f"seed must be a non-negative integer or None, got {seed!r}")
    generator = torch.Generator(device=torch.device(device))
    generator.manual_seed(secrets.randbits(63) if seed is None else seed)
    return generator


def resolve_generator(generator: torch.Generator | None, device: torch.device) -> torch.Generator:
    """Use the caller's generator, or make an OS-seeded one on ``device``."""
    if generator is None:
        return make_generator(device=device)
    if not isinstance(generator, torch.Generator):
        raise ValueError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    if generator.device.type != torch.device(device).type:
        raise ValueError(
            f"generator is on {generator.device} but the data is on {device}; "
            "make it with privlm.mechanisms.make_generator(device=...)"
        )
    return generator
