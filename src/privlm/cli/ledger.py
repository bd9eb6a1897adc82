"""``privlm ledger``: what a privacy ledger holds, and moving one from SQLite to PostgreSQL."""

from __future__ import annotations

from typing import Annotated

import typer

from privlm.cli.root import app, console

ledger_app = typer.Typer(help="Privacy ledgers: the per-key budgets the gateway charges.", no_args_is_help=True)
app.add_typer(ledger_app, name="ledger")


@ledger_app.command()
def migrate(
    source: Annotated[str, typer.Argument(help="The ledger to copy: a SQLite file, or a postgresql:// URL.")],
    destination: Annotated[str, typer.Argument(help="An empty (or new) ledger: a postgresql:// URL (say "
                                                    "postgresql://privlm@db.internal/privlm), or a SQLite file.")],
) -> None:
    """Copy every total and spend of SOURCE into DESTINATION, in one transaction, and check the totals agree.

    The copy names keys under the source's secret: start the gateway on it with that secret file
    (--ledger-secret, a SQLite ledger's is <file>.secret)."""
    from privlm.accounting import DatabaseUnavailableError, SecretFileError, copy_ledger
    from privlm.accounting.database import is_database_url, redacted

    try:
        copied = copy_ledger(source, destination)
    except (ValueError, SecretFileError, DatabaseUnavailableError) as error:
        typer.echo(f"Error: {error}", err=True)
        raise typer.Exit(1) from None
    shown = redacted(destination) if is_database_url(destination) else destination
    console.print(f"Copied {copied.totals} totals of {copied.principals} principals and {copied.spends} spends "
                  f"to {shown}; every total agrees.")
    if not is_database_url(source):
        console.print(f"Start the gateway on the copy with its secret, {source}.secret: --chat-ledger-secret for a "
                      "chat ledger, --ledger-secret for an embeddings one (its keys' ids are HMACs under that secret).")
