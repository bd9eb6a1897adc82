"""`privlm bench sap`: the grid, the verdicts (from numbers, never hard-coded), the reports and the command.

End to end twice: the quick preset on MiniLM (the real model, tiny sizes), and a small grid that takes every
path (CTI, 2-block bottoms, trainable bottom, both head placements) on a tiny random BERT saved to a folder.
"""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import pytest
import torch
from rich.console import Console
from typer.testing import CliRunner

from privlm_bench.sap.sweep import (
    AIRLINES,
    SapBenchSetting,
    airline_of,
    all_runs,
    plan_runs,
    run_sap_bench,
    verdicts,
)
from tests.models.tiny import tiny_bert_with_minilm_tokenizer

OUTCOMES = {"holds", "does not hold", "mixed", "not measured"}
# tiny attacker halves miss some airlines: the attribute attack's macro AUC warns, its rate is unaffected
pytestmark = pytest.mark.filterwarnings("ignore::sklearn.exceptions.UndefinedMetricWarning")


def _quiet() -> Console:
    return Console(file=io.StringIO(), width=200)


# ---------------------------------------------------------------------------------------------- the grid


def test_the_airline_is_the_first_mentioned_one():
    assert airline_of("@united lost my bag") == AIRLINES.index("united")
    assert airline_of("thanks @JetBlue and @united") == AIRLINES.index("jetblue")
    assert airline_of("@VirginAmerica you rock") == AIRLINES.index("virginamerica")
    assert airline_of("@unitedway is a charity; united we stand") is None
    assert airline_of("no mention at all #DeflateGate") is None


def test_the_default_grid_names_every_run_once():
    names = [spec.name for spec in plan_runs(SapBenchSetting())]
    assert len(names) == len(set(names)) == 20  # the trimmed grid (see the module's docstring)
    assert names[:2] == ["centralised", "k0-none"]
    assert {"k0-eta40", "k0-eta100", "k0-eta75-cti", "k2-eta10", "k4-none", "k0-trainable-eta75",
            "k0-eta60-head-customer", "k2-none-head-customer"} <= set(names)
    assert "k0-eta100-cti" not in names and "k2-eta7.5" not in names
    wider = [spec.name for spec in plan_runs(SapBenchSetting(cti_etas=(40.0, 100.0), deep_etas=(5.0, 7.5, 10.0)))]
    assert {"k0-eta40-cti", "k0-eta100-cti", "k2-eta7.5", "k4-eta7.5"} <= set(wider) and len(wider) == 21
    assert not any(n.endswith("-cti") and "none" in n for n in names)  # CTI only where eta is set
    families = {spec.family for spec in all_runs(SapBenchSetting())}
    assert families == {"centralised", "k0", "k0+CTI", "k2", "k4", "trainable", "head=customer"}
    kept = plan_runs(SapBenchSetting(runs=("k2-none", "centralised")))
    assert [spec.name for spec in kept] == ["centralised", "k2-none"]  # the grid's order


@pytest.mark.parametrize(("change", "names"), [
    ({"runs": ("k0-eta61",)}, "not in this sweep"), ({"n_train": 0}, "n_train"), ({"epochs": -1}, "epochs"),
    ({"k0_etas": (40.0, 0.0)}, "k0_etas"), ({"deep_etas": (math.nan,)}, "deep_etas"), ({"cti_etas": "50"}, "cti_etas"),
    ({"deep_blocks": (0,)}, "deep_blocks"), ({"privacy_margin": 1.5}, "privacy_margin"),
    ({"attribute_classifier": "svm"}, "attribute_classifier"), ({"device": "tpu"}, "device"),
])
def test_the_setting_refuses_bad_values(change, names):
    with pytest.raises(ValueError, match=names):
        SapBenchSetting(**change)


# ---------------------------------------------------------------------------------------------- verdicts


def _run(name, family, *, blocks=0, eta=None, accuracy=0.7, privacy=0.5, nts=None, first=None, cti=False,
         trainable=False):
    return {"name": name, "family": family, "blocks": blocks, "eta": eta, "cti": cti, "head": "vendor", "n_test": 1000,
            "trainable_bottom": trainable, "test_accuracy": accuracy, "empirical_privacy": privacy,
            "noise_to_signal": nts, "inversion": {"first_epoch": None if first is None else
                                                  {"empirical_privacy": first}}}


def _by_claim(results):
    return {v["claim"].split()[0]: v for v in results}


def test_the_cti_verdict_follows_the_numbers():
    base = [_run("centralised", "centralised", privacy=None), _run("k0-eta50", "k0", eta=50.0, accuracy=0.60,
                                                                    privacy=0.40)]
    holds = _by_claim(verdicts([*base, _run("k0-eta50-cti", "k0+CTI", eta=50.0, accuracy=0.65, privacy=0.39,
                                            cti=True)]))["CTI"]
    assert holds["outcome"] == "holds"
    assert holds["evidence"][0]["accuracy_difference"] == pytest.approx(0.05)
    assert holds["evidence"][0]["privacy_difference"] == pytest.approx(-0.01)
    assert holds["evidence"][0]["accuracy_difference_se"] == pytest.approx(math.sqrt((0.65 * 0.35 + 0.6 * 0.4) / 1000))
    no_gain = verdicts([*base, _run("k0-eta50-cti", "k0+CTI", eta=50.0, accuracy=0.605, privacy=0.40, cti=True)])
    assert _by_claim(no_gain)["CTI"]["outcome"] == "does not hold"
    less_private = verdicts([*base, _run("k0-eta50-cti", "k0+CTI", eta=50.0, accuracy=0.70, privacy=0.30, cti=True)])
    assert _by_claim(less_private)["CTI"]["outcome"] == "does not hold"
    mixed = verdicts([*base, _run("k0-eta50-cti", "k0+CTI", eta=50.0, accuracy=0.65, privacy=0.40, cti=True),
                      _run("k0-eta75", "k0", eta=75.0, accuracy=0.7, privacy=0.2),
                      _run("k0-eta75-cti", "k0+CTI", eta=75.0, accuracy=0.7, privacy=0.2, cti=True)])
    assert _by_claim(mixed)["CTI"]["outcome"] == "mixed"
    assert _by_claim(verdicts(base))["CTI"]["outcome"] == "not measured"
    loose = verdicts([*base, _run("k0-eta50-cti", "k0+CTI", eta=50.0, accuracy=0.605, privacy=0.40, cti=True)],
                     accuracy_margin=0.001)
    assert _by_claim(loose)["CTI"]["outcome"] == "holds"  # the margin is a setting, not a constant


def test_the_depth_verdict_compares_no_noise_same_eta_and_comparable_noise():
    runs = [_run("k0-none", "k0", privacy=0.0), _run("k0-eta50", "k0", eta=50.0, privacy=0.3, nts=6.7),
            _run("k0-eta100", "k0", eta=100.0, privacy=0.05, nts=3.4),
            _run("k2-none", "k2", blocks=2, privacy=0.4), _run("k2-eta5", "k2", blocks=2, eta=5.0, privacy=0.8,
                                                                 nts=6.4),
            _run("k4-none", "k4", blocks=4, privacy=0.6), _run("k4-eta5", "k4", blocks=4, eta=5.0, privacy=0.9,
                                                                 nts=6.5)]
    verdict = _by_claim(verdicts(runs))["deeper"]
    assert verdict["outcome"] == "holds"
    pairs = {(e["deeper"], e["shallower"]) for e in verdict["evidence"]}
    assert {("k2-none", "k0-none"), ("k4-none", "k2-none"), ("k4-eta5", "k2-eta5"), ("k2-eta5", "k0-eta50"),
            ("k4-eta5", "k0-eta50")} == pairs  # eta 5 at k >= 1 is matched to k = 0's eta 50, not 100
    runs[5] = _run("k4-none", "k4", blocks=4, privacy=0.39)
    assert _by_claim(verdicts(runs))["deeper"]["outcome"] == "mixed"
    flat = [_run("k0-none", "k0", privacy=0.0), _run("k2-none", "k2", blocks=2, privacy=0.01)]
    assert _by_claim(verdicts(flat))["deeper"]["outcome"] == "does not hold"
    assert _by_claim(verdicts(flat[:1]))["deeper"]["outcome"] == "not measured"


def test_the_trainable_verdict_uses_the_union_against_the_frozen_bottom():
    frozen = _run("k0-eta60", "k0", eta=60.0, privacy=0.5)
    lower = _run("k0-trainable-eta60", "trainable", eta=60.0, privacy=0.3, first=0.49, trainable=True)
    verdict = _by_claim(verdicts([frozen, lower]))["a"]
    assert verdict["outcome"] == "holds"
    assert verdict["evidence"][0]["drop"] == pytest.approx(0.2)
    assert verdict["evidence"][0]["privacy_first_epoch"] == 0.49
    same = _run("k0-trainable-eta60", "trainable", eta=60.0, privacy=0.49, first=0.5, trainable=True)
    assert _by_claim(verdicts([frozen, same]))["a"]["outcome"] == "does not hold"
    assert _by_claim(verdicts([same]))["a"]["outcome"] == "not measured"  # no frozen run at that eta


# ---------------------------------------------------------------------------------------------- end to end


def _check_payload(payload: dict, names: list[str]) -> dict[str, dict]:
    meta = payload["metadata"]
    assert meta["sweep"] == "sap" and meta["git_commit"] and meta["command"] and meta["seed"] == 0
    assert meta["machine"]["cpu_count"] >= 1 and meta["wall_seconds"] > 0 and meta["started_utc"]
    assert payload["setting"]["n_train"] == payload["data"]["sizes"]["train"]
    assert [r["name"] for r in payload["runs"]] == names
    runs = {r["name"]: r for r in payload["runs"]}
    for run in payload["runs"]:
        assert 0 <= run["test_accuracy"] <= 1 and 0 <= run["validation_accuracy"] <= 1
        assert 1 <= run["best_epoch"] <= payload["setting"]["epochs"]
        if run["name"] == "centralised":
            assert run["empirical_privacy"] is None and run["inversion"]["rate"] is None
            continue
        inversion = run["inversion"]
        assert 0 <= inversion["ci_low"] <= inversion["rate"] <= inversion["ci_high"] <= 1
        assert run["empirical_privacy"] == pytest.approx(1 - inversion["rate"])
        assert inversion["trials"] > 0 and inversion["seconds"] is not None
        label = run["label_inference"]
        assert 0 <= label["rate"] <= 1 and label["examples"] == payload["setting"]["n_train"]
        if run["head"] == "vendor":
            assert label["rate"] == 1.0  # dL/dlogits names every label
        attribute = run["attribute"]
        assert attribute["rate"] is None or 0 <= attribute["chance"] <= 1
        assert run["bytes_per_step"] > 0 and run["vendor_seconds"] > 0 and run["customer_seconds"] > 0
        assert run["privacy"]["eta_tokens"] == (0 if run["eta"] is None else pytest.approx(
            run["eta"] * run["privacy"]["noised_positions"]))
    assert [v["outcome"] in OUTCOMES for v in payload["verdicts"]] == [True] * 3
    return runs


def _check_files(files: list[Path]) -> dict:
    assert [f.name for f in files] == ["results.json", "results.md", "privacy_utility.png"]
    assert files[2].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and files[2].stat().st_size > 10_000
    assert not (files[0].parent / "runs.partial.jsonl").exists()
    payload = json.loads(files[0].read_text())
    markdown = files[1].read_text()
    assert "## The paper's claims" in markdown and all(r["name"] in markdown for r in payload["runs"])
    return payload


@pytest.mark.slow
def test_the_quick_preset_runs_on_minilm(tmp_path):
    setting = SapBenchSetting.quick()
    files = run_sap_bench(setting, tmp_path, _quiet())
    payload = _check_files(files)
    runs = _check_payload(payload, ["centralised", "k0-eta60", "k2-none"])
    norms = payload["hidden_norms"]
    assert set(norms) == {"0", "2"} and norms["2"]["mean_norm"] > 5 * norms["0"]["mean_norm"]  # ~12 vs ~1.1
    assert runs["k0-eta60"]["noise_to_signal"] == pytest.approx(384 / 60 / norms["0"]["mean_norm"])
    assert runs["k0-eta60"]["inversion"]["examples"] == 16 and runs["k2-none"]["inversion"]["examples"] == 4
    assert runs["k2-none"]["privacy"]["eta_tokens"] == 0


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    """A 5-block random BERT with MiniLM's tokenizer, saved as a local model folder."""
    return tiny_bert_with_minilm_tokenizer(tmp_path_factory.mktemp("tiny-bert"), blocks=5)


# Smaller than the quick preset, every path still taken (two steps an epoch; 32 test texts, so the k0-none check
# below allows one text). What costs is each released token's projection on MiniLM's 30,522-word vocabulary.
TINY = {"n_train": 32, "n_validation": 16, "max_length": 16, "opt_steps": 5}


@pytest.mark.slow
def test_every_kind_of_run_on_a_tiny_model(tiny_model, tmp_path):
    setting = SapBenchSetting.quick(model=str(tiny_model), runs=(), k0_etas=(50.0,), cti_etas=(50.0,), deep_blocks=(2,),
                                    deep_etas=(5.0,), trainable_etas=(50.0,), head_eta=50.0, epochs=2, **TINY)
    names = ["centralised", "k0-none", "k0-eta50", "k0-eta50-cti", "k2-none", "k2-eta5", "k0-trainable-eta50",
             "k0-eta50-head-customer", "k2-none-head-customer"]
    assert [spec.name for spec in plan_runs(setting)] == names
    payload = _check_files(run_sap_bench(setting, tmp_path, _quiet()))
    runs = _check_payload(payload, names)
    assert runs["k0-none"]["inversion"]["rate"] == 1.0  # exact embedding rows: nearest neighbour reads them all
    assert "(hidden states)" in (tmp_path / "results.md").read_text()  # the k = 2 runs' spend, in its own unit
    _check_the_report_renders_again(tmp_path)
    assert runs["k0-none"]["test_accuracy"] == pytest.approx(runs["centralised"]["test_accuracy"], abs=1 / 32)
    assert runs["k0-eta50-cti"]["cti"]["covered_share"] <= 0.01
    trainable = runs["k0-trainable-eta50"]["inversion"]
    assert trainable["method"].startswith("union over 2 epochs") and trainable["rate"] >= trainable["first_epoch"][
        "rate"]
    assert runs["k0-trainable-eta50"]["privacy"]["example_releases"] >= 2 * setting.n_train  # every epoch again
    # the head placements release the same noise: the same inversion, paired
    assert runs["k0-eta50-head-customer"]["inversion"]["rate"] == runs["k0-eta50"]["inversion"]["rate"]
    assert runs["k2-none-head-customer"]["inversion"] == runs["k2-none"]["inversion"]
    assert runs["k2-none-head-customer"]["label_inference"]["gradients"] == "dL/dh"
    claims = {v["claim"].split()[0]: v for v in payload["verdicts"]}
    assert claims["CTI"]["evidence"][0]["eta"] == 50.0 and claims["a"]["evidence"][0]["eta"] == 50.0
    assert {(e["deeper"], e["shallower"]) for e in claims["deeper"]["evidence"]} == {
        ("k2-none", "k0-none"), ("k2-eta5", "k0-eta50")}


@pytest.mark.slow
def test_a_crashed_sweep_resumes(tiny_model, tmp_path):
    setting = SapBenchSetting.quick(model=str(tiny_model), runs=("k0-none", "k0-eta60"), **TINY)
    first = json.loads(run_sap_bench(setting, tmp_path, _quiet())[0].read_text())
    kept = first["runs"][0] | {"test_accuracy": 0.123}  # marks the record as one taken from the partial file
    (tmp_path / "runs.partial.jsonl").write_text(json.dumps(kept) + "\n")
    again = json.loads(run_sap_bench(setting, tmp_path, _quiet(), resume=True)[0].read_text())
    assert again["metadata"]["resumed_runs"] == ["k0-none"]
    assert again["runs"][0]["test_accuracy"] == 0.123 and again["runs"][1]["name"] == "k0-eta60"


# ---------------------------------------------------------------------------------------------- the command


@pytest.mark.parametrize(("args", "says"), [
    (["--train", "0"], "--train"), (["--epochs", "0"], "--epochs"), (["--runs", "k0-eta61"], "not in this sweep"),
    (["--k0-etas", "40,-1"], "--k0-etas"), (["--deep-etas", "x"], "--deep-etas"), (["--cti-etas", "inf"], "--cti-etas"),
    (["--device", "tpu"], "device"),
    (["--opt-steps", "0"], "--opt-steps"), (["--nonsense"], "No such option"),
])
def test_the_command_refuses_bad_flags(args, says, tmp_path):
    import privlm.cli  # noqa: F401 - registers every command
    from privlm.cli import app

    result = CliRunner().invoke(app, ["bench", "sap", "--out", str(tmp_path), *args], env={"COLUMNS": "300"})
    assert result.exit_code == 2, (args, result.output)
    assert says in result.output, result.output
    assert not (tmp_path / "results.json").exists()


def test_cti_runs_report_the_attack_on_noised_positions_apart():
    from privlm_bench.sap.sweep import SapBench, _Sample

    vocabulary = torch.eye(4)
    true_ids = torch.tensor([[0, 1, 2, 3]])
    values = torch.stack([vocabulary[0], vocabulary[1], vocabulary[3], vocabulary[2]]).unsqueeze(0)  # 2, 3 swapped
    sample = _Sample(values=values, true_ids=true_ids, attention_mask=torch.ones(1, 4, dtype=torch.long),
                     text_mask=torch.tensor([[False, True, True, True]]))  # position 0 is a special token
    split = SapBench._exempt_split(sample, vocabulary, exempt=torch.tensor([1]))
    assert split["exempt_positions"] == 1
    assert split["on_noised_positions"]["trials"] == 2 and split["on_noised_positions"]["rate"] == 0.0
    assert SapBench._exempt_split(sample, vocabulary, exempt=torch.tensor([], dtype=torch.long)) == {}


def _check_the_report_renders_again(folder: Path) -> None:
    """`privlm bench report` rewrites results.md and the plot from results.json alone, to the same text."""
    import privlm.cli  # noqa: F401 - registers every command
    from privlm.cli import app

    written = (folder / "results.md").read_text()
    (folder / "results.md").unlink()
    (folder / "privacy_utility.png").unlink()
    result = CliRunner().invoke(app, ["bench", "report", str(folder)])
    assert result.exit_code == 0, result.output
    assert (folder / "results.md").read_text() == written and (folder / "privacy_utility.png").stat().st_size > 10_000


@pytest.mark.slow
def test_the_service_bench_compares_http_with_one_process(tiny_model, tmp_path):
    from privlm_bench.sap.service import ServiceBenchSetting, run_service_bench

    setting = ServiceBenchSetting.quick(model=str(tiny_model), batch_size=2, steps=2)  # one timed step per session
    files = run_service_bench(setting, tmp_path, _quiet())
    assert [f.name for f in files] == ["results.json", "results.md"]
    payload = json.loads(files[0].read_text())
    local, remote = payload["in_process"], payload["http"]
    assert local["bytes_per_step"] == remote["bytes_per_step"] > 0  # the same messages either way
    assert local["upload_bytes"] == remote["upload_bytes"] > 0
    assert local["latency"]["steps"] == remote["latency"]["steps"] == setting.steps - setting.warmup
    assert payload["overhead_ms"] == pytest.approx(remote["latency"]["median_ms"] - local["latency"]["median_ms"])
    assert [r["sessions"] for r in payload["throughput"]] == [1, 2]
    assert all(r["steps"] == r["sessions"] * setting.steps and r["steps_per_second"] > 0
               for r in payload["throughput"])
    assert payload["metadata"]["sweep"] == "sap-service" and payload["metadata"]["git_commit"]
    written = files[1].read_text()
    files[1].unlink()
    import privlm.cli  # noqa: F401 - registers every command
    from privlm.cli import app

    assert CliRunner().invoke(app, ["bench", "report", str(tmp_path)]).exit_code == 0
    assert files[1].read_text() == written


@pytest.mark.parametrize(("change", "names"), [({"steps": 0}, "steps"), ({"warmup": 5, "steps": 5}, "warmup"),
                                               ({"sessions": (0,)}, "sessions"), ({"eta": -1.0}, "eta")])
def test_the_service_bench_refuses_bad_settings(change, names):
    from privlm_bench.sap.service import ServiceBenchSetting

    with pytest.raises(ValueError, match=names):
        ServiceBenchSetting(**change)
