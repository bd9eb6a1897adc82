"""An append-only audit log of what a service released: JSON lines or SQLite, chosen by the file's suffix.

A service writes here only what already left the machine (perturbed text) and its privacy report, never
what a caller sent: the record types the callers fill (:class:`AuditRecord`) have no field for it. Writes
are serialised by a lock and each is one ``write`` of one line (or one SQLite transaction), so concurrent
requests never interleave within a record.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from privlm.accounting.database import create_private_file

SQLITE_SUFFIXES = frozenset({".sqlite", ".sqlite3", ".db"})
JSONL_SUFFIXES = frozenset({".jsonl", ".ndjson"})


class AuditLog:
    """``path`` ending in .jsonl/.ndjson (one JSON object per line) or .sqlite/.sqlite3/.db (table ``audit``)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        suffix = self.path.suffix.lower()
        if suffix not in SQLITE_SUFFIXES | JSONL_SUFFIXES:
            raise ValueError(f"audit log path must end in one of {sorted(SQLITE_SUFFIXES | JSONL_SUFFIXES)}, "
                             f"got {self.path.name!r}")
        self.kind = "sqlite" if suffix in SQLITE_SUFFIXES else "jsonl"
        create_private_file(self.path)  # 0600: it names callers and holds what was sent
        self._lock = threading.Lock()
        if self.kind == "sqlite":
            with self._connect() as db:
                db.execute("CREATE TABLE IF NOT EXISTS audit (id INTEGER PRIMARY KEY, time REAL NOT NULL, "
                           "event TEXT NOT NULL, record TEXT NOT NULL)")

    def _connect(self) -> sqlite3.Connection:
        return sqlite3.connect(self.path, timeout=60.0)

    def write(self, event: str, record: Mapping[str, Any]) -> None:
        """Append one record, stamped with the time and the ``event`` name."""
        stamp = time.time()
        entry = {"time": stamp, "event": event, **record}
        with self._lock:
            if self.kind == "jsonl":
                # Opened, or made 0600, in one call: a log moved away (rotated) is made again 0600, with no gap
                # between making it and opening it in which a rotation would let the open make it 0644.
                descriptor = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
                with open(descriptor, "a", encoding="utf-8") as out:
                    out.write(json.dumps(entry, ensure_ascii=False) + "\n")
                return
            with self._connect() as db:
                db.execute("INSERT INTO audit (time, event, record) VALUES (?, ?, ?)",
                           (stamp, event, json.dumps(entry, ensure_ascii=False)))

    def records(self) -> list[dict[str, Any]]:
        """Every record, oldest first."""
        with self._lock:
            if self.kind == "jsonl":
                if not self.path.exists():
                    return []
                return [json.loads(line) for line in self.path.read_text(encoding="utf-8").splitlines() if line]
            with self._connect() as db:
                return [json.loads(row[0]) for row in db.execute("SELECT record FROM audit ORDER BY id")]
