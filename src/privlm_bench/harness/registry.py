"""The benchmark registry: every system's sweeps register themselves, by name, in that system's
``registration`` module (as the product's mechanisms do). ``privlm bench report`` and the CLI find sweeps here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from privlm_bench.harness.bench import Method

_SWEEPS: dict[str, SweepEntry] = {}


@dataclass(frozen=True)
class SweepEntry:
    """A named sweep: its known methods (to read older results) and any reports beyond results.md; a sweep whose
    results are not points on a privacy level renders all of its reports itself (``render``)."""

    name: str
    methods: Sequence[Method]
    extra_reports: Callable[[Path], list[Path]] = field(default=lambda _: [])
    render: Callable[[Path], list[Path]] | None = None  # a sweep with its own report: instead of the generic one


def register(entry: SweepEntry) -> SweepEntry:
    if entry.name in _SWEEPS and _SWEEPS[entry.name] != entry:
        raise ValueError(f"sweep {entry.name!r} is registered twice")
    _SWEEPS[entry.name] = entry
    return entry


def sweep_entry(name: str) -> SweepEntry:
    """The registered sweep ``name`` (each system's ``registration`` module registers its sweeps when imported:
    the bench's commands import them all)."""
    if name not in _SWEEPS:
        raise ValueError(f"no sweep named {name!r}; known: {sorted(_SWEEPS)}")
    return _SWEEPS[name]
