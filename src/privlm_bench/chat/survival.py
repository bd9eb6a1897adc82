"""``privlm bench survival``: how often Cape releases a sensitive word as itself, per epsilon.

Cape draws each perturbed token from a bucketized exponential mechanism over the candidate set C, and the
original token is one of the candidates: it can be drawn. The law of every draw is exact
(:meth:`~privlm.cape.sampling.CapeBucketizedMechanism.log_probabilities`), so the probability that a token is
released unchanged needs no sampling: it is the probability of the token itself under its own row's law. A
word of several tokens crosses unchanged when each of its perturbed tokens does; the draws of one prompt
are independent given its utility rows, so that is the product.

The figures are for fixed prompts (:data:`SURVIVAL_PROMPTS`, invented personal details) on the packaged
SmolLM2 with the logit bound calibrated on public prompts, as ``privlm bench chat`` runs the gateway. They
depend on the context (the device model may predict a word from its neighbours): they are examples, not a
bound. Nothing is random: the seed in the provenance is only there for the common format.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from privlm.cape.model import Cape, PreparedPrompt
from privlm.provenance import provenance
from privlm.validation import check_positive_finite
from privlm_bench.chat.load import CALIBRATION_PROMPTS  # public prompts: B as `privlm bench chat` has it
from privlm_bench.harness.report import markdown_table

EPSILONS: tuple[float, ...] = (1.0, 2.0, 4.0, 6.0, 8.0, 12.0)
# Prompts with (invented) personal details, each with the sensitive words to follow.
SURVIVAL_PROMPTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("I live in Seattle and my doctor says I have diabetes. What should I eat?", ("Seattle", "diabetes")),
    ("I am Maria Gonzalez from Seattle; what should I ask my doctor about asthma?",
     ("Maria", "Gonzalez", "Seattle", "asthma")),
    ("My neighbour Alice Smith was diagnosed with diabetes in Boston.", ("Alice", "Smith", "diabetes", "Boston")),
    ("I'm John Carter, 42, diagnosed with type 2 diabetes last March.", ("John", "Carter", "diabetes")),
    ("Summarise: Dr. Hannah Weiss prescribed fluoxetine to Mark Jensen.",
     ("Hannah", "Weiss", "fluoxetine", "Mark", "Jensen")),
    ("I'm Priya Sharma from Leeds and I earn 38,000 a year.", ("Priya", "Sharma", "Leeds")),
    ("Plan meals for David Kim, who has coeliac disease and lives in Toronto.",
     ("David", "Kim", "coeliac", "Toronto")),
    ("My husband James was admitted to hospital in Seattle with chest pain.", ("James", "Seattle", "chest")),
)
@dataclass(frozen=True, kw_only=True)
class SurvivalSetting:
    epsilons: tuple[float, ...] = EPSILONS
    device_model: str = "smollm2"

    def __post_init__(self) -> None:
        if not self.epsilons:
            raise ValueError("give at least one epsilon")
        for epsilon in self.epsilons:
            check_positive_finite("epsilon", epsilon)


def token_survival(cape: Cape, prepared: PreparedPrompt, epsilon: float) -> torch.Tensor:
    """(len(prepared.positions),) float64: the probability that each perturbed token is released as itself."""
    if not prepared.positions:
        return torch.zeros(0, dtype=torch.float64)
    log_p = cape.mechanism(epsilon).log_probabilities(prepared.utilities)
    ids = torch.tensor([prepared.tokens.ids[i] for i in prepared.positions], device=log_p.device)
    index = cape.vocabulary.candidate_index[ids]  # -1: not a candidate, never drawn
    own = log_p.gather(1, index.clamp_min(0)[:, None])[:, 0].exp()
    return torch.where(index >= 0, own, torch.zeros_like(own)).cpu()


def word_positions(prepared: PreparedPrompt, word: str) -> list[int]:
    """Rows (among the perturbed positions) of the tokens that cover the first occurrence of ``word``."""
    start = prepared.tokens.text.find(word)
    if start < 0:
        raise ValueError(f"{word!r} is not in the prompt")
    end = start + len(word)
    return [row for row, i in enumerate(prepared.positions)
            if prepared.tokens.spans[i][0] < end and prepared.tokens.spans[i][1] > start]


def survival_rows(cape: Cape, epsilons: Sequence[float],
                  prompts: Sequence[tuple[str, Sequence[str]]] = SURVIVAL_PROMPTS) -> list[dict[str, Any]]:
    """One row per (word, epsilon): the probability that the word is released unchanged, and its tokens'."""
    prepared = cape.prepare([text for text, _ in prompts])
    rows = []
    for (text, words), prompt in zip(prompts, prepared, strict=True):
        for epsilon in epsilons:
            tokens = token_survival(cape, prompt, epsilon)
            for word in words:
                where = word_positions(prompt, word)
                rows.append({"prompt": text, "word": word, "epsilon": epsilon, "tokens_perturbed": len(where),
                             "p_unchanged": float(tokens[where].prod()) if where else 1.0,
                             "p_tokens": [float(tokens[row]) for row in where]})
    return rows


def token_rates(cape: Cape, epsilons: Sequence[float],
                prompts: Sequence[tuple[str, Sequence[str]]] = SURVIVAL_PROMPTS) -> dict[float, float]:
    """Per epsilon, the expected share of all perturbed tokens of the prompts released unchanged (what a
    request's ``tokens_unchanged`` / ``tokens_perturbed`` averages to)."""
    prepared = cape.prepare([text for text, _ in prompts])
    rates = {}
    for epsilon in epsilons:
        probabilities = torch.cat([token_survival(cape, prompt, epsilon) for prompt in prepared])
        rates[epsilon] = float(probabilities.mean()) if probabilities.numel() else 0.0
    return rates


def summary(rows: Sequence[Mapping[str, Any]], rates: Mapping[float, float]) -> list[dict[str, object]]:
    """Per epsilon: the share of perturbed tokens kept, the mean word survival, and the words of the issue."""
    table: list[dict[str, object]] = []
    for epsilon, rate in rates.items():
        at = [row for row in rows if row["epsilon"] == epsilon]
        def mean(word: str | None, at: list[Mapping[str, Any]] = at) -> float:
            chosen = [row["p_unchanged"] for row in at if word is None or row["word"] == word]
            return sum(chosen) / len(chosen)
        table.append({"epsilon": f"{epsilon:g}", "perturbed tokens kept": f"{rate:.1%}",
                      "words kept (mean)": f"{mean(None):.1%}", "Seattle": f"{mean('Seattle'):.1%}",
                      "diabetes": f"{mean('diabetes'):.1%}", "Gonzalez": f"{mean('Gonzalez'):.1%}"})
    return table


def run_survival_bench(setting: SurvivalSetting, out_dir: Path, console: Console) -> list[Path]:
    """Cape on the device model, B calibrated on public prompts; writes results.json and results.md."""
    meta = provenance(seed=0)
    started = time.perf_counter()
    cape = Cape(setting.device_model, epsilon=max(setting.epsilons), device="cpu")
    bound = cape.calibrate(CALIBRATION_PROMPTS)
    rows = survival_rows(cape, setting.epsilons)
    rates = token_rates(cape, setting.epsilons)
    table = summary(rows, rates)
    meta["seconds"] = round(time.perf_counter() - started, 1)  # model loading to table, not imports
    payload = {"provenance": meta, "setting": asdict(setting), "logit_bound": bound.value, "cape": repr(cape),
               "summary": table, "rows": rows}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(payload, indent=2) + "\n")
    (out_dir / "results.md").write_text(
        "# How often Cape releases a sensitive word unchanged\n\n"
        f"`{meta['command']}` (commit `{meta['git_commit']}`, {meta['seconds']} s), {cape!r}.\n"
        "Exact probabilities from the mechanism's own law; a word survives when each of its perturbed "
        "tokens does.\n\n" + markdown_table(table) + "\n")
    console.print(markdown_table(table))
    return [out_dir / "results.json", out_dir / "results.md"]
