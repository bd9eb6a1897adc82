"""``privlm bench sap``: SAP fine-tuning on tweet sentiment with MiniLM, privacy against utility."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from privlm.cli.root import console, parse_levels, parse_list
from privlm_bench.cli.app import bench_app


def _levels(text: str | None, flag: str) -> tuple[float, ...] | None:
    if text is None:
        return None
    try:
        return tuple(parse_levels(text))
    except typer.BadParameter as error:
        raise typer.BadParameter(str(error.message), param_hint=flag) from None


@bench_app.command("sap")
def bench_sap(
    out: Annotated[Path | None, typer.Option(help="Output folder (results.json, results.md, privacy_utility.png); "
                                                  "default benchmarks/sap, or benchmarks/sap-service with "
                                                  "--service.")] = None,
    service: Annotated[bool, typer.Option("--service", help="Measure the HTTP service instead: step latency, bytes "
                                                            "and overhead per step against the in-process run, "
                                                            "and throughput with 1, 4 and 8 sessions.")] = False,
    quick: Annotated[bool, typer.Option("--quick", help="Tiny sizes, 1 epoch, centralised + 2 runs: a smoke "
                                                        "test. Other flags still override it.")] = False,
    train: Annotated[int | None, typer.Option("--train", min=1, help="Training examples (default 2000).")] = None,
    validation: Annotated[int | None, typer.Option("--validation", min=1, help="Validation examples (default "
                                                                               "500).")] = None,
    test: Annotated[int | None, typer.Option("--test", min=1, help="Test examples (default 1000).")] = None,
    epochs: Annotated[int | None, typer.Option(min=1, help="Epochs (default 3).")] = None,
    batch_size: Annotated[int | None, typer.Option(min=1, help="Batch size (default 32).")] = None,
    max_length: Annotated[int | None, typer.Option(min=2, help="Tokens per text (default 64).")] = None,
    runs: Annotated[str | None, typer.Option(help="Comma-separated run names to do (default: all), e.g. "
                                                  "centralised,k0-none,k0-eta60.")] = None,
    k0_etas: Annotated[str | None, typer.Option(help="Etas of the embedding bottom (default 40,50,60,75,100).")]
        = None,
    cti_etas: Annotated[str | None, typer.Option(help="Etas of the embedding bottom with CTI (default 50,60,75).")]
        = None,
    deep_etas: Annotated[str | None, typer.Option(help="Etas of the 2- and 4-block bottoms (default 5,10).")]
        = None,
    trainable_etas: Annotated[str | None, typer.Option(help="Etas of the trainable bottom (default 60,75).")]
        = None,
    nn_examples: Annotated[int | None, typer.Option(min=1, help="Training examples the nearest-neighbour "
                                                                "attack inverts (default 200).")] = None,
    opt_examples: Annotated[int | None, typer.Option(min=1, help="Examples the optimisation attack inverts "
                                                                 "(default 16).")] = None,
    opt_steps: Annotated[int | None, typer.Option(min=1, help="Steps of the optimisation attack (default "
                                                              "100).")] = None,
    seed: Annotated[int | None, typer.Option(min=0, help="Seed of the split, training and noise (default 0).")]
        = None,
    device: Annotated[str | None, typer.Option(help="auto (default: CUDA when present), cpu, cuda or cuda:N.")] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Keep the runs a crashed sweep in --out finished.")]
        = False,
) -> None:
    """Centralised LoRA, SAP with the embedding bottom over etas (with and without CTI), 2- and 4-block bottoms,
    a trainable bottom and both head placements; inversion, attribute and label inference on what the vendor
    received; a privacy-utility plot and a verdict on each of the paper's claims."""
    if service:
        ignored = [flag for flag, value in (("--train", train), ("--validation", validation), ("--test", test),
                                            ("--epochs", epochs), ("--batch-size", batch_size), ("--runs", runs),
                                            ("--resume", resume or None)) if value is not None]
        if ignored:
            raise typer.BadParameter(f"--service measures the HTTP service with its own sizes; {', '.join(ignored)} "
                                     "apply to the privacy sweep", param_hint="--service")
        _bench_service(out or Path("benchmarks/sap-service"), quick=quick, seed=seed)
        return
    from privlm_bench.sap.sweep import SapBenchSetting, replace_setting, run_sap_bench

    out = out or Path("benchmarks/sap")
    try:
        base = SapBenchSetting.quick() if quick else SapBenchSetting()
        setting = replace_setting(
            base, n_train=train, n_validation=validation, n_test=test, epochs=epochs, batch_size=batch_size,
            max_length=max_length, runs=None if runs is None else parse_list(runs),
            k0_etas=_levels(k0_etas, "--k0-etas"), cti_etas=_levels(cti_etas, "--cti-etas"),
            deep_etas=_levels(deep_etas, "--deep-etas"),
            trainable_etas=_levels(trainable_etas, "--trainable-etas"), nn_examples=nn_examples,
            opt_examples=opt_examples, opt_steps=opt_steps, seed=seed, device=device)
    except ValueError as error:
        raise typer.BadParameter(str(error)) from None
    files = run_sap_bench(setting, out, console, resume=resume)
    console.print(f"Wrote {', '.join(str(f) for f in files)}")


def _bench_service(out: Path, *, quick: bool, seed: int | None) -> None:
    from privlm_bench.sap.service import ServiceBenchSetting, run_service_bench

    change: dict[str, Any] = {} if seed is None else {"seed": seed}
    setting = ServiceBenchSetting.quick(**change) if quick else ServiceBenchSetting(**change)
    files = run_service_bench(setting, out, console)
    console.print(f"Wrote {', '.join(str(f) for f in files)}")
