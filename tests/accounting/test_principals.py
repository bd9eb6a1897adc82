"""Issue 22, note "Ledger principals are an unsalted 64-bit sha256 prefix": callers are named by an HMAC of their
key under a secret kept beside the ledger, and old ledgers (and SAP session stores) are migrated.

The old formula is written out here (``old_id``), not imported: these tests build old-format files with it and
check that no file the services write holds it any more. The gateways run on real servers on localhost and are
called through the real ``openai`` client, with the gateway tests' fake mechanism (the privacy step is not the
point here).
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import sqlite3
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest

from privlm.accounting import Ledger
from privlm.chat.service.audit import AuditLog
from privlm.mechanisms import PrivacyUnit
from privlm.sap.service.wire import SESSIONS_PATH
from tests.sap.service.conftest import KEYS as VENDOR_KEYS
from tests.sap.service.test_vendor_server import _app as vendor_app
from tests.sap.service.test_vendor_server import _fingerprint, _session
from tests.service.localhost import serving
from tests.support.chat import EPS, TIMEOUT, chat_gateway, fake_privacy

KEY = "my-app-key"  # the README's: guessable, so its sha256 prefix names it to anyone
GONE_KEY = "a-key-no-longer-configured"
BUDGET = 100.0
HMAC_ID = re.compile(r"hmac-key:[0-9a-f]{32}")
PROMPT = "Alice from Boston has asthma"  # 5 words: the fake mechanism charges EPS per word


def old_id(key: str) -> str:
    """The id the ledger kept before: ``key:`` + the first 64 bits of an unsalted sha256 of the key."""
    return "key:" + hashlib.sha256(key.encode()).hexdigest()[:16]


def old_ledger(path: Path, spends: dict[str, list[float]]) -> None:
    """A ledger file as the old code wrote it (its schema, its ids), with ``spends`` per principal."""
    with sqlite3.connect(path) as db:
        db.executescript("""
            CREATE TABLE totals (principal TEXT NOT NULL, unit TEXT NOT NULL, spent REAL NOT NULL,
                                 PRIMARY KEY (principal, unit));
            CREATE TABLE spends (id INTEGER PRIMARY KEY, principal TEXT NOT NULL, unit TEXT NOT NULL,
                                 amount REAL NOT NULL, unix_time REAL NOT NULL, note TEXT NOT NULL);""")
        for principal, amounts in spends.items():
            db.execute("INSERT INTO totals VALUES (?, 'epsilon', ?)", (principal, sum(amounts)))
            db.executemany("INSERT INTO spends (principal, unit, amount, unix_time, note) VALUES (?, 'epsilon', ?, 0, "
                           "'old')", [(principal, amount) for amount in amounts])
    db.close()


def file_bytes(path: Path) -> bytes:
    """The file and its SQLite companions (write-ahead log, shared memory), whatever of them exists."""
    return b"".join(p.read_bytes() for p in (path, Path(f"{path}-wal"), Path(f"{path}-shm")) if p.exists())


def principals_in(path: Path) -> set[str]:
    with sqlite3.connect(path) as db:
        found = {row[0] for row in db.execute("SELECT principal FROM totals UNION SELECT principal FROM spends")}
    db.close()
    return found


@contextmanager
def gateway(stub_url: str, ledger_path: Path, *, keys: tuple[str, ...] = (KEY,), audit: AuditLog | None = None
            ) -> Iterator[str]:
    ledger = Ledger(ledger_path, budgets={PrivacyUnit.EPSILON: BUDGET})
    with chat_gateway(fake_privacy(ledger=ledger), stub_url, api_keys=list(keys), audit=audit) as url:
        yield url


def ask(url: str, key: str = KEY) -> float:
    """One chat call through the openai client; the budget left, as the gateway reports it."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=TIMEOUT)
    raw = client.chat.completions.with_raw_response.create(
        model="stub-model", messages=[{"role": "user", "content": PROMPT}])
    return float(raw.headers["x-privlm-budget-remaining"])


def test_note_ledger_principals_an_old_ledger_keeps_its_spends_under_the_hmac_id(stub, tmp_path, caplog):
    path = tmp_path / "ledger.sqlite"
    old_ledger(path, {old_id(KEY): [10.0, 20.0], old_id(GONE_KEY): [5.0]})
    with caplog.at_level(logging.WARNING, logger="privlm.accounting"), gateway(stub.url, path) as url:
        remaining = ask(url)
    assert remaining == pytest.approx(BUDGET - 30.0 - 5 * EPS)  # the 30 spent under the old id carried over
    assert old_id(KEY).encode() not in file_bytes(path)  # renamed, and not left behind in freed pages
    principals = principals_in(path)
    assert old_id(GONE_KEY) in principals  # another key's old id stays: nobody can compute its new one
    [new] = principals - {old_id(GONE_KEY)}
    assert HMAC_ID.fullmatch(new)
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT COUNT(*), SUM(amount) FROM spends WHERE principal = ?", (new,)).fetchone() == (
            3, pytest.approx(30.0 + 5 * EPS))  # the old spend rows moved too
    db.close()
    assert any("1 API key(s)" in record.getMessage() for record in caplog.records)  # the one left, counted


def test_note_ledger_principals_old_and_new_rows_of_one_key_are_merged(tmp_path):
    path = tmp_path / "ledger.sqlite"
    old_ledger(path, {old_id(KEY): [7.0]})
    ledger = Ledger(path, budgets={PrivacyUnit.EPSILON: BUDGET})
    new = ledger.principal_of_key(KEY)
    with sqlite3.connect(path) as db:  # a new-id row already there (a key configured twice over a restart)
        db.execute("INSERT INTO totals VALUES (?, 'epsilon', 3.0)", (new,))
    db.close()
    migration = ledger.adopt_keys([KEY])
    assert (migration.renamed, migration.left) == (1, 0)
    assert ledger.spent(new, PrivacyUnit.EPSILON) == pytest.approx(10.0)
    assert ledger.adopt_keys([KEY]).renamed == 0 and ledger.spent(new, PrivacyUnit.EPSILON) == pytest.approx(10.0)
    with sqlite3.connect(path) as db:
        assert dict(db.execute("SELECT name, value FROM meta"))["schema_version"] == "2"
    db.close()


def test_note_ledger_principals_a_fresh_ledger_and_audit_log_never_hold_the_sha256_prefix(stub, tmp_path):
    ledger_path, audit_path = tmp_path / "ledger.sqlite", tmp_path / "audit.jsonl"
    with gateway(stub.url, ledger_path, audit=AuditLog(audit_path)) as url:
        ask(url)
    prefix = hashlib.sha256(KEY.encode()).hexdigest()[:16].encode()
    assert prefix not in file_bytes(ledger_path) and prefix not in audit_path.read_bytes()
    assert KEY.encode() not in file_bytes(ledger_path) + audit_path.read_bytes()
    audited = {json.loads(line).get("principal") for line in audit_path.read_text().splitlines()} - {None}
    assert audited == principals_in(ledger_path) and all(HMAC_ID.fullmatch(principal) for principal in audited)


def test_note_ledger_principals_two_ledgers_with_their_own_secrets_name_a_key_differently(stub, tmp_path):
    ids = []
    for name in ("one", "two"):
        path = tmp_path / name / "ledger.sqlite"
        path.parent.mkdir()
        with gateway(stub.url, path) as url:
            ask(url)
        ids.append(principals_in(path))
    assert len(ids[0]) == len(ids[1]) == 1 and ids[0] != ids[1]


def test_note_ledger_principals_the_secret_is_private_beside_the_ledger_and_survives_a_restart(stub, tmp_path):
    path = tmp_path / "ledger.sqlite"
    with gateway(stub.url, path) as url:
        first = ask(url)
    secret = tmp_path / "ledger.sqlite.secret"
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600 and len(secret.read_bytes()) == 32
    assert secret.read_bytes() not in file_bytes(path)  # kept apart: a copy of the ledger does not carry it
    with gateway(stub.url, path) as url:
        assert ask(url) == pytest.approx(first - 5 * EPS)  # the same id after a restart: the same budget


def test_note_ledger_principals_a_lost_or_replaced_secret_is_refused_not_a_fresh_budget(stub, tmp_path):
    path = tmp_path / "ledger.sqlite"
    with gateway(stub.url, path) as url:
        ask(url)
    secret = tmp_path / "ledger.sqlite.secret"
    kept = secret.read_bytes()
    secret.unlink()
    with pytest.raises(ValueError, match=r"secret .* is gone"), gateway(stub.url, path):
        pass
    secret.write_bytes(bytes(32))
    with pytest.raises(ValueError, match="not the secret"), gateway(stub.url, path):
        pass
    secret.write_bytes(kept)
    with gateway(stub.url, path) as url:
        assert ask(url) == pytest.approx(BUDGET - 10 * EPS)


def test_note_ledger_principals_a_vendor_session_of_an_old_id_is_handed_to_the_new_one(vendor_model, tmp_path):
    store = tmp_path / "store"
    with serving(vendor_app(vendor_model, store)) as url:
        session = _session(url, VENDOR_KEYS[0], _fingerprint(url))
    record_path = store / session["id"] / "session.json"
    record = json.loads(record_path.read_text())
    record["owner"] = old_id(VENDOR_KEYS[0])  # as the old vendor stored it
    record_path.write_text(json.dumps(record))
    with serving(vendor_app(vendor_model, store)) as url:
        mine = httpx.get(f"{url}{SESSIONS_PATH}/{session['id']}",
                         headers={"Authorization": f"Bearer {VENDOR_KEYS[0]}"}, timeout=TIMEOUT)
        theirs = httpx.get(f"{url}{SESSIONS_PATH}/{session['id']}",
                           headers={"Authorization": f"Bearer {VENDOR_KEYS[1]}"}, timeout=TIMEOUT)
    assert mine.status_code == 200 and theirs.status_code == 404
    owner = json.loads(record_path.read_text())["owner"]
    assert HMAC_ID.fullmatch(owner) and old_id(VENDOR_KEYS[0]).encode() not in record_path.read_bytes()
    assert stat.S_IMODE((store / "principals.secret").stat().st_mode) == 0o600  # inside the store
