"""The root ``privlm`` command, the ``bench`` group, and what every system's commands share."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.table import Table
from typer.core import TyperGroup

if TYPE_CHECKING:
    from typer._click import Context  # typer carries its own click; TyperGroup.invoke takes its Context


def _is_a_failed_request(error: BaseException) -> bool:
    """A server refused the request (4xx), failed (5xx, a malformed answer) or could not be reached."""
    import httpx

    from privlm.service.retry import RequestRefusedError, ServerError

    return isinstance(error, RequestRefusedError | ServerError | httpx.HTTPError)


class _FailedRequestsAsOneLine(TyperGroup):
    """Every command, at any depth: a request a server refused or failed is one line on stderr and exit status 1,
    not a traceback (the server's answer is the user's business; privlm's own failures still show theirs)."""

    def invoke(self, ctx: Context) -> Any:
        try:
            return super().invoke(ctx)
        except Exception as error:
            if not _is_a_failed_request(error):
                raise
            typer.echo(f"Error: {' '.join(str(error).split()) or type(error).__name__}", err=True)
            raise typer.Exit(1) from None


app = typer.Typer(help="privlm: use language models without handing your text to the provider.",
                  no_args_is_help=True, pretty_exceptions_show_locals=False, cls=_FailedRequestsAsOneLine)
bench_app = typer.Typer(help="Benchmarks: named sweeps that write results.json, results.md and plots.",
                        no_args_is_help=True)
app.add_typer(bench_app, name="bench")
# Wide tables stay readable when the output is piped (make, CI logs).
console = Console(width=None if sys.stdout.isatty() else 120)


@app.callback()
def main(verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Log progress details.")] = False) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(message)s")


def parse_levels(text: str) -> list[float]:
    """Comma-separated privacy levels, each finite and > 0."""
    try:
        levels = [float(part) for part in text.split(",") if part.strip()]
    except ValueError as error:
        raise typer.BadParameter(f"expected comma-separated numbers, got {text!r}") from error
    if not levels or any(not (level > 0) or level == float("inf") for level in levels):
        raise typer.BadParameter(f"levels must be finite and > 0, got {text!r}")
    return levels


def parse_list(text: str) -> tuple[str, ...]:
    """Comma-separated names, blanks dropped."""
    return tuple(part.strip() for part in text.split(",") if part.strip())


@app.command()
def demo(seed: Annotated[int | None, typer.Option(help="Seed for a reproducible run (default: OS entropy).")] = None
         ) -> None:
    """Privatize a sentence, attack it, perturb a prompt, and run SnD in-process and as a service."""
    from privlm import demo as demo_module

    demo_module.run(console, seed=seed)


@app.command()
def models() -> None:
    """List the packaged models that load offline."""
    from privlm.models import PACKAGED

    table = Table("name", "source")
    for name, source in PACKAGED.items():
        table.add_row(name, source)
    console.print(table)


@bench_app.command("report")
def bench_report(directory: Annotated[Path, typer.Argument(help="A folder holding results.json.")]) -> None:
    """Re-render results.md, the plots and the sweep's own reports (e.g. claims.md) from its results.json."""
    import json

    from privlm.eval.bench import render_report
    from privlm.eval.registry import sweep_entry

    if not (directory / "results.json").exists():
        raise typer.BadParameter(f"{directory} has no results.json")
    entry = sweep_entry(json.loads((directory / "results.json").read_text())["metadata"]["sweep"])
    files = entry.render(directory) if entry.render is not None else \
        [*render_report(directory, known=entry.methods), *entry.extra_reports(directory)]
    console.print(f"Wrote {', '.join(str(f) for f in files)}")
