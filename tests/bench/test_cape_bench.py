import copy
import json
import math
from dataclasses import dataclass

import pytest
import torch
from PIL import Image
from rich.console import Console
from transformers import LlamaForCausalLM
from typer.testing import CliRunner

from privlm.accounting import Ledger
from privlm.attacks import token_id_inversion
from privlm.baselines.token_level import TokenLevelBaseline
from privlm.mechanisms import PrivacyUnit, make_generator
from privlm.models.perturbation import TextPerturber
from privlm.models.prompts import NonSensitiveTokens
from privlm.models.text_mechanisms import (
    MechanismContext,
    TextMechanism,
    build_mechanism,
    text_mechanism_names,
    text_mechanisms,
)
from privlm.models.vocabulary import CandidateVocabulary
from privlm_bench.cape.claims import auc_standard_error, claims_report, tradeoff
from privlm_bench.cape.speed import (
    PROMPT_TOKENS,
    SpeedSetting,
    cold_cache,
    exact_length_prompts,
    measure_speed,
    write_speed,
)
from privlm_bench.cape.sweep import CapeBench, CapeSetting, KnnGuesses, cape_sweep
from privlm_bench.cli.app import registered_sweep
from privlm_bench.harness.bench import run_sweep


# --- a stand-in mechanism with a known law ----------------------------------------------------------
@dataclass(frozen=True)
class KeepOrUniform:
    """Keeps the token with probability ``keep``, else releases a uniform candidate."""

    vocabulary: CandidateVocabulary
    keep: float

    def sample(self, x: torch.Tensor, *, num_samples: int | None = None,
               generator: torch.Generator | None = None) -> torch.Tensor:
        shape = tuple(x.shape) if num_samples is None else (num_samples, *x.shape)
        own = self.vocabulary.candidate_index[x].expand(shape)
        uniform = torch.randint(self.vocabulary.size, shape, generator=generator)
        kept = torch.rand(shape, generator=generator) < self.keep
        return torch.where(kept & (own >= 0), own, uniform)


class KeepOrUniformText(TokenLevelBaseline):
    name = "toy"
    unit = PrivacyUnit.EPSILON

    def __init__(self, vocabulary: CandidateVocabulary, *, epsilon: float, generator: torch.Generator | None = None,
                 ledger: Ledger | None = None, principal: str = "local") -> None:
        super().__init__(vocabulary, epsilon=epsilon, non_sensitive=NonSensitiveTokens.english(), generator=generator,
                         ledger=ledger, principal=principal)
        self.mechanism = KeepOrUniform(vocabulary, epsilon / (epsilon + 10))

    def release(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.vocabulary.candidate_ids[self.mechanism.sample(token_ids, generator=self.generator)]


TOY = TextMechanism(name="toy", label="Toy keep-or-uniform", family="baseline", unit=KeepOrUniformText.unit,
                    description="keeps w.p. eps / (eps + 10)",
                    factory=lambda context, eps, generator, ledger, principal: KeepOrUniformText(
                        context.vocabulary, epsilon=eps, generator=generator, ledger=ledger, principal=principal))


# --- the registry ------------------------------------------------------------------------------
def test_an_unknown_mechanism_is_refused_and_names_are_taken_once_in_order():
    with pytest.raises(ValueError, match="unknown mechanism 'nope'"):
        text_mechanisms(["cape", "nope"])
    assert [m.key for m in text_mechanisms(["santext+", "custext-plus", "cape", "cape"])] == [
        "santext-plus", "custext-plus", "cape"]
    # the bench's default: every registered mechanism but those that rewrite the whole prompt (DP-Prompt)
    assert CapeSetting().mechanisms == tuple(n for n in text_mechanism_names() if n != "dp-prompt")


def test_cli_refuses_an_unknown_mechanism_before_loading_anything():
    from privlm.cli import app

    result = CliRunner().invoke(app, ["bench", "cape", "--mechanisms", "cape,nope"])
    assert result.exit_code != 0
    assert "unknown mechanism 'nope'" in result.output
    result = CliRunner().invoke(app, ["bench", "cape", "--mechanisms", "cape,dp-prompt"])
    assert result.exit_code != 0 and "privlm bench chat-quality" in result.output  # a paraphrase: no token attacks
    with pytest.raises(ValueError, match="rewrite"):
        CapeSetting(mechanisms=("dp-prompt",))


def test_every_mechanism_builds_on_the_device_models_vocabulary_and_perturbs(smollm2_lm):
    context = MechanismContext(smollm2_lm, 30.0)
    for name in CapeSetting().mechanisms:
        perturber = build_mechanism(name, context, epsilon=3.0, generator=make_generator(0))
        assert isinstance(perturber, TextPerturber)
        assert perturber.vocabulary is smollm2_lm.vocabulary
        released = perturber.perturb("Flying to Boston with my sister tomorrow")
        assert released.report.mechanism == name and released.report.n_tokens >= 6


def test_the_knn_cache_equals_token_id_inversion(smollm2_lm):
    table = smollm2_lm.vocabulary.embeddings
    generator = make_generator(3)
    original = torch.randint(table.shape[0], (40,), generator=generator)
    released = torch.where(torch.rand(40, generator=generator) < 0.5, original,
                           torch.randint(table.shape[0], (40,), generator=generator))
    guesses = KnnGuesses(table)
    ours = guesses.attack(released, original)
    again = guesses.attack(released, original)  # from the cache
    reference = token_id_inversion(released, original, table, k=10)
    assert ours.successes == again.successes == reference.successes and ours.trials == reference.trials == 40
    assert 0 < ours.successes < 40


# --- a tiny run, end to end -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_device_model(smollm2_lm, tmp_path_factory):
    """A 2-block random Llama with SmolLM2's tokenizer, chat template and vocabulary, saved as a model folder: the
    sweep takes the same paths as on SmolLM2 (whose forward passes made the run 25 s; the tests above use it)."""
    config = copy.deepcopy(smollm2_lm.model.config)
    config.update({"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                   "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 512})
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
    folder = tmp_path_factory.mktemp("cape-device-model")
    model.save_pretrained(folder)
    smollm2_lm.tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tiny_run(tiny_device_model, vendor_model, tmp_path_factory):
    # vendor_model: a random BERT with MiniLM's tokenizer, the sentence encoder of the utility scores
    setting = CapeSetting(mechanisms=("cape", "cape-unbucketed", "toy"), epsilons=(2.0, 20.0), n_train=24,
                          n_validation=12, n_test=6, calibration_texts=2, zero_shot_texts=2, mti_sentences=1,
                          mti_top_k=1, mti_max_tokens=18, nw_tokens=2, int8_epsilons=(20.0,), device="cpu",
                          device_model=str(tiny_device_model), encoder=str(vendor_model))
    bench = CapeBench(setting, mechanisms=[*text_mechanisms(["cape", "cape-unbucketed"]), TOY])
    out = tmp_path_factory.mktemp("cape-bench")
    report = run_sweep(cape_sweep(setting, bench=bench), out_dir=out, seed=0, console=Console(quiet=True),
                       command=["privlm", "bench", "cape", "--tiny"])
    files = registered_sweep("cape").extra_reports(out)
    return bench, out, report, files


@pytest.mark.slow
def test_the_tiny_run_writes_one_row_per_point_with_provenance(tiny_run):
    _, out, _, _ = tiny_run
    payload = json.loads((out / "results.json").read_text())
    meta, rows = payload["metadata"], payload["rows"]
    assert meta["sweep"] == "cape" and meta["command"] == "privlm bench cape --tiny" and meta["seed"] == 0
    assert meta["level_name"] == "epsilon" and meta["utility_metric"] == "classifier_auc"
    assert meta["settings"]["n_test"] == 6 and meta["settings"]["logit_bound"] > 0
    assert meta["methods"]["cape-int8"] == "Cape, int8 device model"
    points = [(r["method"], r["epsilon"]) for r in rows]
    assert points == [("non-private", "inf"), ("cape-int8", 20.0), ("cape", 2.0), ("cape", 20.0),
                      ("cape-unbucketed", 2.0), ("cape-unbucketed", 20.0), ("toy", 2.0), ("toy", 20.0)]
    for row in rows:
        for metric in ("knn_success", "retention", "unchanged_share", "rouge_l", "classifier_accuracy"):
            assert 0 <= row[metric] <= 1, (row["method"], metric)
        assert row["knn_trials"] > 0 and row["mti_trials"] > 0 and row["nw_median"] >= 1
    clean = rows[0]
    assert clean["retention"] == clean["rouge_l"] == clean["knn_success"] == 1.0
    assert clean["cosine"] == pytest.approx(1.0, abs=1e-5) and clean["zero_shot_auc"] == clean["zero_shot_clean_auc"]
    by_point = {(r["method"], r["epsilon"]): r for r in rows}
    # The toy keeps a token w.p. eps / (eps + 10): 1/6 at eps 2, 2/3 at eps 20 (plus 1/|C| by chance).
    assert by_point[("toy", 2.0)]["retention"] < 0.4 < by_point[("toy", 20.0)]["retention"]
    assert by_point[("toy", 20.0)]["nw_median"] < by_point[("toy", 2.0)]["nw_median"]
    # Cape and its unbucketed twin share one preparation, and each got its own share of it.
    assert by_point[("cape", 2.0)]["perturb_seconds"] > 0 and by_point[("cape-unbucketed", 2.0)]["perturb_seconds"] > 0
    assert by_point[("cape", 2.0)]["knn_trials"] == by_point[("cape-unbucketed", 20.0)]["knn_trials"]


@pytest.mark.slow
def test_the_tiny_run_writes_claims_and_plots(tiny_run):
    _, out, _, files = tiny_run
    claims = (out / "claims.md").read_text()
    assert ("**Cape's trade-off dominates SANTEXT, InferDPT and CUSTEXT+ at equal KNN attack success (the paper "
            "compares SANTEXT and InferDPT only): not measured**") in claims
    assert "## (c) Bucketing" in claims and "**bucketing helps: " in claims
    assert "| Toy keep-or-uniform | " in claims and "int8 device model" in claims
    for name in ("utility_vs_attack.png", "utility_vs_epsilon.png", "privacy_vs_epsilon.png",
                 "privacy_utility_tweets-binary.png"):
        image = Image.open(out / name)
        assert image.size[0] > 500 and image.size[1] > 300
    assert out / "claims.md" in files


@pytest.mark.slow
def test_speed_is_measured_side_by_side_and_rendered(tiny_run, tmp_path):
    bench = tiny_run[0]
    figures = measure_speed(bench, setting=SpeedSetting(prompts=1, repeats=1), console=Console(quiet=True))
    assert set(figures["setup"]) == {"cape", "cape-unbucketed", "toy"}
    assert figures["setup"]["cape"]["calibration_s"] > 0 and figures["setup"]["toy"]["calibration_s"] == 0
    assert set(figures["ratio_to_forward"]) == {"cape", "cape-unbucketed", "toy", "cape-int8"}
    assert figures["forward_s"] > 0 and figures["int8"]["forward_speedup"] > 0 and figures["peak_rss_mb"] > 100
    files = write_speed(tmp_path, figures, seed=0, command=["privlm", "bench", "cape"])
    speed = files[1].read_text()
    assert "| cape | " in speed and "| 37.9 |" in speed and "cold cache" in speed
    assert json.loads(files[0].read_text())["metadata"]["command"] == "privlm bench cape"


def test_prompts_of_exactly_32_tokens(smollm2_lm):
    texts = ["short", "word " * 40, "Flights from Boston to Denver were delayed again today, " * 3]
    prompts = exact_length_prompts(smollm2_lm.tokenizer, texts, PROMPT_TOKENS, 2)
    assert [len(smollm2_lm.tokenizer(p, add_special_tokens=False)["input_ids"]) for p in prompts] == [32, 32]
    with pytest.raises(ValueError, match="exactly 32 tokens"):
        exact_length_prompts(smollm2_lm.tokenizer, texts, PROMPT_TOKENS, 3)


def test_a_cold_cache_is_a_fresh_folder_and_the_old_one_comes_back(monkeypatch):
    monkeypatch.setenv("PRIVLM_CACHE", "/somewhere/else")
    with cold_cache() as folder:
        from privlm.models.sources import cache_dir

        assert cache_dir() == folder and not any(folder.iterdir())
    assert cache_dir() == type(folder)("/somewhere/else")


# --- the verdicts, on constructed rows ----------------------------------------------------------------
def _curve(method: str, points: list[tuple[float, float]], *, start: float = 1.0) -> list[dict[str, object]]:
    return [{"task": "t", "method": method, "epsilon": start + i, "knn_success": attack,
             "knn_success_sensitive": attack, "classifier_auc": auc,
             "retention": attack, "zero_shot_auc": 0.6, "rouge_l": 0.5, "cosine": 0.5, "n_positive": 500.0,
             "n_negative": 500.0} for i, (attack, auc) in enumerate(points)]


CLEAN = [{"task": "t", "method": "non-private", "epsilon": math.inf, "knn_success": 1.0,
          "knn_success_sensitive": 1.0, "classifier_auc": 0.9,
          "retention": 1.0, "zero_shot_auc": 0.62, "zero_shot_n_positive": 50.0, "zero_shot_n_negative": 50.0}]
CAPE = _curve("cape", [(0.1, 0.70), (0.3, 0.80), (0.5, 0.85)])
LOWER = [(0.1, 0.60), (0.3, 0.70), (0.5, 0.75)]  # 0.1 below Cape everywhere
HIGHER = [(0.1, 0.80), (0.3, 0.90), (0.5, 0.95)]
META = {"command": "privlm bench cape", "seed": 0, "git_commit": "abc"}


def test_matched_attack_comparison_interpolates_on_the_common_range():
    other = _curve("santext", [(0.2, 0.60), (0.4, 0.70), (0.8, 0.80)])
    result = tradeoff([*CAPE, *other], "cape", "santext", grid=3)
    assert result.grid == pytest.approx((0.2, 0.35, 0.5))
    assert result.ours_utility == pytest.approx((0.75, 0.8125, 0.85))
    assert result.other_utility == pytest.approx((0.60, 0.675, 0.725))
    assert result.verdict == "holds" and result.better == 3 and result.worse == 0
    assert result.steps == pytest.approx((0.2, 0.4))


def test_auc_standard_error_is_hanley_and_mcneils():
    assert auc_standard_error(0.5, 10, 10) == pytest.approx(math.sqrt((0.25 + 9 / 12 + 9 / 12) / 100))
    assert math.isnan(auc_standard_error(0.7, 0, 10))


def test_claim_a_holds_only_when_cape_beats_all_three_baselines():
    lower = [*_curve("santext", LOWER), *_curve("inferdpt", LOWER)]
    holds = claims_report([*CLEAN, *CAPE, *lower, *_curve("custext-plus", LOWER)], {}, META)
    assert "(the paper compares SANTEXT and InferDPT only): holds**" in holds
    partly = claims_report([*CLEAN, *CAPE, *lower], {}, META)  # CUSTEXT+ not in the run
    assert "(the paper compares SANTEXT and InferDPT only): partly measured**" in partly
    fails = claims_report([*CLEAN, *CAPE, *_curve("santext", LOWER), *_curve("inferdpt", HIGHER),
                           *_curve("custext-plus", LOWER)], {}, META)
    assert "(the paper compares SANTEXT and InferDPT only): does not hold**" in fails
    assert "- Cape vs InferDPT on classifier_auc: **does not hold** at 9 attack levels" in fails
    assert "Why: Cape has the lower utility at attack success 0.100" in fails


def test_ties_and_disjoint_attack_ranges_are_no_win():
    tie = _curve("cape-distance", [(a, u + 0.005) for a, u in [(0.1, 0.70), (0.3, 0.80), (0.5, 0.85)]])
    disjoint = _curve("cape-unbucketed", [(0.0, 0.6), (0.01, 0.7)])
    report = claims_report([*CLEAN, *CAPE, *tie, *disjoint], {}, META)
    assert "**the contextual logits help (lambda_L > 0): does not hold**" in report
    assert "no difference exceeds the noise margin" in report
    assert "**bucketing helps: not measurable**" in report
    assert "spans [0.100, 0.500] for Cape and [0.000, 0.010] for Cape, no buckets; no common level" in report
    assert "Why: the curves share no attack level" in report
    assert "zero-shot AUC on the clean texts is 0.620" in report
    with_logits = claims_report([*CLEAN, *CAPE, *_curve("cape-distance", LOWER)], {}, META)
    assert "**the contextual logits help (lambda_L > 0): holds**" in with_logits
