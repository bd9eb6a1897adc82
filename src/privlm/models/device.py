"""The device setting that flows through privlm: ``auto``, ``cpu``, ``cuda`` or ``cuda:N``."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """``auto`` picks CUDA when available, else the CPU; an unavailable CUDA request is an error."""
    if isinstance(device, torch.device):
        resolved = device
    elif device == "auto":
        resolved = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    elif isinstance(device, str) and (device == "cpu" or device.startswith("cuda")):
        resolved = torch.device(device)
    else:
        raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={str(device)!r} was requested but CUDA is not available on this machine")
    return resolved


@contextmanager
def forked_rng(seed: int, device: str | torch.device = "cpu") -> Iterator[None]:
    """Run code that can only draw from torch's global RNG (a library's weight init, ``nn.Dropout``) from
    ``seed``, and restore the CPU's generator and, on CUDA, every device's afterwards: the caller's global RNG
    is neither used nor moved."""
    resolved = torch.device(device)
    # manual_seed reseeds every CUDA device: fork them all, so that each is restored
    devices = list(range(torch.cuda.device_count())) if resolved.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield
