"""Conversation memory (privlm.chat.service.memory): keyed by principal and text under a secret, holding no
original text, kept across a restart, bounded in size and age."""

from __future__ import annotations

import stat

import pytest

from privlm.chat.restore import ReplacedSpan
from privlm.chat.service.memory import ConversationMemory, EarlierRelease

ORIGINAL = "Patient Krzysztof Wojciechowski has pneumonia"
RELEASE = EarlierRelease("Patient Tomasz Nowak has pneumonia", (ReplacedSpan(8, 31, "Tomasz Nowak"),))


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def test_a_release_is_found_again_by_its_principal_only(tmp_path):
    memory = ConversationMemory(tmp_path / "memory.sqlite")
    memory.remember_releases("alice", [(ORIGINAL, RELEASE)])
    assert memory.releases("alice", [ORIGINAL, "another text"]) == [RELEASE, None]
    assert memory.releases("bob", [ORIGINAL]) == [None]
    assert RELEASE.spans[0].original_in(ORIGINAL) == "Krzysztof Wojciechowski"


def test_the_store_holds_no_original_text_and_its_secret_is_private(tmp_path):
    path = tmp_path / "memory.sqlite"
    memory = ConversationMemory(path)
    memory.remember_releases("alice", [(ORIGINAL, RELEASE), ("Dear Krzysztof", EarlierRelease("Dear Tomasz"))])
    memory.close()
    stored = b"".join(p.read_bytes() for p in tmp_path.iterdir() if not p.name.endswith(".secret"))
    assert b"Tomasz Nowak" in stored and b"Dear Tomasz" in stored  # what the upstream saw
    assert b"Krzysztof" not in stored and b"Wojciechowski" not in stored and b"alice" not in stored
    secret = tmp_path / "memory.sqlite.secret"
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600


def test_a_restart_keeps_the_memory_and_a_new_secret_forgets_it(tmp_path):
    path = tmp_path / "memory.sqlite"
    ConversationMemory(path).remember_releases("alice", [(ORIGINAL, RELEASE)])
    assert ConversationMemory(path).releases("alice", [ORIGINAL]) == [RELEASE]
    (tmp_path / "memory.sqlite.secret").unlink()  # the keys no longer match: a miss, never a wrong release
    assert ConversationMemory(path).releases("alice", [ORIGINAL]) == [None]


def test_entries_expire_after_their_last_use():
    clock = Clock()
    memory = ConversationMemory(ttl_seconds=100, clock=clock)
    memory.remember_releases("alice", [("a", EarlierRelease("x")), ("b", EarlierRelease("y"))])
    clock.now += 60
    assert memory.releases("alice", ["a"]) == [EarlierRelease("x")]  # used: its clock restarts
    clock.now += 60
    assert memory.releases("alice", ["a", "b"]) == [EarlierRelease("x"), None]
    memory.remember_releases("alice", [("c", EarlierRelease("z"))])  # a write sweeps what expired
    assert len(memory) == 2


def test_beyond_the_bound_the_least_recently_used_go_first():
    clock = Clock()
    memory = ConversationMemory(max_entries=2, clock=clock)
    for text in ("a", "b"):
        memory.remember_releases("alice", [(text, EarlierRelease(text.upper()))])
        clock.now += 1
    memory.releases("alice", ["a"])  # "b" is now the least recently used
    clock.now += 1
    memory.remember_releases("alice", [("c", EarlierRelease("C"))])
    assert memory.releases("alice", ["a", "b", "c"]) == [EarlierRelease("A"), None, EarlierRelease("C")]


def test_replicas_on_one_postgresql_database_share_the_memory(postgres_url, tmp_path):
    secret = tmp_path / "ledger.secret"
    first, second = (ConversationMemory(postgres_url, secret=secret) for _ in range(2))  # two gateway replicas
    first.remember_releases("alice", [(ORIGINAL, RELEASE)])
    assert second.releases("alice", [ORIGINAL, "another text"]) == [RELEASE, None]
    assert second.releases("bob", [ORIGINAL]) == [None]
    second.remember_releases("alice", [(ORIGINAL, EarlierRelease("Patient X has pneumonia"))])  # replaced, not doubled
    assert len(first) == 1 and first.releases("alice", [ORIGINAL]) == [EarlierRelease("Patient X has pneumonia")]
    other = ConversationMemory(postgres_url, secret=tmp_path / "other.secret")
    assert other.releases("alice", [ORIGINAL]) == [None]  # another secret: a miss, never a wrong release


def test_a_postgresql_memory_needs_the_file_of_its_secret(postgres_url):
    with pytest.raises(ValueError, match="secret"):
        ConversationMemory(postgres_url)
