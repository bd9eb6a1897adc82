"""A privacy ledger: what each principal has spent, per unit, checked and spent before every release.

The rows live in a :mod:`~privlm.accounting.database`: a SQLite file (one machine; the default) or a PostgreSQL
server (any number of gateway processes and machines). ``spend`` runs one transaction that reads the
principal's total, refuses if the new total would pass the budget, and otherwise records the spend. On SQLite the
transaction holds the file's write lock; on PostgreSQL it locks the principal's total rows (``FOR UPDATE``,
always in one order). Either way, concurrent spends from threads, processes and machines are serialised per
principal and never pass the budget together. A joint principal (a LiteLLM key *and* its end user) is charged
to each of its members in that one transaction, and refused whole if any member's budget would be passed. Totals
survive a restart. A database that cannot be reached raises
:class:`~privlm.accounting.database.DatabaseUnavailableError`, and nothing is spent or released.

Nothing but the principal's id (for an API key, an HMAC under the ledger's own secret, kept apart from it:
:mod:`privlm.accounting.principals`), the unit, the amount, the time and a short note is stored. Ledgers of earlier
versions, which kept an unsalted sha256 prefix of each key, are migrated by :meth:`Ledger.adopt_keys`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from privlm.accounting.database import Database, Dialect, Session, SqliteDatabase, is_database_url, open_database
from privlm.accounting.principals import (
    LEGACY_KEY_ID,
    PrincipalHasher,
    SecretFileError,
    legacy_principal_of_key,
    principal_members,
    secret_path_of,
)
from privlm.mechanisms import PrivacyUnit, Spend
from privlm.validation import check_non_negative_finite, check_positive_finite


def _schema(dialect: Dialect) -> list[str]:
    # DOUBLE PRECISION: PostgreSQL's REAL has 24 bits; on SQLite both are the same 8-byte float.
    return ["CREATE TABLE IF NOT EXISTS totals (principal TEXT NOT NULL, unit TEXT NOT NULL, "
            "spent DOUBLE PRECISION NOT NULL, PRIMARY KEY (principal, unit))",
            f"CREATE TABLE IF NOT EXISTS spends (id {dialect.serial_key}, principal TEXT NOT NULL, unit TEXT NOT NULL, "
            "amount DOUBLE PRECISION NOT NULL, unix_time DOUBLE PRECISION NOT NULL, note TEXT NOT NULL)",
            "CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL)"]


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
    """Spend per (principal, unit), bounded by ``budgets[unit]`` for every principal.

    ``location``: a SQLite file, or a ``postgresql://`` URL. ``secret``: the file of the secret that names API
    keys (:mod:`privlm.accounting.principals`); by default ``<file>.secret`` beside a SQLite ledger. A PostgreSQL
    ledger needs it given, and every process that shares the database needs the same file: the database keeps a
    check value and refuses another secret, which would give every key a fresh budget."""

    def __init__(self, location: str | Path, *, budgets: Mapping[PrivacyUnit | str, float],
                 secret: str | Path | None = None) -> None:
        self.budgets = {PrivacyUnit(unit): check_positive_finite(f"budget for {unit}", value)
                        for unit, value in budgets.items()}
        self.database: Database = open_database(location)
        self.location = self.database.location
        self.path = self.database.path if isinstance(self.database, SqliteDatabase) else None
        if secret is None and self.path is None:
            raise ValueError(f"the PostgreSQL ledger {self.location} needs the file of its secret (every process "
                             "that shares the database must use the same one)")
        self.secret_path = Path(secret) if secret is not None else secret_path_of(self.path or "")
        self.database.create_schema(_schema(self.database.dialect))
        if self.path is None:  # a new server ledger starts at the current schema: it has no old ids to migrate
            with self.database.transaction() as session:
                session.execute("INSERT INTO meta VALUES ('schema_version', ?) ON CONFLICT (name) DO NOTHING",
                                (SCHEMA_VERSION,))

    @cached_property
    def principals(self) -> PrincipalHasher:
        """How this ledger names API keys: an HMAC under its secret (created on first use if the ledger has
        never had one).

        A secret that has gone missing, or another than the one this ledger was started with, is refused
        (:class:`SecretFileError`): a new secret would give every key a fresh budget."""
        with self.database.transaction() as session:
            rows = session.execute("SELECT value FROM meta WHERE name = 'secret_check'")
        if rows and not self.secret_path.exists():
            raise SecretFileError(f"the ledger {self.location} was started with the secret {self.secret_path}, "
                                  "which is gone; restore it from a backup (a new one would reset every key's budget)")
        hasher = PrincipalHasher.from_file(self.secret_path)
        if rows and rows[0][0] != hasher.fingerprint():
            raise SecretFileError(f"{self.secret_path} is not the secret the ledger {self.location} was started "
                                  "with; use that one (another would reset every key's budget)")
        with self.database.transaction() as session:
            session.execute("INSERT INTO meta VALUES ('secret_check', ?) ON CONFLICT (name) DO NOTHING",
                            (hasher.fingerprint(),))
            (stored,), = session.execute("SELECT value FROM meta WHERE name = 'secret_check'")
        if stored != hasher.fingerprint():  # another process started the ledger with its own secret meanwhile
            raise SecretFileError(f"{self.secret_path} is not the secret the ledger {self.location} was started "
                                  "with; use that one (another would reset every key's budget)")
        return hasher

    def principal_of_key(self, api_key: str) -> str:
        """The id this ledger keeps for ``api_key`` (an HMAC under its secret); the key itself is never stored."""
        return self.principals.of_key(api_key)

    def adopt_keys(self, api_keys: Iterable[str]) -> KeyMigration:
        """Migrate the spends of ``api_keys`` under the old ids (an unsalted sha256 prefix) to their HMAC ids, in
        one transaction, totals merged; old ids of other keys stay, and a warning says how many are left."""
        renames = {legacy_principal_of_key(key): self.principal_of_key(key) for key in api_keys}
        sqlite = self.database if isinstance(self.database, SqliteDatabase) else None
        if sqlite is not None:
            with sqlite.connection() as db:  # the old ids are overwritten in the file, not merely unlinked
                db.execute("PRAGMA secure_delete=ON")
        with self.database.transaction() as session:
            lock = self.database.dialect.for_update
            renamed = sum(self._rename(session, old, new, lock) for old, new in sorted(renames.items()))
            left = sum(1 for (principal,) in session.execute("SELECT DISTINCT principal FROM totals")
                       if LEGACY_KEY_ID.fullmatch(principal))
            session.execute("INSERT INTO meta VALUES ('schema_version', ?) ON CONFLICT (name) "
                            "DO UPDATE SET value = excluded.value", (SCHEMA_VERSION,))
            if renamed:
                session.execute("INSERT INTO meta VALUES ('keys_migrated', ?) ON CONFLICT (name) DO UPDATE SET "
                                "value = excluded.value", (f"{renamed} key(s) at unix time {time.time():.0f}",))
        if renamed and sqlite is not None:
            with sqlite.connection() as db:
                db.execute("PRAGMA wal_checkpoint(TRUNCATE)")  # nor left in the write-ahead log
        if renamed:
            log.info("ledger %s: the spends of %d API key(s) moved from their old sha256 ids to HMAC ids",
                     self.location, renamed)
        if left:
            log.warning("ledger %s holds the old (unsalted sha256) ids of %d API key(s) that are not configured now; "
                        "their spends stay under those ids until the keys are configured again", self.location, left)
        return KeyMigration(renamed=renamed, left=left)

    @staticmethod
    def _rename(session: Session, old: str, new: str, for_update: str) -> int:
        """Move ``old``'s totals (merged with ``new``'s) and spends to ``new``; 1 if it had any, else 0."""
        # Locked: two replicas adopting at once must not both merge the old total into the new one.
        rows = session.execute("SELECT unit, spent FROM totals WHERE principal = ? ORDER BY unit" + for_update, (old,))
        for unit, spent in rows:
            session.execute("INSERT INTO totals VALUES (?, ?, ?) ON CONFLICT (principal, unit) "
                            "DO UPDATE SET spent = totals.spent + excluded.spent", (new, unit, spent))
        session.execute("DELETE FROM totals WHERE principal = ?", (old,))
        moved = session.changed("UPDATE spends SET principal = ? WHERE principal = ?", (new, old))
        return 1 if rows or moved else 0

    def budget(self, unit: PrivacyUnit) -> float:
        if unit not in self.budgets:
            raise ValueError(f"this ledger has no budget for {unit!r}; it has {sorted(self.budgets)}")
        return self.budgets[unit]

    def spent(self, principal: str, unit: PrivacyUnit) -> float:
        """What ``principal`` has spent; for a joint principal, the most any of its members has spent."""
        members = principal_members(principal)
        with self.database.transaction() as session:
            return max(self._total(session, member, PrivacyUnit(unit)) for member in members)

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
        with self.database.transaction() as session:
            before = self._locked_totals(session, [(member, unit) for member in members for unit in budgets])
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
                    session.execute("UPDATE totals SET spent = ? WHERE principal = ? AND unit = ?",
                                    (totals[member, unit], member, unit.value))
                    session.execute("INSERT INTO spends (principal, unit, amount, unix_time, note) VALUES "
                                    "(?, ?, ?, ?, ?)", (member, unit.value, spend.amount, time.time(), note[:200]))
                receipts.append(Receipt(principal=principal, spend=Spend(unit, spend.amount),
                                        total=max(totals[member, unit] for member in members),
                                        budget=budgets[unit]))
        return receipts

    def _locked_totals(self, session: Session, keys: Iterable[tuple[str, PrivacyUnit]]
                       ) -> dict[tuple[str, PrivacyUnit], float]:
        """The totals of ``keys`` (principal, unit), their rows made if missing and locked for this transaction,
        in sorted order: two transactions that lock some of the same rows take them in one order, so neither
        waits for the other forever."""
        totals = {}
        for member, unit in sorted(set(keys)):
            session.execute("INSERT INTO totals VALUES (?, ?, 0) ON CONFLICT (principal, unit) DO NOTHING",
                            (member, unit.value))
            (spent,), = session.execute("SELECT spent FROM totals WHERE principal = ? AND unit = ?"
                                        + self.database.dialect.for_update, (member, unit.value))
            totals[member, unit] = float(spent)
        return totals

    @staticmethod
    def _total(session: Session, principal: str, unit: PrivacyUnit) -> float:
        rows = session.execute("SELECT spent FROM totals WHERE principal = ? AND unit = ?", (principal, unit.value))
        return float(rows[0][0]) if rows else 0.0

    def refund(self, principal: str, spends: Sequence[Spend], *, note: str) -> list[Receipt]:
        """Give back ``spends`` charged for a release that was never published (the upstream received nothing),
        in one transaction: each is recorded as its own row (a negative amount, with ``note``) and the total
        reduced, never below zero. Each receipt holds the amount given back and the total after it. A joint principal
        gives back to each of its members (the receipt: the least given back, the most spent after)."""
        members = principal_members(principal)
        for spend in spends:
            check_non_negative_finite("refund amount", spend.amount)
        receipts = []
        with self.database.transaction() as session:
            totals = self._locked_totals(session, [(member, PrivacyUnit(s.unit)) for member in members for s in spends])
            for spend in spends:
                unit = PrivacyUnit(spend.unit)
                given, after = [], []
                for member in members:
                    given.append(min(spend.amount, totals[member, unit]))
                    after.append(totals[member, unit] - given[-1])
                    totals[member, unit] = after[-1]
                    session.execute("UPDATE totals SET spent = ? WHERE principal = ? AND unit = ?",
                                    (after[-1], member, unit.value))
                    session.execute("INSERT INTO spends (principal, unit, amount, unix_time, note) "
                                    "VALUES (?, ?, ?, ?, ?)", (member, unit.value, -given[-1], time.time(), note[:200]))
                receipts.append(Receipt(principal=principal, spend=Spend(unit, min(given)), total=max(after),
                                        budget=self.budget(unit)))
        return receipts


@dataclass(frozen=True)
class LedgerCopy:
    """What :func:`copy_ledger` copied."""

    principals: int
    totals: int
    spends: int


def copy_ledger(source: str | Path, destination: str | Path) -> LedgerCopy:
    """Copy every total and spend of the ledger at ``source`` (and its secret's check value) into the empty ledger
    at ``destination`` (a SQLite file or a ``postgresql://`` URL; made if new), as one transaction on each side;
    the totals are read back and compared before the copy commits.

    The ids stay HMACs under the source's secret: open the copy with the source's secret file (any other is refused,
    since it would give every key a fresh budget). A destination that already holds spends is refused."""
    if not is_database_url(source) and not Path(source).is_file():
        raise ValueError(f"there is no ledger at {source}")
    origin, target = open_database(source), open_database(destination)
    with origin.transaction() as read:  # SQLite: the write lock, so the copy is one consistent state
        totals = read.execute("SELECT principal, unit, spent FROM totals ORDER BY principal, unit")
        spends = read.execute("SELECT principal, unit, amount, unix_time, note FROM spends ORDER BY id")
        meta = read.execute("SELECT name, value FROM meta")
    target.create_schema(_schema(target.dialect))
    with target.transaction() as write:
        held = write.execute("SELECT COUNT(*) FROM spends")[0][0] + write.execute(
            "SELECT COUNT(*) FROM totals WHERE spent <> 0")[0][0]
        if held:
            raise ValueError(f"the ledger {target.location} already holds spends; copy into an empty one")
        check = dict(meta).get("secret_check")
        there = dict(write.execute("SELECT name, value FROM meta")).get("secret_check")
        if check is not None and there is not None and there != check:
            raise SecretFileError(f"the ledger {target.location} was started with another secret than "
                                  f"{origin.location}'s; copy into a new one")
        write.execute("DELETE FROM totals")
        write.execute_many("INSERT INTO totals VALUES (?, ?, ?)", totals)
        write.execute_many("INSERT INTO spends (principal, unit, amount, unix_time, note) VALUES (?, ?, ?, ?, ?)",
                           spends)
        write.execute_many("INSERT INTO meta VALUES (?, ?) ON CONFLICT (name) DO UPDATE SET value = excluded.value",
                           meta)
        copied = write.execute("SELECT principal, unit, spent FROM totals")
        # Compared as mappings: the two databases may sort text differently (a collation), never differ in value.
        if {(p, u): s for p, u, s in copied} != {(p, u): s for p, u, s in totals}:
            raise ValueError(f"the copy's totals differ from {origin.location}'s; nothing was copied")
    return LedgerCopy(principals=len({principal for principal, _, _ in totals}), totals=len(totals),
                      spends=len(spends))


def charge(ledger: Ledger | None, principal: str, spends: Sequence[Spend], *, note: str) -> list[Receipt]:
    """:meth:`Ledger.charge`, for a system that may run without a ledger: then nothing is recorded, and no receipt
    comes back."""
    return ledger.charge(principal, spends, note=note) if ledger is not None else []
