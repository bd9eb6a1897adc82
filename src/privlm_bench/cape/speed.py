"""Speed of ``privlm bench cape``'s mechanisms, measured side by side in one run: ``speed.json`` and ``speed.md``.

- Setup: each mechanism's constructor on the already loaded device model, plus what it builds before its
  first prompt: CUSTEXT's output sets, with a cold cache (``PRIVLM_CACHE`` pointed at a new temporary
  folder), and Cape's logit bound B (calibration on the sweep's training texts). Loading the device model
  itself (tokenizer, weights, embedding table) is shared by every mechanism and reported once.
  Target: under 10 s each; the paper's figures are printed beside.
- Perturbation: prompts of exactly 32 device-model tokens (validation texts cut to 32 tokens, kept when
  the cut text tokenizes back to 32 tokens). Every repeat times, prompt by prompt, one plain forward pass
  of the device model (``model(input_ids)``, the physical floor of Cape) and one ``perturb`` of every
  mechanism, interleaved so that load changes hit all alike; medians after warm-up. Targets: Cape at most 1.3
  times the forward pass; cape-public, which takes one decode step per perturbed token, and cape-public-fast,
  two forward passes whatever the prompt, at most 3 times.
- int8: the device model with int8 dynamic quantization of its linear layers
  (:meth:`~privlm.models.language.LanguageModel.quantize_int8`): forward and Cape speed-ups. Its effect on
  utility is measured by the sweep's ``cape-int8`` rows (claims.md).
- Peak memory: the process's peak resident set (ru_maxrss) when the measurements end.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import Progress
from transformers import PreTrainedTokenizerBase

from privlm.mechanisms import make_generator
from privlm.models.language import LanguageModel
from privlm.models.perturbation import TextPerturber
from privlm.models.text_mechanisms import MechanismContext, text_mechanisms
from privlm.provenance import provenance
from privlm_bench.cape.sweep import CapeBench, peak_rss_mb

PAPER_SETUP_SECONDS = {"santext": 325.0, "custext": 2930.0, "inferdpt": 28.7, "cape": 37.9}
SETUP_TARGET_S = 10.0
RATIO_TARGETS = {"cape": 1.3, "cape-public": 3.0, "cape-public-fast": 3.0}  # perturb / one forward pass
INT8_MECHANISMS = ("cape", "cape-public", "cape-public-fast")  # timed on the int8 device model too
PROMPT_TOKENS = 32


@dataclass(kw_only=True)
class SpeedSetting:
    epsilon: float = 6.0
    prompts: int = 8
    repeats: int = 3
    warmup: int = 1


def exact_length_prompts(tokenizer: PreTrainedTokenizerBase, texts: Sequence[str], n_tokens: int,
                         count: int) -> list[str]:
    """``count`` texts cut to exactly ``n_tokens`` tokens (kept only when the cut text tokenizes back to them)."""
    out: list[str] = []
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) < n_tokens:
            continue
        cut = str(tokenizer.decode(ids[:n_tokens], clean_up_tokenization_spaces=False))
        if cut.strip() and len(tokenizer(cut, add_special_tokens=False)["input_ids"]) == n_tokens:
            out.append(cut)
        if len(out) == count:
            return out
    raise ValueError(f"only {len(out)} of the texts give prompts of exactly {n_tokens} tokens; {count} needed")


@contextmanager
def cold_cache() -> Iterator[Path]:
    """PRIVLM_CACHE pointed at a new, empty temporary folder (restored afterwards)."""
    previous = os.environ.get("PRIVLM_CACHE")
    with tempfile.TemporaryDirectory(prefix="privlm-cold-cache-") as folder:
        os.environ["PRIVLM_CACHE"] = folder
        try:
            yield Path(folder)
        finally:
            if previous is None:
                os.environ.pop("PRIVLM_CACHE", None)
            else:
                os.environ["PRIVLM_CACHE"] = previous


def measure_setup(bench: CapeBench, epsilon: float) -> dict[str, dict[str, Any]]:
    """Constructor (+ cold CUSTEXT cache, + Cape calibration) seconds of every mechanism of ``bench``."""
    bare = MechanismContext(bench.lm, None)
    calibration = bench.texts["train"][: bench.setting.calibration_texts]
    out: dict[str, dict[str, Any]] = {}
    for key, mechanism in bench.mechanisms.items():
        cold = mechanism.name.startswith("custext")
        with cold_cache() if cold else nullcontext():
            started = time.perf_counter()
            perturber: Any = mechanism.build(bare, epsilon=epsilon, generator=make_generator(0))
            constructor = time.perf_counter() - started
        calibrate = 0.0
        if mechanism.needs_logit_bound:
            started = time.perf_counter()
            perturber.calibrate(calibration)
            calibrate = time.perf_counter() - started
        out[key] = {"constructor_s": constructor, "calibration_s": calibrate, "setup_s": constructor + calibrate,
                    "cold_cache": cold, "calibration_texts": len(calibration) if mechanism.needs_logit_bound else 0}
    return out


def _forward_timer(model: LanguageModel, ids: Sequence[torch.Tensor]) -> Callable[[int], object]:
    """One plain forward pass of ``model`` over prompt i."""
    @torch.inference_mode()
    def forward(i: int) -> object:
        return model.model(input_ids=ids[i].to(model.device))
    return forward


def _perturb_timer(perturber: TextPerturber, prompts: Sequence[str]) -> Callable[[int], object]:
    return lambda i: perturber.perturb(prompts[i])


def measure_perturbation(bench: CapeBench, setting: SpeedSetting, int8: MechanismContext | None,
                         console: Console | None = None) -> dict[str, Any]:
    """Medians (seconds) of the forward pass and of every mechanism's ``perturb`` on 32-token prompts."""
    tokenizer = bench.lm.tokenizer
    prompts = exact_length_prompts(tokenizer, bench.texts["validation"], PROMPT_TOKENS, setting.prompts)
    ids = [torch.tensor([tokenizer(p, add_special_tokens=False)["input_ids"]]) for p in prompts]
    timers: dict[str, Callable[[int], object]] = {"forward": _forward_timer(bench.lm, ids)}
    for key, mechanism in bench.mechanisms.items():
        perturber = mechanism.build(bench.context, epsilon=setting.epsilon, generator=bench.generator("speed", key))
        timers[key] = _perturb_timer(perturber, prompts)
    if int8 is not None:
        timers["forward-int8"] = _forward_timer(int8.device_model, ids)
        for name in INT8_MECHANISMS:
            if name in bench.mechanisms or name == "cape":
                perturber = text_mechanisms([name])[0].build(int8, epsilon=setting.epsilon,
                                                             generator=bench.generator("speed", f"{name}-int8"))
                timers[f"{name}-int8"] = _perturb_timer(perturber, prompts)
    samples: dict[str, list[float]] = {name: [] for name in timers}
    rounds = setting.warmup + setting.repeats
    with Progress(console=console or Console(), transient=True) as progress:
        task = progress.add_task("timing 32-token prompts", total=rounds * len(prompts))
        for round_ in range(rounds):
            for i in range(len(prompts)):
                for name, timer in timers.items():
                    started = time.perf_counter()
                    timer(i)
                    seconds = time.perf_counter() - started
                    if round_ >= setting.warmup:
                        samples[name].append(seconds)
                progress.advance(task)
    return {"median_s": {name: statistics.median(values) for name, values in samples.items()},
            "samples": len(prompts) * setting.repeats, "prompts": prompts}


def measure_speed(bench: CapeBench, *, setting: SpeedSetting | None = None,
                  console: Console | None = None) -> dict[str, Any]:
    """Every speed figure of the benchmark (see the module doc), in one run."""
    setting = setting or SpeedSetting()
    started = time.perf_counter()
    LanguageModel.from_pretrained(bench.setting.device_model, device=bench.setting.device)
    load = time.perf_counter() - started
    setup = measure_setup(bench, setting.epsilon)
    int8 = bench.int8_context
    quantize_s = None
    if int8 is None and bench.lm.device.type == "cpu" and any(m.needs_logit_bound for m in bench.mechanisms.values()):
        started = time.perf_counter()
        quantized = bench.lm.quantize_int8()
        quantize_s = time.perf_counter() - started
        from privlm.cape import Cape

        int8 = MechanismContext(quantized, Cape(quantized, epsilon=1.0).calibrate(
            bench.texts["train"][: bench.setting.calibration_texts]))
    perturbation = measure_perturbation(bench, setting, int8, console)
    medians = perturbation["median_s"]
    forward = medians["forward"]
    figures: dict[str, Any] = {
        "device_model_load_s": load, "setup": setup, "torch_threads": torch.get_num_threads(),
        "forward_s": forward, "perturb_s": {k: v for k, v in medians.items() if not k.startswith("forward")},
        "ratio_to_forward": {k: v / forward for k, v in medians.items() if not k.startswith("forward")},
        "prompts": perturbation["prompts"], "samples_per_median": perturbation["samples"],
        "peak_rss_mb": peak_rss_mb(), "settings": asdict(setting),
    }
    if "forward-int8" in medians:
        figures["int8"] = {"forward_s": medians["forward-int8"], "forward_speedup": forward / medians["forward-int8"],
                           "quantize_s": quantize_s}
        if "cape" in medians:
            figures["int8"]["cape_speedup"] = medians["cape"] / medians["cape-int8"]
        # int8 against int8: the same model on both sides of the ratio
        figures["int8"]["ratio_to_int8_forward"] = {name: medians[f"{name}-int8"] / medians["forward-int8"]
                                                    for name in INT8_MECHANISMS if f"{name}-int8" in medians}
    return figures


def write_speed(out_dir: Path, figures: Mapping[str, Any], *, seed: int, command: list[str] | None = None
                ) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "speed.json"
    path.write_text(json.dumps({"metadata": provenance(seed=seed, command=command), "figures": figures},
                               indent=2) + "\n")
    return [path, render_speed(out_dir)]


def render_speed(out_dir: Path) -> Path:
    """speed.md from speed.json alone."""
    payload = json.loads((out_dir / "speed.json").read_text())
    meta, f = payload["metadata"], payload["figures"]
    forward = f["forward_s"]
    lines = ["# Cape benchmark: speed", "", f"- command: `{meta['command']}`", f"- seed: {meta['seed']}",
             f"- git commit: `{meta['git_commit']}`", f"- machine: {meta['machine']}",
             f"- torch threads: {f['torch_threads']}; medians of {f['samples_per_median']} timings "
             f"({len(f['prompts'])} prompts of exactly {PROMPT_TOKENS} tokens x {f['settings']['repeats']} repeats, "
             f"after {f['settings']['warmup']} warm-up round), epsilon {f['settings']['epsilon']:g}",
             f"- loading the device model (tokenizer, weights, embedding table; shared by every mechanism): "
             f"{f['device_model_load_s']:.2f} s",
             f"- one plain forward pass of the device model over a {PROMPT_TOKENS}-token prompt: "
             f"{1e3 * forward:.1f} ms (the floor of Cape's perturbation)",
             f"- peak memory (ru_maxrss of the whole run so far): {f['peak_rss_mb']:.0f} MiB", "",
             f"| mechanism | setup, s | of which calibration / cache | setup < {SETUP_TARGET_S:g} s | paper's setup, s "
             "| perturb, ms | / forward pass | its target |",
             "|---|---|---|---|---|---|---|---|"]
    for key, ratio in f["ratio_to_forward"].items():
        setup = f["setup"].get(key)
        paper = PAPER_SETUP_SECONDS.get(key)
        if setup is None:
            setup_cells = "- | - | -"
        else:
            extra = (f"calibration {setup['calibration_s']:.2f} s on {setup['calibration_texts']} texts"
                     if setup["calibration_texts"] else "cold cache" if setup["cold_cache"] else "-")
            setup_cells = f"{setup['setup_s']:.2f} | {extra} | {'yes' if setup['setup_s'] < SETUP_TARGET_S else 'no'}"
        target = RATIO_TARGETS.get(key.removesuffix("-int8"))
        verdict = "-" if target is None else f"<= {target:g} x: {'yes' if ratio <= target else 'no'}"
        lines.append(f"| {key} | {setup_cells} | {paper if paper is not None else '-'} | "
                     f"{1e3 * f['perturb_s'][key]:.1f} | {ratio:.2f} | {verdict} |")
    lines += ["", "CUSTEXT and CUSTEXT+ were set up with a cold cache: PRIVLM_CACHE pointed at a new temporary "
              "folder, so their output sets were built, not read. The paper's setup figures (325 s SANTEXT, "
              "2,930 s CUSTEXT, 28.7 s InferDPT, 37.9 s Cape) come from other hardware and vocabularies; "
              "the target ratios apply to Cape (1.3), cape-public and cape-public-fast (3); an int8 row is its "
              "perturbation over the fp32 forward pass."]
    if "int8" in f:
        q = f["int8"]
        lines += ["", f"int8 dynamic quantization of the device model's linear layers: forward pass "
                      f"{1e3 * q['forward_s']:.1f} ms, {q['forward_speedup']:.2f} times faster than fp32"
                  + (f"; Cape's perturbation {q['cape_speedup']:.2f} times faster" if "cape_speedup" in q else "")
                  + "".join(f"; {name} on it takes {ratio:.2f} times its own forward pass"
                            for name, ratio in q.get("ratio_to_int8_forward", {}).items() if name != "cape")
                  + ". Its effect on utility: claims.md (rows `cape-int8`)."]
    path = out_dir / "speed.md"
    path.write_text("\n".join(lines) + "\n")
    return path
