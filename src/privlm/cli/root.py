"""The root ``privlm`` command, its plugins' commands (the bench kit's), and what every system's commands share."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
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


def parse_counts(text: str, *, minimum: int, flag: str) -> tuple[int, ...]:
    """Comma-separated integers, each >= ``minimum``; anything else is a usage error naming ``flag``."""
    try:
        counts = tuple(int(part) for part in parse_list(text))
    except ValueError:
        counts = ()
    if not counts or any(count < minimum for count in counts):
        raise typer.BadParameter(f"expected comma-separated integers >= {minimum}, got {text!r}", param_hint=flag)
    return counts


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


def add_plugin_commands() -> None:
    """The commands of installed plugins (:mod:`privlm.plugins`); without the bench kit, ``privlm bench`` and
    ``privlm serve-llm`` say how to install it."""
    from privlm.plugins import BENCH_COMMANDS, BENCH_MISSING, bench_installed, command_plugins

    bench_problem = None if bench_installed() else BENCH_MISSING
    for plugin, load in command_plugins().items():
        try:
            load()(app)
        except Exception as error:  # a broken plugin must not take privlm's own commands down with it
            typer.echo(f"Warning: the plugin {plugin!r} failed to load: {type(error).__name__}: {error}", err=True)
            if plugin == "bench":
                bench_problem = f"cannot run: the bench kit failed to load ({type(error).__name__}: {error})"
    if bench_problem is not None:
        for name in BENCH_COMMANDS:
            app.command(name, context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
                        help=f"(Not available) `privlm {name}` {bench_problem}.")(_not_installed(name, bench_problem))


def _not_installed(name: str, hint: str) -> Callable[[], None]:
    def command() -> None:
        typer.echo(f"Error: `privlm {name}` {hint}.", err=True)
        raise typer.Exit(1)

    return command
