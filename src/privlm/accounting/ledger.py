"""A privacy ledger: what each principal has spent, per unit, checked and spent before every release.

One SQLite file in WAL mode. ``spend`` runs one ``BEGIN IMMEDIATE`` transaction: it takes the
database's write lock, reads the principal's total, refuses if the new total would pass the budget,
and otherwise records the spend; so concurrent spends from threads and processes are serialised and
never pass the budget together. A joint principal (a LiteLLM key *and* its end user) is charged to each of its
members in that one transaction, and refused whole if any member's budget would be passed. Totals survive a
restart. Nothing but the principal's id (for an API key,
an HMAC under the ledger's own secret, kept beside it: :mod:`privlm.accounting.principals`), the unit, the amount,
the time and a short note is stored. Ledgers of earlier versions, which kept an unsalted sha256 prefix of each key,
are migrated by :meth:`Ledger.adopt_keys`.
"""

from __future__ import annotations

import logging
import sqlite3
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import closing, contextmanager
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from privlm._validation import check_non_negative_finite, check_positive_finite
from privlm.accounting.principals import (
    LEGACY_KEY_ID,
    PrincipalHasher,
    SecretFileError,
    legacy_principal_of_key,
    principal_members,
    secret_path_of,
)
from privlm.mechanisms import PrivacyUnit, Spend

_SCHEMA = """
CREATE TABLE IF NOT EXISTS totals (principal TEXT NOT NULL, unit TEXT NOT NULL, spent REAL NOT NULL,
                                   PRIMARY KEY (principal, unit));
CREATE TABLE IF NOT EXISTS spends (id INTEGER PRIMARY KEY, principal TEXT NOT NULL, unit TEXT NOT NULL,
                                   amount REAL NOT NULL, unix_time REAL NOT NULL, note TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);
"""
_BUSY_TIMEOUT_S = 60.0
SCHEMA_VERSION = "2"  # 2: API keys named by an HMAC under the ledger's secret (1: an unsalted sha256 prefix)

log = logging.getLogger("privlm.accounting")


@dataclass(frozen=True)
class KeyMigration:
    """What :meth:`Ledger.adopt_keys` did: old ids renamed to new ones, and old ids of keys not given, left."""

    renamed: int
    left: int


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

    @cached_property
    def principals(self) -> PrincipalHasher:
        """How this ledger names API keys: an HMAC under its secret, ``<ledger>.secret`` (created on first use).

        A secret that has gone missing, or another than the one this ledger was started with, is refused
        (:class:`SecretFileError`): a new secret would give every key a fresh budget."""
        secret_path = secret_path_of(self.path)
        with self._connection() as db:
            row = db.execute("SELECT value FROM meta WHERE name = 'secret_check'").fetchone()
        if row is not None and not secret_path.exists():
            raise SecretFileError(f"the ledger {self.path} was started with the secret {secret_path}, which is gone; "
                                  "restore it from a backup (a new one would reset every key's budget)")
        hasher = PrincipalHasher.from_file(secret_path)
        if row is not None and row[0] != hasher.fingerprint():
            raise SecretFileError(f"{secret_path} is not the secret the ledger {self.path} was started with; "
                                  "restore that one (another would reset every key's budget)")
        with self._connection() as db:
            db.execute("INSERT OR IGNORE INTO meta VALUES ('secret_check', ?)", (hasher.fingerprint(),))
        return hasher

    def principal_of_key(self, api_key: str) -> str:
        """The id this ledger keeps for ``api_key`` (an HMAC under its secret); the key itself is never stored."""
        return self.principals.of_key(api_key)

    def adopt_keys(self, api_keys: Iterable[str]) -> KeyMigration:
        """Migrate the spends of ``api_keys`` under the old ids (an unsalted sha256 prefix) to their HMAC ids, in
        one transaction, totals merged; old ids of other keys stay, and a warning says how many are left."""
        renames = {legacy_principal_of_key(key): self.principal_of_key(key) for key in api_keys}
        with self._connection() as db:
            db.execute("PRAGMA secure_delete=ON")  # the old ids are overwritten in the file, not merely unlinked
            db.execute("BEGIN IMMEDIATE")
            try:
                renamed = sum(self._rename(db, old, new) for old, new in renames.items())
                left = sum(1 for (principal,) in db.execute("SELECT DISTINCT principal FROM totals")
                           if LEGACY_KEY_ID.fullmatch(principal))
                db.execute("INSERT INTO meta VALUES ('schema_version', ?) ON CONFLICT (name) "
                           "DO UPDATE SET value = excluded.value", (SCHEMA_VERSION,))
                if renamed:
                    db.execute("INSERT INTO meta VALUES ('keys_migrated', ?) ON CONFLICT (name) DO UPDATE SET "
                               "value = excluded.value", (f"{renamed} key(s) at unix time {time.time():.0f}",))
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
            if renamed:
                db.execute("PRAGMA wal_checkpoint(TRUNCATE)")  # nor left in the write-ahead log
        if renamed:
            log.info("ledger %s: the spends of %d API key(s) moved from their old sha256 ids to HMAC ids",
                     self.path, renamed)
        if left:
            log.warning("ledger %s holds the old (unsalted sha256) ids of %d API key(s) that are not configured now; "
                        "their spends stay under those ids until the keys are configured again", self.path, left)
        return KeyMigration(renamed=renamed, left=left)

    @staticmethod
    def _rename(db: sqlite3.Connection, old: str, new: str) -> int:
        """Move ``old``'s totals (merged with ``new``'s) and spends to ``new``; 1 if it had any, else 0."""
        rows = db.execute("SELECT unit, spent FROM totals WHERE principal = ?", (old,)).fetchall()
        for unit, spent in rows:
            db.execute("INSERT INTO totals VALUES (?, ?, ?) ON CONFLICT (principal, unit) "
                       "DO UPDATE SET spent = spent + excluded.spent", (new, unit, spent))
        db.execute("DELETE FROM totals WHERE principal = ?", (old,))
        moved = db.execute("UPDATE spends SET principal = ? WHERE principal = ?", (new, old)).rowcount
        return 1 if rows or moved else 0

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
        """What ``principal`` has spent; for a joint principal, the most any of its members has spent."""
        members = principal_members(principal)
        with self._connection() as db:
            return max(self._total(db, member, PrivacyUnit(unit)) for member in members)

    def remaining(self, principal: str, unit: PrivacyUnit) -> float:
        """What ``principal`` may still spend; for a joint principal, the least any of its members has left."""
        return max(0.0, self.budget(unit) - self.spent(principal, unit))

    def spend(self, principal: str, spend: Spend, *, note: str = "") -> Receipt:
        """Atomically check and record ``spend``; raise :class:`BudgetExhaustedError` (spending nothing) if it
        would pass the budget. Call it before the release, never after."""
        return self.spend_all(principal, [spend], note=note)[0]

    def charge(self, principal: str, spends: Sequence[Spend], *, note: str) -> list[Receipt]:
        """Charge a release's ``spends`` to ``principal`` before anything is drawn: all in one transaction, or none
        (:class:`BudgetExhaustedError`). Zero spends are not recorded."""
        priced = [spend for spend in spends if spend.amount != 0]  # a bad amount still reaches spend_all's check
        return self.spend_all(principal, priced, note=note) if priced else []

    def spend_all(self, principal: str, spends: Sequence[Spend], *, note: str = "") -> list[Receipt]:
        """Check and record several spends (a batch of releases) in one transaction: all, or, if together they
        would pass a budget, none (:class:`BudgetExhaustedError`). Call it before the releases, never after.

        A joint principal (:func:`~privlm.accounting.principals.joint_principal`) is charged every spend once per
        member, in this one transaction, and only if no member's budget would be passed; a refusal names the member
        with the least left. Each receipt's total is the most any member has spent, so its ``remaining`` is the
        least any member has left."""
        if not principal:
            raise ValueError("principal must be a non-empty id")
        members = principal_members(principal)
        for spend in spends:
            check_non_negative_finite("spend amount", spend.amount)
        budgets = {PrivacyUnit(s.unit): self.budget(PrivacyUnit(s.unit)) for s in spends}
        receipts = []
        with self._connection() as db:
            db.execute("BEGIN IMMEDIATE")
            try:
                before = {(member, unit): self._total(db, member, unit) for member in members for unit in budgets}
                totals = dict(before)
                for spend in spends:
                    unit = PrivacyUnit(spend.unit)
                    over = [member for member in members if totals[member, unit] + spend.amount > budgets[unit]]
                    if over:  # named: the member with the least left, and what it had spent before this batch
                        worst = max(over, key=lambda member: before[member, unit])
                        raise BudgetExhaustedError(principal=worst, unit=unit, budget=budgets[unit],
                                                   spent=before[worst, unit],
                                                   requested=sum(s.amount for s in spends if s.unit == unit))
                    for member in members:
                        totals[member, unit] += spend.amount
                        db.execute("INSERT INTO totals VALUES (?, ?, ?) ON CONFLICT (principal, unit) "
                                   "DO UPDATE SET spent = spent + excluded.spent", (member, unit.value, spend.amount))
                        db.execute("INSERT INTO spends (principal, unit, amount, unix_time, note) VALUES "
                                   "(?, ?, ?, ?, ?)", (member, unit.value, spend.amount, time.time(), note[:200]))
                    receipts.append(Receipt(principal=principal, spend=Spend(unit, spend.amount),
                                            total=max(totals[member, unit] for member in members),
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

    def refund(self, principal: str, spends: Sequence[Spend], *, note: str) -> list[Receipt]:
        """Give back ``spends`` charged for a release that was never published (the upstream received nothing),
        in one transaction: each is recorded as its own row (a negative amount, with ``note``) and the total
        reduced, never below zero. Each receipt holds the amount given back and the total after it. A joint principal
        gives back to each of its members (the receipt: the least given back, the most spent after)."""
        members = principal_members(principal)
        for spend in spends:
            check_non_negative_finite("refund amount", spend.amount)
        receipts = []
        with self._connection() as db:
            db.execute("BEGIN IMMEDIATE")
            try:
                for spend in spends:
                    unit = PrivacyUnit(spend.unit)
                    given, after = [], []
                    for member in members:
                        total = self._total(db, member, unit)
                        given.append(min(spend.amount, total))
                        after.append(total - given[-1])
                        db.execute("UPDATE totals SET spent = ? WHERE principal = ? AND unit = ?",
                                   (after[-1], member, unit.value))
                        db.execute("INSERT INTO spends (principal, unit, amount, unix_time, note) "
                                   "VALUES (?, ?, ?, ?, ?)", (member, unit.value, -given[-1], time.time(), note[:200]))
                    receipts.append(Receipt(principal=principal, spend=Spend(unit, min(given)), total=max(after),
                                            budget=self.budget(unit)))
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
        return receipts


def charge(ledger: Ledger | None, principal: str, spends: Sequence[Spend], *, note: str) -> list[Receipt]:
    """:meth:`Ledger.charge`, for a system that may run without a ledger: then nothing is recorded, and no receipt
    comes back."""
    return ledger.charge(principal, spends, note=note) if ledger is not None else []
