"""Issue 22's review of the SAP vendor: the secret of its sessions' owners lives inside the session store, with a
check value beside it, and the numeric bound can be raised from the command line.

Replicas that mount one shared store must name owners alike wherever the volume is mounted; a lost or replaced
secret is refused at start rather than silently orphaning every session; ``--store .`` works. The vendors run on
real servers on localhost; the command line runs through typer with the server start replaced.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch
from fastapi import FastAPI
from typer.testing import CliRunner

import privlm.cli  # registers every command
import privlm.service
from privlm.accounting import SecretFileError
from privlm.cli import app
from privlm.sap.model import VendorModel
from privlm.sap.service.server import create_vendor_app
from privlm.sap.service.wire import SESSIONS_PATH
from tests.sap.service.conftest import KEYS
from tests.sap.service.test_numeric_limits import _Session
from tests.sap.service.test_vendor_server import _fingerprint, _session
from tests.service.localhost import serving

SECRET, CHECK = "principals.secret", "principals.check"


def _vendor(model: Path, store: Path | str) -> FastAPI:
    return create_vendor_app(VendorModel.load(str(model)), store=store, api_keys=KEYS)


def _opened(model: Path, store: Path | str) -> str:
    """A session opened by KEYS[0] on a vendor over ``store``."""
    with serving(_vendor(model, store)) as url:
        return str(_session(url, KEYS[0], _fingerprint(url))["id"])


def _status_by_key(model: Path, store: Path | str, session_id: str) -> list[int]:
    """What each of KEYS gets for ``session_id`` from a vendor over ``store``."""
    with serving(_vendor(model, store)) as url:
        return [httpx.get(f"{url}{SESSIONS_PATH}/{session_id}", headers={"Authorization": f"Bearer {key}"}).status_code
                for key in KEYS]


def test_note_ledger_principals_replicas_mounting_one_store_anywhere_agree_on_owners(vendor_model, tmp_path):
    """A shared volume mounted at another path on another machine (a link here): the second replica's sessions
    are the first's, and nothing is written beside the store, outside the volume."""
    volume = tmp_path / "volume"
    other_machine = tmp_path / "node-2" / "mnt"
    other_machine.parent.mkdir()
    session_id = _opened(vendor_model, volume)
    other_machine.symlink_to(volume, target_is_directory=True)
    assert _status_by_key(vendor_model, other_machine, session_id) == [200, 404]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["node-2", "volume"]
    assert {SECRET, CHECK} <= {p.name for p in volume.iterdir()}


def test_note_ledger_principals_a_lost_or_replaced_vendor_secret_is_refused_with_one_line(vendor_model, tmp_path):
    store = tmp_path / "store"
    session_id = _opened(vendor_model, store)
    secret = store / SECRET
    kept = secret.read_bytes()
    secret.write_bytes(bytes(32))
    with pytest.raises(SecretFileError, match="not the secret the session store") as replaced:
        _vendor(vendor_model, store)
    secret.unlink()
    with pytest.raises(SecretFileError, match="which is gone") as gone:
        _vendor(vendor_model, store)
    assert "\n" not in str(replaced.value) + str(gone.value)
    assert not secret.exists()  # refusing made no new secret either
    secret.write_bytes(kept)
    assert _status_by_key(vendor_model, store, session_id) == [200, 404]


def _vendor_command(args: list[str], monkeypatch: pytest.MonkeyPatch) -> tuple[int, str, list[FastAPI]]:
    """``privlm sap vendor ARGS``, the app it would serve captured instead of served."""
    served: list[FastAPI] = []
    monkeypatch.setattr(privlm.service, "run_service", lambda vendor, **_: served.append(vendor))
    result = CliRunner().invoke(app, ["sap", "vendor", *args], env={"COLUMNS": "200"})
    return result.exit_code, result.output, served


def test_note_ledger_principals_the_vendor_command_takes_store_dot(vendor_model, tmp_path, monkeypatch):
    sessions = tmp_path / "sessions"
    sessions.mkdir()
    monkeypatch.chdir(sessions)
    code, output, served = _vendor_command(["--store", ".", "--model", str(vendor_model), "--api-key", KEYS[0]],
                                           monkeypatch)
    assert code == 0, output
    with serving(served[0]) as url:
        session_id = _session(url, KEYS[0], _fingerprint(url))["id"]
    assert (sessions / session_id).is_dir() and (sessions / SECRET).is_file() and (sessions / CHECK).is_file()


def test_finding_6_the_refusal_names_the_setting_that_raises_the_bound(vendor_model, tmp_path):
    with serving(_vendor(vendor_model, tmp_path / "store")) as url:
        refused = _Session(url).upload(torch.full((2, 4, 32), 2e4))
    assert refused.status_code == 422, refused.text
    message = refused.json()["error"]["message"]
    assert "SessionLimits.max_abs_value" in message and "--max-abs-value" in message


def test_finding_6_the_vendor_command_sets_the_bound_and_refuses_a_bad_one(vendor_model, tmp_path, monkeypatch):
    command = ["--store", str(tmp_path / "store"), "--model", str(vendor_model), "--api-key", KEYS[0]]
    code, output, served = _vendor_command([*command, "--max-abs-value", "1e6"], monkeypatch)
    assert code == 0, output
    with serving(served[0]) as url:
        assert _Session(url).upload(torch.full((2, 4, 32), 2e4)).status_code == 200  # beyond 1e4, within 1e6
    for bad in ("nan", "inf", "0", "-1"):
        code, output, served = _vendor_command([*command, "--max-abs-value", bad], monkeypatch)
        assert code == 2 and "--max-abs-value" in output and not served, output
