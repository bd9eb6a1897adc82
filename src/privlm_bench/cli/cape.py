"""``privlm bench cape``: Cape vs its ablations and the token-level baselines."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from privlm.cli.cape import MECHANISM_NAMES
from privlm.cli.root import console, parse_levels, parse_list
from privlm_bench.cli.app import bench_app, registered_sweep


@bench_app.command("cape")
def bench_cape(
    out: Annotated[Path, typer.Option(help="Output folder.")] = Path("benchmarks/cape"),
    epsilons: Annotated[str, typer.Option(help="Comma-separated epsilons (each mechanism's own scale).")
                        ] = "1,2,3,6,10,14,20",
    mechanisms: Annotated[str, typer.Option(help=f"Comma-separated mechanisms of: {MECHANISM_NAMES} but dp-prompt "
                                            "(a paraphrase: privlm bench chat-quality); empty: all of them.")] = "",
    n_train: Annotated[int, typer.Option(help="Training texts of the clean classifier.")] = 2000,
    n_validation: Annotated[int, typer.Option(help="Validation texts (its regularisation).")] = 500,
    n_test: Annotated[int, typer.Option(help="Test texts perturbed at every point.")] = 500,
    zero_shot_texts: Annotated[int, typer.Option(help="Test texts classified zero-shot (0: off).")] = 150,
    mti_sentences: Annotated[int, typer.Option(help="Test sentences attacked by MTI, the slowest part (0: off).")
                             ] = 2,
    nw_tokens: Annotated[int, typer.Option(help="Tokens whose N_w (distinct outputs of 1,000 draws) is counted.")
                         ] = 20,
    int8_epsilons: Annotated[str, typer.Option(help="Epsilons of Cape with the int8 device model; empty: none.")
                             ] = "6,14",
    seed: Annotated[int, typer.Option(help="Seed of the splits and every draw (recorded).")] = 0,
    device: Annotated[str, typer.Option(help="auto, cpu or cuda (int8 needs the CPU).")] = "auto",
    skip_speed: Annotated[bool, typer.Option("--skip-speed", help="Skip the speed measurements (speed.json).")
                          ] = False,
    speed_only: Annotated[bool, typer.Option("--speed-only", help="Only the speed measurements (speed.json); "
                                             "results.json and claims.md stay as they are.")] = False,
    resume: Annotated[bool, typer.Option("--resume", help="Keep the points an interrupted run finished.")] = False,
) -> None:
    """Cape vs its ablations and SANTEXT(+), CUSTEXT(+), InferDPT, Text2Text: utility, attacks, claims, speed.

    Writes results.json, results.md, claims.md, speed.json/.md and the plots. The defaults take about
    35 minutes on a quiet 2-core CPU: about 1 minute of setup, 1 of speed measurements, and 66 points of
    about 30 s each (per point: perturbing 500 texts ~10 s, zero-shot on 150 ~9 s, MTI on 2 sentences
    ~5 s, MiniLM ~5 s). Other processes competing for the cores can make it several times slower.
    """
    from privlm.models.text_mechanisms import text_mechanisms
    from privlm_bench.cape.speed import measure_speed, write_speed
    from privlm_bench.cape.sweep import CapeBench, CapeSetting, cape_sweep
    from privlm_bench.harness.bench import run_sweep

    try:
        names = (tuple(m.name for m in text_mechanisms(parse_list(mechanisms))) if mechanisms
                 else CapeSetting().mechanisms)  # every token-level mechanism
        setting = CapeSetting(mechanisms=names, epsilons=tuple(parse_levels(epsilons)), n_train=n_train,
                              n_validation=n_validation, n_test=n_test, zero_shot_texts=zero_shot_texts,
                              mti_sentences=mti_sentences, nw_tokens=nw_tokens,
                              int8_epsilons=tuple(parse_levels(int8_epsilons)) if int8_epsilons else (), seed=seed,
                              device=device)
    except ValueError as error:
        raise typer.BadParameter(str(error)) from None
    with console.status("Loading the models and data, training the clean classifier, calibrating B..."):
        bench = CapeBench(setting)
    if skip_speed and speed_only:
        raise typer.BadParameter("--skip-speed and --speed-only leave nothing to do")
    if not skip_speed:
        with console.status("Measuring setup and perturbation times side by side..."):
            figures = measure_speed(bench, console=console)
        write_speed(out, figures, seed=seed)
        console.print((out / "speed.md").read_text())
    if speed_only:
        return
    sweep = cape_sweep(setting, bench=bench)
    report = run_sweep(sweep, out_dir=out, seed=seed, console=console, resume=resume)
    extra = registered_sweep("cape").extra_reports(out)
    console.print((out / "claims.md").read_text())
    console.print(f"Wrote {', '.join(str(f) for f in [*report.files, *extra])}")
