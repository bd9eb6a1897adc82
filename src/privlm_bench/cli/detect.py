"""``privlm bench detect``: the personal-detail detector's recall, precision and latency beside Presidio's."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from privlm.cli.root import console, parse_list
from privlm_bench.cli.app import bench_app


@bench_app.command("detect")
def bench_detect(
    out: Annotated[Path, typer.Option(help="Output folder: results.json, results.md, recall_per_kind.png.")
                   ] = Path("benchmarks/detect"),
    device: Annotated[str, typer.Option(help="The tagger's device (cpu, cuda, auto).")] = "cpu",
    limit: Annotated[int | None, typer.Option(min=1, help="Only the first N prompts of each set (a quick run).")
                     ] = None,
    rows: Annotated[str | None, typer.Option(help="Comma-separated rows (default all): privlm, patterns, "
                                                  "gazetteers, tagger, presidio.")] = None,
    handwritten: Annotated[Path | None, typer.Option(help="The hand-written set (default "
                                                          "benchmarks/detect/handwritten.txt).")] = None,
    threads: Annotated[int | None, typer.Option(min=1, help="Torch threads (default: the cores this process may "
                                                            "use).")] = None,
) -> None:
    """Recall (caught whole, typed), spans left verbatim, precision and prompts leaking, per kind and overall with
    Clopper-Pearson intervals, on the chat-quality prompts' test split and the hand-written set; latency at batch 1
    and 32; privlm's detector, each of its layers alone, and Presidio when installed, in one run; the issue's
    verdicts."""
    from privlm_bench.detect.rows import ROW_BUILDERS
    from privlm_bench.detect.sweep import DetectSetting, run_detect_bench

    changes: dict[str, Any] = {"device": device, "limit": limit}
    if rows is not None:
        chosen = parse_list(rows)
        unknown = sorted(set(chosen) - set(ROW_BUILDERS))
        if unknown or not chosen:
            raise typer.BadParameter(f"unknown rows {unknown}; known: {', '.join(ROW_BUILDERS)}", param_hint="--rows")
        changes["rows"] = tuple(dict.fromkeys(chosen))
    if handwritten is not None:
        changes["handwritten_file"] = str(handwritten)
    if threads is not None:
        changes["threads"] = threads
    files = run_detect_bench(DetectSetting(**changes), out, console, command=["privlm", *sys.argv[1:]])
    console.print(f"Wrote {', '.join(str(f) for f in files)}")


@bench_app.command("detect-dev")
def bench_detect_dev(
    out: Annotated[Path, typer.Option(help="Output folder: development.json and development.md.")
                   ] = Path("benchmarks/detect"),
    device: Annotated[str, typer.Option(help="The tagger's device (cpu, cuda, auto).")] = "cpu",
    handwritten: Annotated[Path | None, typer.Option(help="The hand-written set (default "
                                                          "benchmarks/detect/handwritten.txt).")] = None,
) -> None:
    """The detector's decoding choices (the tagger's growth ratio, a floor under its thresholds) swept on the
    hand-written set's development quarter only: recall, partly covered, precision and character precision."""
    from privlm_bench.detect.data import HANDWRITTEN_FILE
    from privlm_bench.detect.development import development_sweep, write_development

    payload = development_sweep(device, handwritten or HANDWRITTEN_FILE, command=["privlm", *sys.argv[1:]])
    files = write_development(payload, out)
    console.print(f"Wrote {', '.join(str(f) for f in files)}")
