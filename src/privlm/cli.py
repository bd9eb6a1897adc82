"""The ``privlm`` command line."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
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


bench_app = typer.Typer(help="Benchmarks: named sweeps that write results.json, results.md and plots.",
                        no_args_is_help=True)
app.add_typer(bench_app, name="bench")


def _parse_levels(text: str) -> list[float]:
    try:
        levels = [float(part) for part in text.split(",") if part.strip()]
    except ValueError as error:
        raise typer.BadParameter(f"expected comma-separated numbers, got {text!r}") from error
    if not levels or any(not (level > 0) or level == float("inf") for level in levels):
        raise typer.BadParameter(f"levels must be finite and > 0, got {text!r}")
    return levels


@bench_app.command("baselines")
def bench_baselines(
    out: Annotated[Path, typer.Option(help="Output folder.")] = Path("benchmarks/baselines"),
    etas: Annotated[str, typer.Option(help="Comma-separated etas.")] = "10,25,50,75,100,200,500",
    task: Annotated[str, typer.Option(help="Task name (see privlm.eval.data.named_task).")] = "tweets-binary",
    model: Annotated[str, typer.Option(help="Model name or path.")] = "minilm",
    n_train: Annotated[int, typer.Option(help="Training sentences for the probe.")] = 2000,
    n_validation: Annotated[int, typer.Option(help="Validation sentences (early stopping).")] = 500,
    n_test: Annotated[int, typer.Option(help="Test sentences.")] = 1000,
    attack_sentences: Annotated[int, typer.Option(help="Test sentences attacked.")] = 300,
    probe: Annotated[str, typer.Option(help="mlp (SnD paper) or logistic.")] = "mlp",
    seed: Annotated[int, typer.Option(help="Seed of splits, noise and probes (recorded).")] = 0,
    device: Annotated[str, typer.Option(help="auto, cpu or cuda.")] = "auto",
) -> None:
    """TokEmbPriv and Text2Text over several etas: inversion success vs probe AUC."""
    from privlm.eval.bench import run_sweep
    from privlm.eval.sweeps.baselines import Setting, baselines_sweep

    setting = Setting(model=model, task=task, n_train=n_train, n_validation=n_validation, n_test=n_test,
                      attack_sentences=attack_sentences, probe=probe, seed=seed, device=device)
    with console.status("Loading the model and data, encoding the clean splits..."):
        sweep = baselines_sweep(setting, etas=_parse_levels(etas))
    report = run_sweep(sweep, out_dir=out, seed=seed, console=console)
    console.print((out / "results.md").read_text())
    console.print(f"Wrote {', '.join(str(f) for f in report.files)}")


if __name__ == "__main__":
    app()
