import json
import math

from PIL import Image
from rich.console import Console

from privlm.eval.bench import Point, Sweep, run_sweep
from privlm.eval.provenance import git_commit


def _toy_sweep() -> Sweep:
    def evaluate(point: Point) -> dict[str, float]:
        success = 1.0 if math.isinf(point.level) else point.level / (point.level + 50)
        return {"attack_success": success, "auc": 0.5 + 0.4 * success}

    return Sweep(name="toy", description="A toy sweep.", methods=["a", "b"], levels=[10.0, 100.0],
                 tasks=["t1", "t2"], evaluate=evaluate, references=[Point("clean", math.inf, "t1")],
                 settings={"n": 3})


def test_sweep_writes_json_markdown_and_plots(tmp_path):
    report = run_sweep(_toy_sweep(), out_dir=tmp_path, seed=7, console=Console(quiet=True),
                       command=["privlm", "bench", "toy"])
    assert len(report.rows) == 1 + 2 * 2 * 2
    payload = json.loads((tmp_path / "results.json").read_text())
    meta = payload["metadata"]
    assert meta["command"] == "privlm bench toy" and meta["seed"] == 7 and meta["sweep"] == "toy"
    assert meta["git_commit"] == git_commit() and meta["machine"]["cpu_count"] >= 1
    assert payload["rows"][0]["eta"] == "inf"  # JSON-safe
    assert {row["method"] for row in payload["rows"]} == {"clean", "a", "b"}
    table = (tmp_path / "results.md").read_text()
    assert "privlm bench toy" in table and "| task | method | eta |" in table
    for task in ("t1", "t2"):
        image = Image.open(tmp_path / f"privacy_utility_{task}.png")
        assert image.size[0] > 500 and image.size[1] > 300
