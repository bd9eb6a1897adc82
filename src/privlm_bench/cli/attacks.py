"""``privlm bench attacks``: the strongest attacks on all three systems, beside the ones our tables used."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from privlm.cli.root import console, parse_levels, parse_list
from privlm_bench.cli.app import bench_app


@bench_app.command("attacks")
def bench_attacks(
    out: Annotated[Path, typer.Option(help="Output folder: results.json, results.md, tokens_vs_level.png and "
                                           "sections/.")] = Path("benchmarks/attacks"),
    quick: Annotated[bool, typer.Option("--quick", help="One eta, few texts, short SAP training: a smoke run "
                                                        "in under 5 minutes.")] = False,
    sections: Annotated[str | None, typer.Option(help="Comma-separated sections (default all): embeddings, sap, "
                                                      "prompts.")] = None,
    etas: Annotated[str | None, typer.Option(help="Etas of the embedding section (default 15,20,30,50,75,100,150; "
                                                  "quick: 50).")] = None,
    n_test: Annotated[int | None, typer.Option("--n-test", min=1, help="Test tweets per embedding release "
                                                                       "(default 120; quick 40).")] = None,
    seed: Annotated[int, typer.Option(min=0, help="Seed of the split, the canaries and the noise.")] = 0,
    resume: Annotated[bool, typer.Option("--resume", help="Keep the sections a crashed run in --out finished.")]
        = False,
) -> None:
    """SnD's token rows, Text2Text, SAP's vendor view and the released prompts of Cape and the word-level
    baselines, each attacked by the strongest attack we have and by the one our tables used; canary exposure and
    the addressed-airline attribute; verdicts and SnD's eta calibration per attack."""
    from privlm_bench.attacks.sweep import SECTIONS, AttacksSetting, run_attacks_bench

    changes: dict[str, Any] = {"seed": seed}
    if sections is not None:
        chosen = tuple(parse_list(sections))
        unknown = sorted(set(chosen) - set(SECTIONS))
        if unknown or not chosen:
            raise typer.BadParameter(f"unknown sections {unknown}; known: {', '.join(SECTIONS)}",
                                     param_hint="--sections")
        changes["sections"] = chosen
    if etas is not None:
        try:
            changes["etas"] = tuple(parse_levels(etas))
        except typer.BadParameter as error:
            raise typer.BadParameter(str(error.message), param_hint="--etas") from None
    if n_test is not None:
        changes["n_test"] = n_test
    setting = AttacksSetting.quick_setting(**changes) if quick else AttacksSetting(**changes)
    files = run_attacks_bench(setting, out, console=console, resume=resume, command=["privlm", *sys.argv[1:]])
    console.print(f"Wrote {', '.join(str(f) for f in files)}")
