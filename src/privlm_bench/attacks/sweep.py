"""``privlm bench attacks``: for each system, the strongest attack at every recommended operating point, beside the
weaker one our tables used before.

Sections, each a function that returns rows (:mod:`privlm_bench.attacks.rows`):

- ``embeddings`` (:mod:`~privlm_bench.attacks.embeddings`): SnD's uploaded token rows and Text2Text, over an eta
  grid that covers the shipped denoiser's range [15, 150] (so the eta calibration can be read off it);
- ``sap`` (:mod:`~privlm_bench.attacks.sap`): the vendor's view of a SAP fine-tuning, k = 0 and k = 2, tokens and
  labels;
- ``prompts`` (:mod:`~privlm_bench.attacks.prompts`): the released prompts of Cape, cape-public and the word-level
  baselines (and DP-Prompt's paraphrases): tokens, whole prompts, canaries and the addressed airline.

A finished section is kept in ``out/sections/NAME.json`` (its rows, its seconds and, where it was put together by
hand, a ``note`` saying how), so ``--resume`` redoes only what a crash lost.
``results.json`` holds every row, the verdicts and the calibration (:mod:`~privlm_bench.attacks.report`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from rich.console import Console

from privlm.provenance import provenance
from privlm_bench.attacks.report import calibration, render_attacks_report, verdicts
from privlm_bench.attacks.rows import Row
from privlm_bench.harness.json_values import to_json

SECTIONS = ("embeddings", "sap", "prompts")
FULL_ETAS = (15.0, 20.0, 30.0, 50.0, 75.0, 100.0, 150.0)  # the shipped denoiser's range, log-spaced
QUICK_ETAS = (50.0,)


@dataclass(frozen=True)
class AttacksSetting:
    quick: bool = False
    seed: int = 0
    sections: tuple[str, ...] = SECTIONS
    etas: tuple[float, ...] = FULL_ETAS
    n_test: int = 120  # test tweets per embedding release (about 3,000 tokens)
    max_tokens: int = 48
    beam: int = 8
    shortlist: int = 64
    public_limit: int | None = None

    def __post_init__(self) -> None:
        unknown = sorted(set(self.sections) - set(SECTIONS))
        if unknown or not self.sections:
            raise ValueError(f"sections must be some of {SECTIONS}, got {self.sections}")

    @classmethod
    def quick_setting(cls, **changes: Any) -> AttacksSetting:
        return replace(cls(quick=True, etas=QUICK_ETAS, n_test=40, public_limit=5000, beam=4), **changes)


def _embeddings(setting: AttacksSetting) -> list[Row]:
    from privlm.models import SplitModel
    from privlm_bench.attacks.data import attack_texts
    from privlm_bench.attacks.embeddings import EmbeddingSetting, embedding_rows, fit_prior

    model = SplitModel.from_pretrained("minilm", device="cpu")
    texts = attack_texts(n_test=setting.n_test, seed=setting.seed, public_limit=setting.public_limit)
    prior = fit_prior(model.require_tokenizer(), texts.public, model.embedding_matrix.shape[0])
    return embedding_rows(model, texts, prior, EmbeddingSetting(etas=setting.etas, beam=setting.beam,
                                                               shortlist=setting.shortlist, seed=setting.seed),
                          max_tokens=setting.max_tokens)


def _sap(setting: AttacksSetting) -> list[Row]:
    from privlm_bench.attacks.sap import sap_rows

    return sap_rows(quick=setting.quick, seed=setting.seed)


def _prompts(setting: AttacksSetting) -> list[Row]:
    from privlm_bench.attacks.prompts import prompt_rows

    return prompt_rows(quick=setting.quick, seed=setting.seed)


RUNNERS: dict[str, Callable[[AttacksSetting], list[Row]]] = {"embeddings": _embeddings, "sap": _sap,
                                                            "prompts": _prompts}


def _comparable(setting: AttacksSetting) -> dict[str, Any]:
    """What a kept section must share with this run to be resumed: the setting, whichever sections run."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(setting).items() if k != "sections"}


def run_attacks_bench(setting: AttacksSetting, out_dir: Path, *, console: Console | None = None,
                      resume: bool = False, command: Sequence[str] | None = None) -> list[Path]:
    console = console or Console()
    sections_dir = out_dir / "sections"
    sections_dir.mkdir(parents=True, exist_ok=True)
    meta: dict[str, Any] = {"sweep": "attacks", **provenance(seed=setting.seed,
                                                             command=list(command) if command else None),
                            "quick": setting.quick, "setting": asdict(setting), "section_seconds": {}}
    started = time.perf_counter()
    rows: list[Row] = []
    for name in setting.sections:
        saved = sections_dir / f"{name}.json"
        if resume and saved.exists():
            section = json.loads(saved.read_text())
            if section.get("setting") != _comparable(setting):
                raise ValueError(f"{saved} was made with another setting ({section.get('setting')}); run without "
                                 "--resume, or into another --out")
            console.print(f"[dim]{name}: kept from {saved}[/dim]")
        else:
            console.print(f"[bold]{name}[/bold] ...")
            t0 = time.perf_counter()
            section = {"rows": to_json(RUNNERS[name](setting)), "seconds": round(time.perf_counter() - t0, 1),
                       "setting": _comparable(setting)}
            saved.write_text(json.dumps(section, indent=1) + "\n")
            console.print(f"{name}: {len(section['rows'])} rows in {section['seconds']} s")
        meta["section_seconds"][name] = section["seconds"]
        if section.get("note"):  # how a kept section was made, when not by one run of this command
            meta.setdefault("section_notes", {})[name] = section["note"]
        rows += section["rows"]
    meta["wall_seconds"] = round(time.perf_counter() - started, 1)
    payload = {"metadata": meta, "rows": rows, "verdicts": verdicts(rows), "calibration": calibration(rows)}
    (out_dir / "results.json").write_text(json.dumps(to_json(payload), indent=2) + "\n")
    return [out_dir / "results.json", *render_attacks_report(out_dir)]
