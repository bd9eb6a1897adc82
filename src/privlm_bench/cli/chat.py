"""``privlm bench chat``: the chat gateway's added latency, time to first token and throughput; ``privlm bench
survival``: how often Cape releases a sensitive word unchanged, per epsilon."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from privlm.cli.root import console, parse_counts, parse_levels
from privlm_bench.cli.app import bench_app


@bench_app.command("chat")
def bench_chat(
    out: Annotated[Path, typer.Option(help="Output folder.")] = Path("benchmarks/chat"),
    requests_per_client: Annotated[int, typer.Option(help="Requests each client sends in turn, per run.")] = 8,
    llm_requests_per_client: Annotated[int | None, typer.Option(help="Against serve-llm, when fewer (default: "
                                                                     "--requests-per-client).")] = None,
    clients: Annotated[str, typer.Option(help="Comma-separated numbers of concurrent clients.")] = "1,8,32",
    max_tokens: Annotated[int, typer.Option(help="Tokens serve-llm generates per answer (greedy).")] = 16,
    epsilon: Annotated[float, typer.Option(help="The gateway's Cape epsilon per token.")] = 6.0,
    seed: Annotated[int, typer.Option(help="Fixes which prompt each request carries.")] = 0,
    skip_llm: Annotated[bool, typer.Option("--skip-llm", help="Measure the stub upstream only, not "
                                                              "`privlm serve-llm`.")] = False,
    int8: Annotated[bool, typer.Option("--int8/--no-int8", help="Also a gateway with --device-model-int8.")] = True,
    floor_batches: Annotated[int, typer.Option(help="Timed batches of the floor (the device model's own batched "
                                                    "throughput), after one warm-up.")] = 4,
) -> None:
    """Latency p50/p99, time to first token and requests/s at 1, 8 and 32 clients, directly and through
    `privlm gateway` (Cape; fp32 and int8 device models), in front of a stub upstream that answers at once and of
    `privlm serve-llm`; and the floor, the device model's own throughput on batches of 8 prompts."""
    from privlm_bench.chat.load import ChatBenchSetting, run_chat_bench

    counts = parse_counts(clients, minimum=1, flag="--clients")
    try:
        setting = ChatBenchSetting(requests_per_client=requests_per_client, clients=counts,
                                   max_tokens=max_tokens, epsilon=epsilon, seed=seed, skip_llm=skip_llm,
                                   int8=int8, floor_batches=floor_batches,
                                   llm_requests_per_client=llm_requests_per_client)
    except ValueError as error:
        raise typer.BadParameter(str(error)) from None
    files = run_chat_bench(setting, out, console)
    console.print(f"Wrote {', '.join(str(f) for f in files)}")


@bench_app.command("survival")
def bench_survival(
    out: Annotated[Path, typer.Option(help="Output folder.")] = Path("benchmarks/survival"),
    epsilons: Annotated[str, typer.Option(help="Comma-separated epsilons per token.")] = "1,2,4,6,8,12",
    device_model: Annotated[str, typer.Option(help="Cape's device model (smollm2, or a local folder).")
                            ] = "smollm2",
) -> None:
    """The exact probability that Cape releases each sensitive word of fixed prompts unchanged ("Seattle",
    "diabetes", names), per epsilon, from the mechanism's own output law (no sampling)."""
    from privlm_bench.chat.survival import SurvivalSetting, run_survival_bench

    try:
        setting = SurvivalSetting(epsilons=tuple(parse_levels(epsilons)), device_model=device_model)
    except ValueError as error:
        raise typer.BadParameter(str(error)) from None
    files = run_survival_bench(setting, out, console)
    console.print(f"Wrote {', '.join(str(f) for f in files)}")


@bench_app.command("chat-quality")
def bench_chat_quality(
    out: Annotated[Path, typer.Option(help="Output folder.")] = Path("benchmarks/chat-quality"),
    points: Annotated[str | None, typer.Option(help="Mechanisms and their epsilons, e.g. 'cape-public:4,8;cape:6' "
                                                    "(default: every registered mechanism at levels spanning the "
                                                    "attack range).")] = None,
    n_test: Annotated[int, typer.Option(help="Test prompts answered per point.")] = 24,
    n_select: Annotated[int, typer.Option(help="Training prompts that choose cape-public's tau and top-p.")] = 12,
    n_tweets: Annotated[int, typer.Option(help="Test tweets for the classifier AUC.")] = 100,
    max_tokens: Annotated[int, typer.Option(help="Tokens per answer (greedy), and per extraction.")] = 24,
    seed: Annotated[int, typer.Option(help="Fixes the prompt samples and the in-process draws (the attacks' releases, "
                                                "the tweets, the selection); the gateways draw from OS entropy.")] = 0,
    resume: Annotated[bool, typer.Option("--resume", help="Keep the points a stopped run with the same settings "
                                                          "finished (OUT/partial.jsonl).")] = False,
    select_only: Annotated[bool, typer.Option("--select-only", help="Only choose cape-public's tau and top-p on the "
                                                                    "training prompts (OUT/selection.json).")] = False,
) -> None:
    """Answer quality against personal-detail leakage for every registered mechanism, through the real gateway to
    `privlm serve-llm`: answer similarity (as answered, restored, extracted), perplexity, tweets AUC, spans verbatim, LM
    reconstruction and KNN, a placeholder control, and verdicts."""
    from privlm_bench.chat.quality import DEFAULT_POINTS, QualitySetting, parse_points, run_quality_bench

    try:
        setting = QualitySetting(points=DEFAULT_POINTS if points is None else parse_points(points), n_test=n_test,
                                 n_select=n_select, n_tweets=n_tweets, max_tokens=max_tokens, seed=seed)
    except ValueError as error:
        raise typer.BadParameter(str(error)) from None
    files = run_quality_bench(setting, out, console, resume=resume, select_only=select_only)
    console.print(f"Wrote {', '.join(str(f) for f in files)}")
