"""``privlm cape perturb`` and ``privlm cape calibrate``: private prompts."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from privlm.cli.root import app, console

# What a chat epsilon is, for every command that takes one (its unit is the mechanism's: they print it).
EPSILON_HELP = "Epsilon per perturbed token, on the mechanism's own scale."
# The registry's names (a test keeps them equal), written out so that --help needs no model code loaded.
MECHANISM_NAMES = ("cape, cape-distance, cape-unbucketed, cape-public, cape-public-fast, santext, santext+, custext, "
                   "custext+, inferdpt, text2text, dp-prompt")

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
    int8: Annotated[bool, typer.Option("--int8", help="For the device model's int8 copy (CPU only), as "
                                                      "`privlm gateway --device-model-int8` runs it.")] = False,
) -> None:
    """Set Cape's logit bound B from sample prompts, tied to the device model's weights."""
    from privlm.cape import Cape
    from privlm.models.language import LanguageModel

    texts = _prompts(prompts)
    try:
        model = LanguageModel.from_pretrained(device_model, device=device)  # int8: the CPU only
        bound = Cape(model.quantize_int8() if int8 else model, epsilon=1.0).calibrate(texts, quantile=quantile)
    except ValueError as error:
        raise typer.BadParameter(str(error)) from None
    bound.save(out)
    console.print(f"B = {bound.value:.4f} from {bound.n_texts} prompts ({bound.n_logits:,} logits); wrote {out}")


@cape_app.command("perturb")
def cape_perturb(
    text: Annotated[str, typer.Argument(help="The prompt to perturb, or - to read it from standard input (then it "
                                             "shows in neither the process list nor the shell history).")],
    epsilon: Annotated[float, typer.Option(help=EPSILON_HELP)] = 6.0,
    mechanism: Annotated[str, typer.Option(help=f"One of: {MECHANISM_NAMES}.")] = "cape",
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
    from privlm.cape import LogitBound
    from privlm.gateway.setup import require_logit_bound
    from privlm.mechanisms import make_generator
    from privlm.models.language import LanguageModel
    from privlm.models.text_mechanisms import MechanismContext, build_mechanism, check_epsilon, text_mechanism

    if text == "-":
        text = sys.stdin.read().rstrip("\n")
    try:
        chosen = text_mechanism(mechanism)  # bad input fails before any model loads
        check_epsilon(epsilon)
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
