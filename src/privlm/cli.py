"""The ``privlm`` command line."""

from __future__ import annotations

import logging
import sys
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(help="privlm: use language models without handing your text to the provider.",
                  no_args_is_help=True, pretty_exceptions_show_locals=False)
# Wide tables stay readable when the output is piped (make, CI logs).
console = Console(width=None if sys.stdout.isatty() else 120)


@app.callback()
def main(verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Log progress details.")] = False) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(message)s")


@app.command()
def demo(seed: Annotated[int | None, typer.Option(help="Seed for a reproducible run (default: OS entropy).")] = None
         ) -> None:
    """Privatize a sentence, attack it, and perturb a prompt on the packaged MiniLM."""
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


if __name__ == "__main__":
    app()
