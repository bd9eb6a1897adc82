"""`privlm sap customer` against a vendor on localhost: a labelled JSONL file in, a report and the adapter out."""

from __future__ import annotations

import json

from safetensors import safe_open
from typer.testing import CliRunner

import privlm.cli  # noqa: F401 - registers every command
from privlm.cli import app
from privlm.sap.model import VendorModel
from privlm.sap.service.server import create_vendor_app
from tests.sap.conftest import LABELS, TEXTS
from tests.sap.service.conftest import KEYS
from tests.service.localhost import serving


def test_the_customer_command_fine_tunes_from_a_file(vendor_model, tmp_path, monkeypatch):
    monkeypatch.setenv("PRIVLM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PRIVLM_SAP_API_KEY", KEYS[0])  # the key from the environment, not the command line
    data = tmp_path / "labelled.jsonl"
    data.write_text("\n".join(json.dumps({"text": t, "label": y}) for t, y in zip(TEXTS * 2, LABELS * 2,
                                                                                 strict=True)))
    vendor = create_vendor_app(VendorModel.load(str(vendor_model)), store=tmp_path / "store", api_keys=KEYS)
    with serving(vendor) as url:
        result = CliRunner().invoke(app, ["sap", "customer", url, "--data", str(data), "--epochs", "2",
                                          "--batch-size", "4", "--eta", "50", "--out", str(tmp_path / "run")],
                                    env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "validation accuracy" in result.output and "eta-token" in result.output
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert len(report["epochs"]) == 2 and report["steps"] == 2 * 4  # 13 training texts in batches of 4, 2 epochs
    assert report["privacy"]["eta_tokens"] > 0 and report["traffic"]["by_purpose"]["training"]["messages"] == 16
    with safe_open(str(tmp_path / "run" / "adapter.safetensors"), "pt") as adapter:
        assert any("lora_B" in name for name in adapter.keys())  # noqa: SIM118 - safe_open has no __iter__
        assert json.loads(adapter.metadata()["facts"])["head"] == "customer"


def test_the_customer_command_refuses_a_bad_file(tmp_path):
    data = tmp_path / "labelled.jsonl"
    data.write_text('{"text": "fine"}\n')
    result = CliRunner().invoke(app, ["sap", "customer", "http://127.0.0.1:9", "--data", str(data)],
                                env={"COLUMNS": "200"})
    said = " ".join(result.output.split())
    assert result.exit_code == 2 and "has no column 'label'" in said and "--data" in said, result.output
