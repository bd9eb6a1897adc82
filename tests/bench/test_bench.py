import json
import math

import pytest
from PIL import Image
from rich.console import Console

from privlm.provenance import git_commit
from privlm_bench.harness.bench import Method, Point, Sweep, load_results, run_sweep


def _toy_sweep() -> Sweep:
    def evaluate(point: Point) -> dict[str, float]:
        success = 1.0 if math.isinf(point.level) else point.level / (point.level + 50)
        return {"attack_success": success, "auc": 0.5 + 0.4 * success}

    methods = [Method("a", "Method A"), Method("b", "B, with a comma")]
    return Sweep(name="toy", description="A toy sweep.", methods=methods,
                 levels=[10.0, 100.0], tasks=["t1", "t2"], evaluate=evaluate,
                 references=[Point("non-private", math.inf, "t1")], settings={"n": 3})


def test_sweep_writes_json_markdown_and_plots(tmp_path):
    report = run_sweep(_toy_sweep(), out_dir=tmp_path, seed=7, console=Console(quiet=True),
                       command=["privlm", "bench", "toy"])
    assert len(report.rows) == 1 + 2 * 2 * 2
    payload = json.loads((tmp_path / "results.json").read_text())
    meta = payload["metadata"]
    assert meta["command"] == "privlm bench toy" and meta["seed"] == 7 and meta["sweep"] == "toy"
    assert meta["git_commit"] == git_commit() and meta["machine"]["cpu_count"] >= 1
    assert payload["rows"][0]["eta"] == "inf"  # JSON-safe
    assert {row["method"] for row in payload["rows"]} == {"non-private", "a", "b"}  # rows hold keys
    assert meta["methods"] == {"non-private": "non-private", "a": "Method A", "b": "B, with a comma"}
    table = (tmp_path / "results.md").read_text()
    assert "privlm bench toy" in table and "| task | method | eta |" in table
    assert "| t1 | B, with a comma | 10.0 |" in table  # tables show labels
    for task in ("t1", "t2"):
        image = Image.open(tmp_path / f"privacy_utility_{task}.png")
        assert image.size[0] > 500 and image.size[1] > 300


def test_a_crashed_sweep_resumes_where_it_stopped(tmp_path):
    sweep, evaluated = _toy_sweep(), []
    toy_evaluate = sweep.evaluate

    def crashing(point: Point) -> dict[str, float]:
        if point == Point("b", 10.0, "t2"):
            raise RuntimeError("killed")
        evaluated.append(point)
        return toy_evaluate(point)

    sweep.evaluate = crashing
    with pytest.raises(RuntimeError, match="killed"):
        run_sweep(sweep, out_dir=tmp_path, seed=0, console=Console(quiet=True))
    finished = len(evaluated)
    assert len((tmp_path / "results.partial.jsonl").read_text().splitlines()) == finished
    sweep.evaluate = lambda point: evaluated.append(point) or toy_evaluate(point)
    report = run_sweep(sweep, out_dir=tmp_path, seed=0, console=Console(quiet=True), resume=True)
    assert len(evaluated) == len(sweep.points())  # each point evaluated exactly once over the two runs
    assert [(r["task"], r["method"], r["eta"]) for r in report.rows] == [
        (p.task, p.method, p.level) for p in sweep.points()]
    assert not (tmp_path / "results.partial.jsonl").exists()
    fresh = run_sweep(_toy_sweep(), out_dir=tmp_path / "fresh", seed=0, console=Console(quiet=True))
    assert [r["auc"] for r in report.rows] == [r["auc"] for r in fresh.rows]


def test_results_written_before_method_keys_load_with_keys(tmp_path):
    run_sweep(_toy_sweep(), out_dir=tmp_path, seed=0, console=Console(quiet=True))
    payload = json.loads((tmp_path / "results.json").read_text())
    labels = payload["metadata"].pop("methods")
    for row in payload["rows"]:
        row["method"] = labels[row["method"]]  # the old format: labels in the rows
    (tmp_path / "results.json").write_text(json.dumps(payload))
    results = load_results(tmp_path, known=[Method("a", "Method A"), Method("b", "B, with a comma")])
    assert {r["method"] for r in results.rows} == {"non-private", "a", "b"} and results.labels == labels


@pytest.mark.parametrize("name", ["snd", "baselines", "snd-weak-privacy"])
def test_bench_report_reproduces_the_committed_reports(name, tmp_path):
    """Re-rendering a committed results.json gives back the committed tables, claims and plots, byte for byte."""
    import shutil
    from pathlib import Path

    from typer.testing import CliRunner

    from privlm.cli import app

    committed = Path(__file__).parents[2] / "benchmarks" / name
    copy = shutil.copytree(committed, tmp_path / name)
    for generated in [*copy.glob("*.md"), *copy.glob("*.png")]:
        generated.unlink()
    result = CliRunner().invoke(app, ["bench", "report", str(copy)])
    assert result.exit_code == 0, result.output
    for original in [*committed.glob("results.md"), *committed.glob("claims.md"), *committed.glob("*.png")]:
        assert (copy / original.name).read_bytes() == original.read_bytes(), original.name
