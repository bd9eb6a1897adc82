"""A privacy ledger: what each principal has spent, per unit, checked and spent before every release.

One SQLite file in WAL mode. ``spend`` runs one ``BEGIN IMMEDIATE`` transaction: it takes the
database's write lock, reads the principal's total, refuses if the new total would pass the budget,
and otherwise records the spend; so concurrent spends from threads and processes are serialised and
never pass the budget together. Totals survive a restart. Nothing but the principal's id (a key's
hash, never the key), the unit, the amount, the time and a short note is stored.
"""

from __future__ import annotations

import hashlib
import math
import sqlite3
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import closing, contextmanager
from dataclasses import dataclass
from pathlib import Path

from privlm._validation import check_positive_finite
from privlm.mechanisms import PrivacyUnit, Spend

_SCHEMA = """
CREATE TABLE IF NOT EXISTS totals (principal TEXT NOT NULL, unit TEXT NOT NULL, spent REAL NOT NULL,
                                   PRIMARY KEY (principal, unit));
CREATE TABLE IF NOT EXISTS spends (id INTEGER PRIMARY KEY, principal TEXT NOT NULL, unit TEXT NOT NULL,
                                   amount REAL NOT NULL, unix_time REAL NOT NULL, note TEXT NOT NULL);
"""
_BUSY_TIMEOUT_S = 60.0


def principal_of_key(api_key: str) -> str:
    """The id a ledger keeps for an API key: a sha256 prefix, so the key itself is never stored."""
    return "key:" + hashlib.sha256(api_key.encode()).hexdigest()[:16]


class BudgetExhaustedError(Exception):
    """The spend would pass the principal's budget; nothing was spent."""

    def __init__(self, *, principal: str, unit: PrivacyUnit, budget: float, spent: float, requested: float) -> None:
        self.principal, self.unit, self.budget, self.spent, self.requested = principal, unit, budget, spent, requested
        super().__init__(f"privacy budget exhausted: {principal} has spent {spent:.6g} of its {budget:.6g} "
                         f"{unit} budget ({self.remaining:.6g} left); this release needs {requested:.6g}")

    @property
    def remaining(self) -> float:
        return max(0.0, self.budget - self.spent)


@dataclass(frozen=True)
class Receipt:
    """A recorded spend and the principal's total after it."""

    principal: str
    spend: Spend
    total: float
    budget: float

    @property
    def remaining(self) -> float:
        return max(0.0, self.budget - self.total)


class Ledger:
    """Spend per (principal, unit), bounded by ``budgets[unit]`` for every principal."""

    def __init__(self, path: str | Path, *, budgets: Mapping[PrivacyUnit | str, float]) -> None:
        self.path = Path(path)
        self.budgets = {PrivacyUnit(unit): check_positive_finite(f"budget for {unit}", value)
                        for unit, value in budgets.items()}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self._connection() as db:
            db.execute("PRAGMA journal_mode=WAL")
            db.executescript(_SCHEMA)

    @contextmanager
    def _connection(self) -> Iterator[sqlite3.Connection]:
        # One short-lived connection per call: safe across threads and processes.
        with closing(sqlite3.connect(self.path, timeout=_BUSY_TIMEOUT_S, isolation_level=None)) as db:
            db.execute(f"PRAGMA busy_timeout={int(_BUSY_TIMEOUT_S * 1000)}")
            yield db

    def budget(self, unit: PrivacyUnit) -> float:
        if unit not in self.budgets:
            raise ValueError(f"this ledger has no budget for {unit!r}; it has {sorted(self.budgets)}")
        return self.budgets[unit]

    def spent(self, principal: str, unit: PrivacyUnit) -> float:
        with self._connection() as db:
            row = db.execute("SELECT spent FROM totals WHERE principal = ? AND unit = ?",
                             (principal, PrivacyUnit(unit).value)).fetchone()
        return float(row[0]) if row else 0.0

    def remaining(self, principal: str, unit: PrivacyUnit) -> float:
        return max(0.0, self.budget(unit) - self.spent(principal, unit))

    def spend(self, principal: str, spend: Spend, *, note: str = "") -> Receipt:
        """Atomically check and record ``spend``; raise :class:`BudgetExhaustedError` (spending nothing) if it
        would pass the budget. Call it before the release, never after."""
        return self.spend_all(principal, [spend], note=note)[0]

    def spend_all(self, principal: str, spends: Sequence[Spend], *, note: str = "") -> list[Receipt]:
        """Check and record several spends (a batch of releases) in one transaction: all, or, if together they
        would pass a budget, none (:class:`BudgetExhaustedError`). Call it before the releases, never after."""
        if not principal:
            raise ValueError("principal must be a non-empty id")
        for spend in spends:
            if not (math.isfinite(spend.amount) and spend.amount >= 0):
                raise ValueError(f"spend amount must be finite and >= 0, got {spend.amount}")
        budgets = {PrivacyUnit(s.unit): self.budget(PrivacyUnit(s.unit)) for s in spends}
        receipts = []
        with self._connection() as db:
            db.execute("BEGIN IMMEDIATE")
            try:
                totals = {unit: self._total(db, principal, unit) for unit in budgets}
                for spend in spends:
                    unit = PrivacyUnit(spend.unit)
                    if totals[unit] + spend.amount > budgets[unit]:
                        raise BudgetExhaustedError(principal=principal, unit=unit, budget=budgets[unit],
                                                   spent=self._total(db, principal, unit),
                                                   requested=sum(s.amount for s in spends if s.unit == unit))
                    totals[unit] += spend.amount
                    db.execute("INSERT INTO totals VALUES (?, ?, ?) ON CONFLICT (principal, unit) "
                               "DO UPDATE SET spent = spent + excluded.spent", (principal, unit.value, spend.amount))
                    db.execute("INSERT INTO spends (principal, unit, amount, unix_time, note) VALUES (?, ?, ?, ?, ?)",
                               (principal, unit.value, spend.amount, time.time(), note[:200]))
                    receipts.append(Receipt(principal=principal, spend=Spend(unit, spend.amount), total=totals[unit],
                                            budget=budgets[unit]))
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
        return receipts

    @staticmethod
    def _total(db: sqlite3.Connection, principal: str, unit: PrivacyUnit) -> float:
        row = db.execute("SELECT spent FROM totals WHERE principal = ? AND unit = ?",
                         (principal, unit.value)).fetchone()
        return float(row[0]) if row else 0.0
