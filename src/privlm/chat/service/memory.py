"""Conversation memory: a text the gateway has released once is released again identically, and charged nothing.

Resending an earlier release is post-processing of an output already paid for, so a repeat costs no privacy;
and the upstream never sees two noisy copies of one message to average. An answer the gateway returned (restored
or not: :mod:`privlm.chat.restore`) is kept the same way, as released as the text the upstream wrote, so
that when the client sends it back as history it goes up as the upstream's own words, and nothing restored
crosses.

Two kinds of entry, apart, so that a text the upstream wrote is never taken for the user's own release:
  - a *release*: a text this principal sent (perturbed, and paid for), as it went up. Any later message of the
    principal that is equal to it, in any role, goes up as that release, free;
  - an *answer*: an answer the gateway returned to this principal (restored or not), as the upstream wrote it. It
    goes up free only as the same whole ``assistant`` message: in any other role (a user typing "Seattle" after
    the upstream wrote "Seattle"), or as part of a message, it is new, perturbed and charged. The upstream chose its
    words, so a free resend of them as the user's own text would let it plant free releases.

What is stored, per principal, keyed by an HMAC (a local secret) of the kind, the principal and the text, so that
the store holds no original text: the text as it went up (which the upstream has seen), and the offsets of its
replaced spans in the original (which reveal their lengths and places, and which the next request's original
makes whole again). Whoever holds the store *and* its secret can test guesses of a text (is this the HMAC of "I
have cancer"?), as with any keyed hash: keep the secret as private as the ledger's.

A release is kept only once the upstream has received it (the caller's job): kept before, a concurrent repeat
could go up free while the first request, never sent, is refunded.

Bounds, so that no caller can push out another's entries: each principal keeps at most ``max_principal_entries``
entries and ``max_principal_bytes`` bytes (its least recently used go first), an entry over ``max_entry_bytes`` is
not kept, and the whole store keeps at most ``max_entries`` (the disk's bound: only many principals together reach
it). Entries expire ``ttl_seconds`` after their last use. A text whose entry is gone is released afresh, and
charged again: never free. The store is a :mod:`~privlm.accounting.database`: a SQLite file (kept across restarts;
its secret beside it, ``<file>.secret``), a PostgreSQL database shared by every gateway replica (its secret a file
each replica is given: the ledger's), or SQLite in this process's memory only.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from privlm.accounting import DatabaseUnavailableError
from privlm.accounting.database import Database, SqliteDatabase, open_database
from privlm.accounting.principals import PrincipalHasher, secret_path_of
from privlm.chat.restore import ReplacedSpan, replaced_spans
from privlm.chat.service.privacy import PrivateTexts
from privlm.models.perturbation import PromptReport
from privlm.service import ServiceError
from privlm.settings.chat import MEMORY_DAYS, MEMORY_MAX_ENTRIES, MEMORY_MAX_MIB
from privlm.validation import check_positive_finite, check_positive_int

logger = logging.getLogger(__name__)
MAX_ENTRIES = 1_000_000  # the whole store: the disk's bound
MAX_PRINCIPAL_ENTRIES = MEMORY_MAX_ENTRIES
MAX_PRINCIPAL_BYTES = int(MEMORY_MAX_MIB * 2**20)
MAX_ENTRY_BYTES = 2**20  # far above the longest text a request may perturb (8,192 tokens)
TTL_SECONDS = MEMORY_DAYS * 86_400.0
EntryKind = Literal["release", "answer"]

# Before round 3 a table `memory` held releases and answers under one key: its entries cannot tell them apart, so
# it is no longer read (a text it held is released afresh, and charged). It is left for the operator to drop, once no
# older replica uses it: dropped here, it would fail those replicas mid-upgrade.
_SCHEMA = ("CREATE TABLE IF NOT EXISTS conversation_memory (key TEXT PRIMARY KEY, owner TEXT NOT NULL, "
           "value TEXT NOT NULL, bytes INTEGER NOT NULL, used DOUBLE PRECISION NOT NULL)",
           "CREATE INDEX IF NOT EXISTS conversation_memory_owner ON conversation_memory (owner, used)",
           "CREATE INDEX IF NOT EXISTS conversation_memory_used ON conversation_memory (used)")
# The owner's entries beyond its bounds, the least recently used first out (the newest kept while both hold).
_OVER_OWNER_BOUNDS = ("DELETE FROM conversation_memory WHERE owner = ? AND key IN (SELECT key FROM ("
                      "SELECT key, ROW_NUMBER() OVER newest AS n, SUM(bytes) OVER newest AS total "
                      "FROM conversation_memory WHERE owner = ? "
                      "WINDOW newest AS (ORDER BY used DESC, key ROWS UNBOUNDED PRECEDING)) AS ranked "
                      "WHERE n > ? OR total > ?)")


@dataclass(frozen=True)
class EarlierRelease:
    """One text as it went up, and the offsets of its replaced spans in the original."""

    text: str
    spans: tuple[ReplacedSpan, ...] = ()

    def to_json(self) -> str:
        return json.dumps({"text": self.text, "spans": [[s.start, s.end, s.released] for s in self.spans]})

    @classmethod
    def from_json(cls, value: str) -> EarlierRelease:
        data = json.loads(value)
        return cls(str(data["text"]), tuple(ReplacedSpan(int(a), int(b), str(r)) for a, b, r in data["spans"]))


class ConversationMemory:
    """The store (see the module doc). ``location``: a SQLite file, a ``postgresql://`` URL (with ``secret``, the
    file of its secret), or None for this process only. Blocking."""

    def __init__(self, location: str | Path | None = None, *, secret: str | Path | None = None,
                 max_entries: int = MAX_ENTRIES, max_principal_entries: int = MAX_PRINCIPAL_ENTRIES,
                 max_principal_bytes: int = MAX_PRINCIPAL_BYTES, max_entry_bytes: int = MAX_ENTRY_BYTES,
                 ttl_seconds: float = TTL_SECONDS, clock: Callable[[], float] = time.time) -> None:
        self.max_entries = check_positive_int("max_entries", max_entries)
        self.max_principal_entries = check_positive_int("max_principal_entries", max_principal_entries)
        self.max_principal_bytes = check_positive_int("max_principal_bytes", max_principal_bytes)
        self.max_entry_bytes = check_positive_int("max_entry_bytes", max_entry_bytes)
        self.ttl = check_positive_finite("ttl_seconds", ttl_seconds)
        self.clock = clock
        try:
            self._database: Database = open_database(location)
        except ValueError as error:  # a file that is not SQLite's: one line naming it
            raise ValueError(f"the conversation memory: {error}") from None
        self.location = self._database.location
        file = self._database.path if isinstance(self._database, SqliteDatabase) else None
        self.path = file  # None: in a server's database, or in this process's memory
        if secret is None and location is not None and file is None:
            raise ValueError(f"the conversation memory at {self.location} needs the file of its secret (every "
                             "replica that shares it must use the same one)")
        if secret is not None:
            self._hasher = PrincipalHasher.from_file(Path(secret))
        elif file is not None:
            self._hasher = PrincipalHasher.from_file(secret_path_of(file))
        else:
            self._hasher = PrincipalHasher.ephemeral()
        self._database.create_schema(_SCHEMA)

    def _key(self, kind: EntryKind, principal: str, text: str) -> str:
        return self._hasher.digest(f"{kind}\0{principal}\0{text}")

    def _owner(self, principal: str) -> str:
        return self._hasher.digest(f"owner\0{principal}")

    def _get(self, keys: Sequence[str]) -> list[str | None]:
        now = self.clock()
        found: dict[str, str] = {}
        with self._database.transaction() as session:
            for key in sorted(set(keys)):  # one order for every transaction: two never wait on each other
                rows = session.execute("SELECT value FROM conversation_memory WHERE key = ? AND used >= ?",
                                       (key, now - self.ttl))
                if rows:
                    found[key] = rows[0][0]
                    session.execute("UPDATE conversation_memory SET used = ? WHERE key = ?", (now, key))
        return [found.get(key) for key in keys]

    def _put(self, principal: str, items: Sequence[tuple[str, str]]) -> None:
        """Keep ``(key, value)`` entries of ``principal`` (those within ``max_entry_bytes``), then enforce the
        bounds: expired entries, the principal's own, the store's."""
        rows = {key: (value, len(value.encode())) for key, value in items}
        kept = sorted((key, value, size) for key, (value, size) in rows.items() if size <= self.max_entry_bytes)
        if len(kept) < len(rows):
            logger.info("conversation memory: %d entries over %d bytes not kept", len(rows) - len(kept),
                        self.max_entry_bytes)
        if not kept:
            return
        now, owner = self.clock(), self._owner(principal)
        with self._database.transaction() as session:
            session.execute_many("INSERT INTO conversation_memory VALUES (?, ?, ?, ?, ?) ON CONFLICT (key) DO "
                                 "UPDATE SET owner = excluded.owner, value = excluded.value, "
                                 "bytes = excluded.bytes, used = excluded.used",
                                 [(key, owner, value, size, now) for key, value, size in kept])  # one order
            session.execute("DELETE FROM conversation_memory WHERE used < ?", (now - self.ttl,))
            session.execute(_OVER_OWNER_BOUNDS, (owner, owner, self.max_principal_entries,
                                                 self.max_principal_bytes))
            (count,), = session.execute("SELECT COUNT(*) FROM conversation_memory")
            if count > self.max_entries:
                session.execute("DELETE FROM conversation_memory WHERE key IN (SELECT key FROM conversation_memory "
                                "ORDER BY used, key LIMIT ?)", (count - self.max_entries,))

    def releases(self, principal: str, texts: Sequence[str], *,
                 whole_answers: Sequence[bool] = ()) -> list[EarlierRelease | None]:
        """The earlier release of each text by ``principal`` (None: not released before, or expired): an answer the
        gateway returned to it, where ``whole_answers`` marks the text a whole assistant message (the module doc),
        else its own release of that text."""
        answerable = list(whole_answers) or [False] * len(texts)
        if len(answerable) != len(texts):
            raise ValueError("whole_answers must mark every text")
        own = [self._key("release", principal, text) for text in texts]
        returned = [self._key("answer", principal, text) for text, whole in zip(texts, answerable, strict=True)
                    if whole]
        values = self._get(own + returned)
        answers = iter(values[len(own):])
        out: list[EarlierRelease | None] = []
        for whole, value in zip(answerable, values[:len(own)], strict=True):
            answer = next(answers) if whole else None
            found = answer if answer is not None else value
            out.append(None if found is None else EarlierRelease.from_json(found))
        return out

    def remember_releases(self, principal: str, released: Sequence[tuple[str, EarlierRelease]]) -> None:
        """Keep each ``(text, release)`` that ``principal`` sent, as it went up, in one transaction."""
        self._put(principal, [(self._key("release", principal, text), release.to_json())
                              for text, release in released])

    def remember_answers(self, principal: str, answers: Sequence[tuple[str, str]]) -> None:
        """Keep each ``(as returned, as the upstream wrote it)`` answer the gateway returned to ``principal``, in
        one transaction: it goes back up free only as the same whole assistant message."""
        self._put(principal, [(self._key("answer", principal, returned), EarlierRelease(upstream).to_json())
                              for returned, upstream in answers])

    def __len__(self) -> int:
        with self._database.transaction() as session:
            return int(session.execute("SELECT COUNT(*) FROM conversation_memory")[0][0])

    def close(self) -> None:
        self._database.close()


@dataclass(frozen=True)
class Recalled:
    """A request's texts, each sent as released before (``remembered``: charged nothing) or as perturbed now.
    ``result`` covers every text in order, with a report only where it was perturbed now (a text twice in one
    request is perturbed once); ``spans``: each text's replaced spans (for restore); ``new``: what memory keeps."""

    result: PrivateTexts
    remembered: list[bool]
    spans: list[tuple[ReplacedSpan, ...]]
    new: list[tuple[str, EarlierRelease]]


async def release_texts(memory: ConversationMemory | None, principal: str, texts: Sequence[str],
                        privatize: Callable[[list[str]], Awaitable[PrivateTexts]],
                        check: Callable[[list[str]], None] = lambda texts: None, *,
                        whole_answers: Sequence[bool] = ()) -> Recalled:
    """Release ``texts`` for ``principal``: with memory, each text released before as it was (an answer the
    gateway returned only where ``whole_answers`` marks the text a whole assistant message), and the others, each
    once, through ``privatize`` (after ``check``: the work's limits); without, every text through it, repeats
    too. A store that cannot be read fails before any charge (a 500, nothing released). Nothing is kept here:
    the caller keeps ``new`` once the release is recorded (:meth:`ConversationMemory.remember_releases`)."""
    if memory is None:
        perturbed = list(texts)
        check(perturbed)
        result = await privatize(perturbed)
        spans = [replaced_spans(text, report) for text, report in zip(texts, result.reports, strict=True)]
        return Recalled(result, [False] * len(texts), spans, [])
    try:
        earlier = await asyncio.to_thread(memory.releases, principal, texts,
                                          whole_answers=whole_answers) if texts else []
    except DatabaseUnavailableError:
        raise  # a 503: the database is down; read before any charge, so nothing was charged
    except Exception as error:
        logger.warning("conversation memory could not be read (%s)", type(error).__name__)
        raise ServiceError(500, f"conversation memory could not be read ({type(error).__name__}); nothing was "
                                "sent upstream", type="server_error", code="memory_failed") from None
    perturbed = list(dict.fromkeys(text for text, before in zip(texts, earlier, strict=True) if before is None))
    check(perturbed)
    return _recalled(texts, earlier, perturbed, await privatize(perturbed))


def _recalled(texts: Sequence[str], earlier: Sequence[EarlierRelease | None], perturbed: Sequence[str],
              result: PrivateTexts) -> Recalled:
    now = {text: (sent, report) for text, sent, report in zip(perturbed, result.texts, result.reports, strict=True)}
    sent_texts: list[str] = []
    reports: list[PromptReport | None] = []
    remembered: list[bool] = []
    spans: list[tuple[ReplacedSpan, ...]] = []
    seen: set[str] = set()
    for text, before in zip(texts, earlier, strict=True):
        if before is not None:
            sent_texts.append(before.text)
            reports.append(None)
            remembered.append(True)
            spans.append(before.spans)
            continue
        sent, report = now[text]
        sent_texts.append(sent)
        reports.append(None if text in seen else report)
        remembered.append(text in seen and report is not None)
        spans.append(replaced_spans(text, report))
        seen.add(text)
    new = [(text, EarlierRelease(sent, replaced_spans(text, report))) for text, (sent, report) in now.items()
           if report is not None]
    return Recalled(dataclasses.replace(result, texts=sent_texts, reports=reports), remembered, spans, new)
