"""``privlm bench baselines``: the embedding baselines on their own."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from privlm.cli.root import console, parse_levels
from privlm_bench.cli.app import bench_app


@bench_app.command("baselines")
def bench_baselines(
    out: Annotated[Path, typer.Option(help="Output folder.")] = Path("benchmarks/baselines"),
    etas: Annotated[str, typer.Option(help="Comma-separated etas.")] = "10,25,50,75,100,200,500",
    task: Annotated[str, typer.Option(help="Task name (see privlm_bench.data.named_task).")] = "tweets-binary",
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
    from privlm.validation import check_choice
    from privlm_bench.baselines.sweep import baselines_sweep
    from privlm_bench.harness.bench import run_sweep
    from privlm_bench.harness.embedding import EmbeddingSetting
    from privlm_bench.harness.probes import PROBE_KINDS

    setting = EmbeddingSetting(model=model, tasks=(task,), n_train=n_train, n_validation=n_validation,
                               n_test=n_test, attack_sentences=attack_sentences,
                               probe=check_choice("probe", probe, PROBE_KINDS), seed=seed, device=device)
    with console.status("Loading the model and data, encoding the clean splits..."):
        sweep = baselines_sweep(setting, etas=parse_levels(etas))
    report = run_sweep(sweep, out_dir=out, seed=seed, console=console)
    console.print((out / "results.md").read_text())
    console.print(f"Wrote {', '.join(str(f) for f in report.files)}")
