"""``privlm bench snd`` (SnD vs baselines and ablations), ``privlm bench serve`` (load) and ``privlm bench
hardening`` (memory and latency under abuse)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from privlm.cli.root import console, parse_levels, parse_list
from privlm_bench.cli.app import bench_app, registered_sweep


@bench_app.command("snd")
def bench_snd(
    out: Annotated[Path, typer.Option(help="Output folder.")] = Path("benchmarks/snd"),
    denoisers: Annotated[str, typer.Option(help="Folder with ablation denoisers: noclip/, server/, local/, "
                                                "groups/<name>/ (each from `privlm snd train`).")] = "",
    etas: Annotated[str, typer.Option(help="Comma-separated etas; empty: calibrate to inversion rates "
                                           "50%, 10%, 1%, 0.1%.")] = "",
    tasks: Annotated[str, typer.Option(help="Comma-separated task names.")] = "tweets-binary,fortunes",
    methods: Annotated[str, typer.Option(help="Comma-separated method keys (snd, tokembpriv, text2text, "
                                              "snd-ablation-budget, snd-no-clip, server-side, local-only, "
                                              "snd-no-residual, snd-query-readout, snd-eta-groups); empty: all "
                                              "available.")] = "",
    model: Annotated[str, typer.Option(help="Model name or path.")] = "minilm",
    n_train: Annotated[int, typer.Option()] = 2000,
    n_validation: Annotated[int, typer.Option()] = 500,
    n_test: Annotated[int, typer.Option()] = 1000,
    attack_sentences: Annotated[int, typer.Option()] = 200,
    probe: Annotated[str, typer.Option(help="mlp (SnD paper) or logistic.")] = "mlp",
    seed: Annotated[int, typer.Option()] = 0,
    device: Annotated[str, typer.Option(help="auto, cpu or cuda.")] = "auto",
    cost: Annotated[bool, typer.Option("--cost", help="Measure client time, bytes and memory instead.")] = False,
    resume: Annotated[bool, typer.Option("--resume", help="Keep the points an interrupted run finished.")] = False,
) -> None:
    """SnD vs baselines and ablations at calibrated etas: utility, attacks, privacy-utility plots."""
    from privlm.validation import check_choice
    from privlm_bench.harness.bench import run_sweep
    from privlm_bench.harness.probes import PROBE_KINDS
    from privlm_bench.snd.sweep import SnDSetting, snd_sweep

    if cost:
        from privlm_bench.snd.cost_report import write_cost_report

        with console.status("Measuring client time, bytes on the wire and peak memory..."):
            files = write_cost_report(out, model=model, seed=seed, device=device)
        console.print((out / "cost.md").read_text())
        console.print(f"Wrote {', '.join(str(f) for f in files)}")
        return

    setting = SnDSetting(model=model, tasks=parse_list(tasks), n_train=n_train, n_validation=n_validation,
                         n_test=n_test, attack_sentences=attack_sentences,
                         probe=check_choice("probe", probe, PROBE_KINDS), seed=seed, device=device,
                         denoisers=denoisers, etas=tuple(parse_levels(etas)) if etas else (),
                         methods=parse_list(methods))
    with console.status("Loading, encoding the clean splits and calibrating eta..."):
        try:
            sweep = snd_sweep(setting)
        except ValueError as error:
            raise typer.BadParameter(str(error)) from None
    console.print(f"Levels: {sweep.levels}; methods: {[m.key for m in sweep.methods]}")
    report = run_sweep(sweep, out_dir=out, seed=seed, console=console, resume=resume)
    extra = registered_sweep("snd").extra_reports(out)
    console.print((out / "results.md").read_text())
    for file in extra:
        console.print(file.read_text())
    console.print(f"Wrote {', '.join(str(f) for f in [*report.files, *extra])}")


@bench_app.command("serve")
def bench_serve(
    out: Annotated[Path, typer.Option(help="Output folder.")] = Path("benchmarks/serve"),
    model: Annotated[str, typer.Option(help="Model name or path.")] = "minilm",
    seed: Annotated[int, typer.Option()] = 0,
    requests: Annotated[int | None, typer.Option(help="Requests per client (embeddings: 8 sentences each); fewer "
                                                     "for a short run (default 24; with --gateway-replicas, 8).")
                        ] = None,
    gateway_replicas: Annotated[str, typer.Option(help="Instead: `privlm gateway --ray` with each of these numbers "
                                                       "of replicas (comma-separated, e.g. 1,2), chat and embeddings "
                                                       "at 8 and 32 clients against the stub upstream, ledgers on "
                                                       "PostgreSQL; and the ledger's added latency on PostgreSQL "
                                                       "against SQLite. Writes to OUT/gateway-replicas.")] = "",
    ledger_calls: Annotated[int, typer.Option(help="With --gateway-replicas: timed ledger spends per backend.")
                            ] = 200,
) -> None:
    """Throughput and p50/p99 latency at 1, 8 and 32 clients, of the server alone and through the gateway
    (openai clients); a server restart mid-run. With --gateway-replicas: the gateway on Ray Serve instead."""
    from privlm_bench.snd.serve_load import REQUESTS_PER_CLIENT, write_serve_report

    if requests is not None and requests < 1:
        raise typer.BadParameter("must be >= 1", param_hint="--requests")
    if gateway_replicas:
        _bench_gateway_replicas(out / "gateway-replicas", gateway_replicas, model=model, seed=seed,
                                requests=requests, ledger_calls=ledger_calls)
        return
    requests = REQUESTS_PER_CLIENT if requests is None else requests
    with console.status("Starting the server and the gateway, loading them with 1, 8 and 32 clients..."):
        files = write_serve_report(out, model=model, seed=seed, requests_per_client=requests)
    console.print((out / "serve.md").read_text())
    console.print(f"Wrote {', '.join(str(f) for f in files)}")


def _bench_gateway_replicas(out: Path, replicas: str, *, model: str, seed: int, requests: int | None,
                            ledger_calls: int) -> None:
    from privlm_bench.chat.gateway_replicas import (
        REPLICA_REQUESTS_PER_CLIENT,
        ReplicaBenchSetting,
        parse_replica_counts,
        run_replica_bench,
    )

    try:
        counts = parse_replica_counts(replicas)
    except ValueError as error:
        raise typer.BadParameter(str(error), param_hint="--gateway-replicas") from None
    try:
        setting = ReplicaBenchSetting(replicas=counts, model=model, seed=seed, ledger_calls=ledger_calls,
                                      requests_per_client=REPLICA_REQUESTS_PER_CLIENT if requests is None else requests)
    except ValueError as error:
        raise typer.BadParameter(str(error)) from None
    files = run_replica_bench(setting, out, lambda message: console.log(message, highlight=False))
    console.print(files[1].read_text(), markup=False, highlight=False)
    console.print(f"Wrote {', '.join(str(f) for f in files)}")


@bench_app.command("hardening")
def bench_hardening(
    out: Annotated[Path, typer.Option(help="Output folder.")] = Path("benchmarks/hardening"),
    source: Annotated[Path | None, typer.Option(help="Run the server and the gateway from this checkout's src "
                                                     "(a git worktree of an older commit, say); default: this "
                                                     "privlm.")] = None,
    label: Annotated[str, typer.Option(help="A label for the results, e.g. before or after.")] = "",
    model: Annotated[str, typer.Option(help="Model name or path.")] = "minilm",
    quick: Annotated[bool, typer.Option("--quick", help="Small sizes: a 32 MiB upload, a 9 MiB body, 16 "
                                                        "inputs; seconds instead of minutes.")] = False,
    upload_mib: Annotated[int | None, typer.Option(help="Chunked upload to the server (default 1024).")] = None,
    cap_s: Annotated[float | None, typer.Option(help="The longest any one case is waited for (default 200).")
                     ] = None,
) -> None:
    """Memory and latency under issue 10's abuses: chunked bodies over the limits (server and gateway), and a
    one-text request's latency while another caller's maximum-size request runs."""
    from privlm_bench.snd.hardening import QUICK, HardeningRun, HardeningSizes, run_hardening, with_overrides

    if source is not None and not (source / "src" / "privlm").is_dir():
        raise typer.BadParameter(f"{source} has no src/privlm", param_hint="--source")
    try:
        sizes = with_overrides(QUICK if quick else HardeningSizes(), upload_mib=upload_mib, cap_s=cap_s)
    except ValueError as error:
        raise typer.BadParameter(str(error)) from None
    files = run_hardening(HardeningRun(out_dir=out, model=model, source=source, label=label, sizes=sizes,
                                       log=console.print))
    console.print((out / "results.md").read_text())
    console.print(f"Wrote {', '.join(str(f) for f in files)}")
