"""Issue 22, finding 7: a refused or failed request is one line on stderr and exit status 1, from every `privlm`
command (run as a real process), and docs/sap.md's vendor and customer commands work together as written."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from privlm.sap.model import VendorModel
from privlm.sap.service.server import create_vendor_app
from privlm.service.auth import KEY_ENV_VARS
from privlm.service.process import free_port, stop
from tests.sap.conftest import LABELS, TEXTS
from tests.service.localhost import dead_url, serving, start_privlm_on_free_port
from tests.test_docs import ROOT, _commands

KEYS = ("key-acme", "key-globex")
CUSTOMER_KEY_ENV = "PRIVLM_SAP_API_KEY"


@pytest.fixture
def labelled(tmp_path: Path) -> Path:
    data = tmp_path / "labelled.jsonl"
    data.write_text("\n".join(json.dumps({"text": t, "label": y}) for t, y in zip(TEXTS * 2, LABELS * 2, strict=True)))
    return data


def _environment(tmp_path: Path, **extra: str) -> dict[str, str]:
    """This process's environment without any key, a cache of the test's own, and ``extra``."""
    kept = {k: v for k, v in os.environ.items() if k not in (*KEY_ENV_VARS, CUSTOMER_KEY_ENV)}
    return kept | {"PRIVLM_CACHE": str(tmp_path / "cache"), "COLUMNS": "200"} | extra


def _privlm(args: list[str], tmp_path: Path, *, cwd: Path | None = None, **env: str
            ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "privlm.cli", *args], capture_output=True, text=True, timeout=300,
                          env=_environment(tmp_path, **env), cwd=cwd)


def _one_line_error(result: subprocess.CompletedProcess[str], *expected: str) -> str:
    """Exit status 1 and, on stderr, one line (no traceback) that names ``expected``."""
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 1, (result.returncode, result.stderr[-3000:])
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert len(lines) == 1, result.stderr[-3000:]
    assert all(word in lines[0] for word in expected), lines[0]
    return lines[0]


def _stub(status: int) -> FastAPI:
    """A server that answers every request with ``status`` in OpenAI's error shape."""
    stub = FastAPI()

    @stub.api_route("/{path:path}", methods=["GET", "POST", "DELETE"])
    async def answer(path: str) -> JSONResponse:
        error = {"message": f"the stub answers {status} to /{path}", "type": "server_error", "param": None,
                 "code": None}
        return JSONResponse({"error": error}, status_code=status)

    return stub


@pytest.mark.slow
@pytest.mark.parametrize("key", [None, "not-a-key-of-this-vendor"])
def test_finding_7_a_customer_the_vendor_refuses_gets_one_line_and_exit_status_1(vendor_model, labelled, tmp_path,
                                                                               key):
    env = {} if key is None else {CUSTOMER_KEY_ENV: key}
    vendor = create_vendor_app(VendorModel.load(str(vendor_model)), store=tmp_path / "store", api_keys=KEYS)
    with serving(vendor) as url:
        result = _privlm(["sap", "customer", url, "--data", str(labelled), "--epochs", "1"], tmp_path, **env)
    _one_line_error(result, "401")


@pytest.mark.slow
def test_finding_7_a_vendor_that_fails_or_cannot_be_reached_is_one_line_too(labelled, tmp_path):
    with serving(_stub(500)) as url:
        failed = _privlm(["sap", "customer", url, "--data", str(labelled)], tmp_path, **{CUSTOMER_KEY_ENV: KEYS[0]})
    _one_line_error(failed, "500")
    with dead_url() as nowhere:
        unreachable = _privlm(["sap", "customer", nowhere, "--data", str(labelled), "--retry-for", "1"], tmp_path,
                              **{CUSTOMER_KEY_ENV: KEYS[0]})
    _one_line_error(unreachable, "no answer after")


@pytest.mark.slow
def test_finding_7_the_gateway_refused_by_its_snd_server_is_one_line_too(tmp_path):
    """Another command, another client (SnD's): the one-line error is the CLI's, not one command's."""
    with serving(_stub(401)) as url:
        result = _privlm(["gateway", "--server", url, "--eta", "50", "--port", str(free_port())], tmp_path)
    _one_line_error(result, "401")


def _documented(command: str) -> list[str]:
    """The first `privlm sap COMMAND` line of docs/sap.md: the bash block of "As a service" (prose comes after)."""
    found = [shlex.split(line)[1:] for line in _commands((ROOT / "docs" / "sap.md").read_text())
             if line.startswith(f"privlm sap {command} ")]
    assert found and "--ray" not in found[0], found
    return found[0]


def _with_value(args: list[str], option: str, value: str) -> list[str]:
    """``args`` with ``option``'s value replaced (or the option added)."""
    if option not in args:
        return [*args, option, value]
    at = args.index(option) + 1
    return [*args[:at], value, *args[at + 1:]]


@pytest.mark.slow
def test_finding_7_the_documented_vendor_and_customer_commands_work_together(vendor_model, labelled, tmp_path):
    """docs/sap.md's two command lines, as written, on the test's model and with one short epoch: the customer
    gets the vendor's key from where the documented line says."""
    vendor, customer = _documented("vendor"), _documented("customer")
    assert "--api-key-file" in vendor and "--api-key-file" in customer
    for args, keys in ((vendor, KEYS), (customer, KEYS[1:])):
        key_file = tmp_path / args[args.index("--api-key-file") + 1]
        key_file.write_text("\n".join(keys) + "\n")
        key_file.chmod(0o600)  # a key file others can read is refused
    (tmp_path / customer[customer.index("--data") + 1]).write_text(labelled.read_text())
    vendor = _with_value(_with_value(vendor, "--store", str(tmp_path / "sessions")), "--model", str(vendor_model))
    vendor = [str(tmp_path / part) if part.endswith(".txt") else part for part in vendor]  # its cwd is the test's
    process, port = start_privlm_on_free_port(lambda port: _with_value(vendor, "--port", str(port)),
                                              env=_environment(tmp_path))
    try:
        url = f"http://127.0.0.1:{port}"
        result = _privlm(["sap", "customer", url, *customer[3:], "--epochs", "1", "--batch-size", "4"], tmp_path,
                         cwd=tmp_path)
    finally:
        stop(process)
    assert result.returncode == 0, result.stderr[-3000:]
    out = tmp_path / customer[customer.index("--out") + 1]
    assert json.loads((out / "report.json").read_text())["steps"] > 0
