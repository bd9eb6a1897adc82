"""Issue 37, item 10: the files a gateway writes are its owner's only. The audit log (it names callers and holds
what was sent), the conversation memory and a SQLite ledger were created 0644 (the umask's default); each is
created 0600, and SQLite's -wal, -shm and -journal files beside it take the database file's mode."""

from __future__ import annotations

import io
import os
import sqlite3
import stat
from collections.abc import Iterator
from contextlib import closing, contextmanager
from pathlib import Path
from typing import Any

import pytest

from privlm.accounting import Ledger
from privlm.chat.service.audit import AuditLog
from privlm.chat.service.memory import ConversationMemory, EarlierRelease
from privlm.mechanisms import PrivacyUnit, Spend

PRIVATE = 0o600


@pytest.fixture(autouse=True)
def usual_umask() -> Iterator[None]:
    """The common umask 022, under which a file made without a mode of its own is 0644 (readable by all)."""
    previous = os.umask(0o022)
    yield
    os.umask(previous)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def beside(path: Path, suffix: str) -> Path:
    return path.with_name(path.name + suffix)


@contextmanager
def reading(path: Path) -> Iterator[None]:
    """A connection reading a WAL database meanwhile: its -wal and -shm files stay (the last connection to close
    removes them)."""
    with closing(sqlite3.connect(path)) as reader:
        reader.execute("SELECT name FROM sqlite_master").fetchall()
        yield


def test_round3_10_a_sqlite_ledger_and_its_wal_files_are_created_0600(tmp_path):
    path = tmp_path / "ledgers" / "chat.sqlite"  # a folder of its own, made too
    ledger = Ledger(path, budgets={PrivacyUnit.EPSILON: 10.0})
    with reading(path):
        ledger.spend(ledger.principal_of_key("sk-team"), Spend(PrivacyUnit.EPSILON, 1.0))
        files = [path, beside(path, "-wal"), beside(path, "-shm"), beside(path, ".secret")]
        assert {file.name: oct(mode(file)) for file in files} == {file.name: oct(PRIVATE) for file in files}


def test_round3_10_the_conversation_memory_and_its_wal_files_are_created_0600(tmp_path):
    path = tmp_path / "chat.sqlite.memory"
    memory = ConversationMemory(path)
    with reading(path):
        memory.remember_releases("hmac-key:team", [("I have asthma.", EarlierRelease("I have a cold."))])
        files = [path, beside(path, "-wal"), beside(path, "-shm"), beside(path, ".secret")]
        assert {file.name: oct(mode(file)) for file in files} == {file.name: oct(PRIVATE) for file in files}


def test_round3_10_a_jsonl_audit_log_is_created_0600_and_made_again_so_after_a_rotation(tmp_path):
    path = tmp_path / "audit" / "released.jsonl"
    audit = AuditLog(path)
    audit.write("released", {"principal": "hmac-key:team", "texts": ["I have a cold."]})
    assert oct(mode(path)) == oct(PRIVATE)
    path.rename(beside(path, ".1"))  # logrotate's move: the next write makes the file again
    audit.write("released", {"principal": "hmac-key:team", "texts": ["Hello."]})
    assert oct(mode(path)) == oct(PRIVATE) and len(audit.records()) == 1


def test_round3_10_a_sqlite_audit_log_and_its_journal_are_created_0600(tmp_path):
    path = tmp_path / "audit.sqlite"
    audit = AuditLog(path)
    audit.write("released", {"principal": "hmac-key:team", "texts": ["I have a cold."]})
    assert oct(mode(path)) == oct(PRIVATE)
    with closing(sqlite3.connect(path, isolation_level=None)) as writer:  # a write in progress: its journal
        writer.execute("BEGIN IMMEDIATE")
        writer.execute("INSERT INTO audit (time, event, record) VALUES (0, 'x', '{}')")
        assert oct(mode(beside(path, "-journal"))) == oct(PRIVATE)
        writer.execute("ROLLBACK")


@contextmanager
def rotated_before_each_open(path: Path) -> Iterator[list[Path]]:
    """logrotate moving ``path`` away just before each open of it (``os.open``, or ``io.open`` as ``Path.open``
    calls it): whatever makes the log again at that open, or at any later one, decides its mode. Yields the
    rotated files."""
    rotated: list[Path] = []
    real_os_open, real_io_open = os.open, io.open

    def rotate(file: object) -> None:
        if isinstance(file, (str, os.PathLike)) and Path(file) == path and path.exists():
            rotated.append(path.rename(beside(path, f".{len(rotated) + 1}")))

    def os_open(file: Any, *args: Any, **kwargs: Any) -> int:
        rotate(file)
        return real_os_open(file, *args, **kwargs)

    def io_open(file: Any, *args: Any, **kwargs: Any) -> Any:
        rotate(file)
        return real_io_open(file, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(os, "open", os_open)
        patch.setattr(io, "open", io_open)
        yield rotated


def test_round3_10_a_jsonl_audit_log_rotated_just_before_an_append_opens_it_is_made_again_0600(tmp_path):
    path = tmp_path / "released.jsonl"
    audit = AuditLog(path)
    audit.write("released", {"principal": "hmac-key:team", "texts": ["I have a cold."]})
    with rotated_before_each_open(path) as rotated:
        audit.write("released", {"principal": "hmac-key:team", "texts": ["Hello."]})
    assert rotated  # the log was moved away at least once while the record was written
    assert oct(mode(path)) == oct(PRIVATE)
    assert [record["texts"] for record in audit.records()] == [["Hello."]]
