"""The key/value cache of a transformers model's forward pass, under whichever name its version gives it.

transformers 5 renamed the argument (and the output field) ``past_key_values`` to ``cache`` and deprecated the old
name; every incremental decode in privlm passes and reads the cache through these two functions.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch


def cache_argument(model: torch.nn.Module) -> str:
    """The forward argument, and output field, of ``model``'s key/value cache."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def with_cache(model: torch.nn.Module, cache: Any) -> dict[str, Any]:
    """``model``'s forward keyword for ``cache`` (None: start a new one)."""
    return {cache_argument(model): cache}


def cache_of(model: torch.nn.Module, output: Any) -> Any:
    """The key/value cache in ``output``, a forward pass of ``model`` run with ``use_cache=True``."""
    return getattr(output, cache_argument(model))
