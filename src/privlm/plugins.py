"""What other installed packages add to privlm, found by their entry points.

- Group ``privlm.commands``: a function that takes the root ``privlm`` app. The bench kit, ``privlm-bench``, adds
  ``privlm bench`` and ``privlm serve-llm``.
- Group ``privlm.detect_backends``: a function ``(device) -> Layer``, one more layer of the detector, by name
  (privlm registers ``presidio``, ``spacy`` and ``gliner``: :mod:`privlm.detect.backends`)."""

from __future__ import annotations

from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any

GROUP = "privlm.commands"
DETECT_BACKENDS = "privlm.detect_backends"
BENCH_COMMANDS = ("bench", "serve-llm")
BENCH_MISSING = ("needs the bench kit, which is not installed: from a privlm checkout, "
                 "`pip install -e . -e src/privlm_bench` (`make venv` installs both)")


def command_plugins() -> dict[str, Callable[[], Callable[[Any], None]]]:
    """Each installed plugin by name, as its loader: the loaded function takes the root app and adds its commands."""
    return {entry.name: entry.load for entry in entry_points(group=GROUP)}


def bench_installed() -> bool:
    return any(entry.name == "bench" for entry in entry_points(group=GROUP))


def detect_backends() -> dict[str, Callable[[], Callable[[str], Any]]]:
    """Each detection backend by name, as its loader: the loaded function takes a device and returns a layer."""
    return {entry.name: entry.load for entry in entry_points(group=DETECT_BACKENDS)}
