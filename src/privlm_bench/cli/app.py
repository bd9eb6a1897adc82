"""The ``privlm bench`` group and ``privlm bench report``; the commands of each system register on this group in
their own modules."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from privlm.cli.root import console

if TYPE_CHECKING:
    from privlm_bench.harness.registry import SweepEntry

bench_app = typer.Typer(help="Benchmarks: named sweeps that write results.json, results.md and plots.",
                        no_args_is_help=True)


def registered_sweep(name: str) -> SweepEntry:
    """The sweep ``name``, once every system's sweeps have registered: imported here, when a command needs one, so
    that ``privlm`` does not load the sweeps (torch, peft, matplotlib) to start a server."""
    from privlm_bench.attacks import registration as _attacks  # noqa: F401 - the sweeps register by name
    from privlm_bench.baselines import registration as _baselines  # noqa: F401
    from privlm_bench.cape import registration as _cape  # noqa: F401
    from privlm_bench.chat import registration as _chat  # noqa: F401
    from privlm_bench.detect import registration as _detect  # noqa: F401
    from privlm_bench.harness.registry import sweep_entry
    from privlm_bench.sap import registration as _sap  # noqa: F401
    from privlm_bench.snd import registration as _snd  # noqa: F401

    return sweep_entry(name)


@bench_app.command("report")
def bench_report(directory: Annotated[Path, typer.Argument(help="A folder holding results.json.")]) -> None:
    """Re-render results.md, the plots and the sweep's own reports (e.g. claims.md) from its results.json."""
    from privlm_bench.harness.bench import render_report

    if not (directory / "results.json").exists():
        raise typer.BadParameter(f"{directory} has no results.json")
    entry = registered_sweep(json.loads((directory / "results.json").read_text())["metadata"]["sweep"])
    files = entry.render(directory) if entry.render is not None else \
        [*render_report(directory, known=entry.methods), *entry.extra_reports(directory)]
    console.print(f"Wrote {', '.join(str(f) for f in files)}")
