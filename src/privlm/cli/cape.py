"""``privlm cape perturb`` and ``privlm cape calibrate`` (private prompts), and ``privlm bench cape``."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from privlm.cli.app import app, bench_app, console, parse_levels, parse_list

if TYPE_CHECKING:
    from privlm.models.text_mechanisms import TextMechanism


@bench_app.command("cape")
def bench_cape(
    out: Annotated[Path, typer.Option(help="Output folder.")] = Path("benchmarks/cape"),
    epsilons: Annotated[str, typer.Option(help="Comma-separated epsilons (each mechanism's own scale).")
                        ] = "1,2,3,6,10,14,20",
    mechanisms: Annotated[str, typer.Option(help="Comma-separated mechanisms: cape, cape-distance, cape-unbucketed, "
                                                 "santext, santext+, custext, custext+, inferdpt, text2text; "
                                                 "empty: all.")] = "",
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
    resume: Annotated[bool, typer.Option("--resume", help="Keep the points an interrupted run finished.")] = False,
) -> None:
    """Cape vs its ablations and SANTEXT(+), CUSTEXT(+), InferDPT, Text2Text: utility, attacks, claims, speed.

    Writes results.json, results.md, claims.md, speed.json/.md and the plots. The defaults take about
    35 minutes on a quiet 2-core CPU: about 1 minute of setup, 1 of speed measurements, and 66 points of
    about 30 s each (per point: perturbing 500 texts ~10 s, zero-shot on 150 ~9 s, MTI on 2 sentences
    ~5 s, MiniLM ~5 s). Other processes competing for the cores can make it several times slower.
    """
    from privlm.eval.bench import run_sweep
    from privlm.eval.registry import sweep_entry
    from privlm.eval.sweeps.cape import CapeBench, CapeSetting, cape_sweep
    from privlm.eval.sweeps.cape_speed import measure_speed, write_speed
    from privlm.models.text_mechanisms import text_mechanisms

    try:
        names = tuple(m.name for m in text_mechanisms(parse_list(mechanisms) if mechanisms else None))
        setting = CapeSetting(mechanisms=names, epsilons=tuple(parse_levels(epsilons)), n_train=n_train,
                              n_validation=n_validation, n_test=n_test, zero_shot_texts=zero_shot_texts,
                              mti_sentences=mti_sentences, nw_tokens=nw_tokens,
                              int8_epsilons=tuple(parse_levels(int8_epsilons)) if int8_epsilons else (), seed=seed,
                              device=device)
    except ValueError as error:
        raise typer.BadParameter(str(error)) from None
    with console.status("Loading the models and data, training the clean classifier, calibrating B..."):
        bench = CapeBench(setting)
    if not skip_speed:
        with console.status("Measuring setup and perturbation times side by side..."):
            figures = measure_speed(bench, console=console)
        write_speed(out, figures, seed=seed)
        console.print((out / "speed.md").read_text())
    sweep = cape_sweep(setting, bench=bench)
    report = run_sweep(sweep, out_dir=out, seed=seed, console=console, resume=resume)
    extra = sweep_entry("cape").extra_reports(out)
    console.print((out / "claims.md").read_text())
    console.print(f"Wrote {', '.join(str(f) for f in [*report.files, *extra])}")


def require_logit_bound(mechanism: TextMechanism, logit_bound: Path | None) -> None:
    """Refuse, before any model loads, a mechanism that reads Cape's B when no --logit-bound is given."""
    if mechanism.needs_logit_bound and logit_bound is None:
        raise ValueError("Cape needs its logit bound B: run `privlm cape calibrate PROMPTS_FILE` on public sample "
                         "prompts and pass --logit-bound logit_bound.json")


cape_app = typer.Typer(help="Cape: perturb a prompt on this machine before it goes to a chat API.",
                       no_args_is_help=True)
app.add_typer(cape_app, name="cape")


def _prompts(path: Path) -> list[str]:
    """One prompt per non-blank line of a UTF-8 file."""
    try:
        lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError) as error:
        raise typer.BadParameter(f"cannot read prompts from {path}: {error}") from None
    if not lines:
        raise typer.BadParameter(f"{path} holds no prompt (one per line)")
    return lines


@cape_app.command("calibrate")
def cape_calibrate(
    prompts: Annotated[Path, typer.Argument(help="Public sample prompts, one per line (never the ones to protect).")],
    out: Annotated[Path, typer.Option(help="Where to write the logit bound (JSON).")] = Path("logit_bound.json"),
    device_model: Annotated[str, typer.Option(help="smollm2, or a local causal or masked LM folder.")] = "smollm2",
    quantile: Annotated[float, typer.Option(help="B = this quantile of |logit| over the samples.")] = 1.0,
    device: Annotated[str, typer.Option(help="auto, cpu or cuda.")] = "auto",
) -> None:
    """Set Cape's logit bound B from sample prompts, tied to the device model's weights."""
    from privlm.cape import Cape

    texts = _prompts(prompts)
    try:
        bound = Cape(device_model, epsilon=1.0, device=device).calibrate(texts, quantile=quantile)
    except ValueError as error:
        raise typer.BadParameter(str(error)) from None
    bound.save(out)
    console.print(f"B = {bound.value:.4f} from {bound.n_texts} prompts ({bound.n_logits:,} logits); wrote {out}")


@cape_app.command("perturb")
def cape_perturb(
    text: Annotated[str, typer.Argument(help="The prompt to perturb, or - to read it from standard input (then it "
                                             "shows in neither the process list nor the shell history).")],
    epsilon: Annotated[float, typer.Option(help="Epsilon per perturbed token (the mechanism's own scale).")] = 6.0,
    mechanism: Annotated[str, typer.Option(help="cape, cape-distance, cape-unbucketed, santext, santext+, custext, "
                                                "custext+, inferdpt or text2text.")] = "cape",
    logit_bound: Annotated[Path | None, typer.Option(help="Cape's B, from `privlm cape calibrate`.")] = None,
    device_model: Annotated[str, typer.Option(help="smollm2, or a local causal or masked LM folder.")] = "smollm2",
    seed: Annotated[int | None, typer.Option(help="Seed for a reproducible draw (default: OS entropy).")] = None,
    report: Annotated[bool, typer.Option("--report/--no-report", help="Print the per-token report.")] = True,
    device: Annotated[str, typer.Option(help="auto, cpu or cuda.")] = "auto",
) -> None:
    """Print the perturbed prompt (what to send) and, by default, what happened to every token."""
    from rich.table import Table

    import privlm.baselines
    import privlm.cape  # noqa: F401 (Cape's variants register by name)
    from privlm._validation import check_positive_finite
    from privlm.cape import LogitBound
    from privlm.mechanisms import make_generator
    from privlm.models.language import LanguageModel
    from privlm.models.text_mechanisms import MechanismContext, build_mechanism, text_mechanism

    if text == "-":
        text = sys.stdin.read().rstrip("\n")
    try:
        chosen = text_mechanism(mechanism)  # bad input fails before any model loads
        check_positive_finite("epsilon", epsilon)
        require_logit_bound(chosen, logit_bound)
        bound = LogitBound.load(logit_bound) if logit_bound is not None else None
        model = LanguageModel.from_pretrained(device_model, device=device)
        context = MechanismContext(device_model=model, logit_bound=bound)
        perturber = build_mechanism(chosen.name, context, epsilon=epsilon,
                                    generator=make_generator(seed, device=model.device))
        result = perturber.perturb(text)
    except ValueError as error:
        raise typer.BadParameter(str(error)) from None
    if report:
        table = Table("pos", "original", "what happened", "sent", "epsilon", "eps'", "K")
        for token in result.report.tokens:
            table.add_row(str(token.position), repr(token.original), str(token.outcome), repr(token.released),
                          "-" if token.epsilon is None else f"{token.epsilon:g}",
                          "-" if token.eps_prime is None else f"{token.eps_prime:.2f}",
                          "-" if token.non_empty_buckets is None else str(token.non_empty_buckets))
        console.print(table)
        totals = ", ".join(f"{name} {value:.2f}" for name, value in result.report.accounting.items())
        console.print(f"{result.report.mechanism}: |C| = {result.report.candidate_set_size:,}; per prompt: {totals}")
        for note in result.report.notes:
            console.print(f"note: {note}")
    typer.echo(result.text)
