"""The ledger on a real PostgreSQL server: its secret, its schema made once, failing closed while the server is
down and recovering after, and a SQLite ledger copied over with every total."""

import threading

import pytest
from typer.testing import CliRunner

from privlm.accounting import (
    BudgetExhaustedError,
    DatabaseUnavailableError,
    Ledger,
    SecretFileError,
    copy_ledger,
    joint_principal,
)
from privlm.accounting.database import close_pools, redacted
from privlm.accounting.postgres_server import PostgresMissingError, PostgresServer, server_programs
from privlm.cli import app
from privlm.mechanisms import PrivacyUnit, Spend

EPS = PrivacyUnit.EPSILON


def test_a_postgresql_ledger_needs_its_secret_and_refuses_another(postgres_url, tmp_path):
    with pytest.raises(ValueError, match="secret"):
        Ledger(postgres_url, budgets={"epsilon": 1.0})
    first = Ledger(postgres_url, budgets={"epsilon": 1.0}, secret=tmp_path / "one.secret")
    key_id = first.principal_of_key("sk-team")
    again = Ledger(postgres_url, budgets={"epsilon": 1.0}, secret=tmp_path / "one.secret")
    assert again.principal_of_key("sk-team") == key_id  # a second replica with the same secret agrees
    other = Ledger(postgres_url, budgets={"epsilon": 1.0}, secret=tmp_path / "two.secret")
    with pytest.raises(SecretFileError, match="is gone"):
        other.principal_of_key("sk-team")  # a fresh secret would hand every key a fresh budget
    (tmp_path / "two.secret").write_bytes(bytes(range(32)))
    with pytest.raises(SecretFileError, match="not the secret"):
        other.principal_of_key("sk-team")
    (tmp_path / "one.secret").unlink()
    with pytest.raises(SecretFileError, match="gone"):
        Ledger(postgres_url, budgets={"epsilon": 1.0}, secret=tmp_path / "one.secret").principal_of_key("sk-team")


def test_ledgers_opening_at_once_make_one_schema(postgres_url, tmp_path):
    """Six ledgers opened at once (threads of one process; each makes the schema in its own transaction), each
    spending 1 of a budget of 5: one schema, five spends, one refusal."""
    barrier, errors = threading.Barrier(6), []

    def start() -> None:
        barrier.wait()
        try:
            Ledger(postgres_url, budgets={"epsilon": 5.0}, secret=tmp_path / "s.secret").spend("k", Spend(EPS, 1.0))
        except Exception as error:  # collected: the assertion below names it
            errors.append(error)

    threads = [threading.Thread(target=start) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(errors) == 1 and isinstance(errors[0], BudgetExhaustedError), errors
    assert Ledger(postgres_url, budgets={"epsilon": 5.0}, secret=tmp_path / "s.secret").spent("k", EPS) == 5.0


def test_the_ledger_fails_closed_while_the_server_is_down_and_recovers_without_a_restart(tmp_path):
    server = PostgresServer()
    url = server.start()
    try:
        ledger = Ledger(url, budgets={"epsilon": 10.0}, secret=tmp_path / "s.secret")
        ledger.spend("alice", Spend(EPS, 2.0))
        server.stop(mode="immediate")
        with pytest.raises(DatabaseUnavailableError, match="unavailable") as down:
            ledger.spend("alice", Spend(EPS, 3.0))
        assert "nothing was written" in str(down.value)
        with pytest.raises(DatabaseUnavailableError):
            ledger.remaining("alice", EPS)
        server.start()
        assert ledger.spend("alice", Spend(EPS, 3.0)).total == 5.0  # the refused spend left nothing behind
        assert ledger.spent("alice", EPS) == 5.0
    finally:
        close_pools(url)
        server.remove()


def test_a_sqlite_ledger_copied_to_postgresql_keeps_every_total(postgres_url, tmp_path):
    source = tmp_path / "ledger.sqlite"
    old = Ledger(source, budgets={"epsilon": 10.0, "eta-token": 500.0})
    alice, bob = old.principal_of_key("sk-alice"), old.principal_of_key("sk-bob")
    old.spend_all(alice, [Spend(EPS, 1.25), Spend(EPS, 2.5)], note="two prompts")
    old.spend(joint_principal(bob, "litellm-end-user:carol"), Spend(EPS, 3.0))
    old.spend(bob, Spend(PrivacyUnit.ETA_TOKEN, 123.456))
    old.refund(alice, [Spend(EPS, 1.25)], note="refund: never sent")
    copied = copy_ledger(source, postgres_url)
    assert (copied.principals, copied.totals, copied.spends) == (3, 4, 6)

    new = Ledger(postgres_url, budgets={"epsilon": 10.0, "eta-token": 500.0}, secret=f"{source}.secret")
    assert new.principal_of_key("sk-alice") == alice  # the source's secret names the keys as before
    for principal in (alice, bob, "litellm-end-user:carol"):
        for unit in (EPS, PrivacyUnit.ETA_TOKEN):
            assert new.spent(principal, unit) == old.spent(principal, unit)
    with pytest.raises(BudgetExhaustedError):
        new.spend(bob, Spend(EPS, 7.5))  # 3 spent before the move: 7 left
    with pytest.raises(SecretFileError):
        Ledger(postgres_url, budgets={"epsilon": 10.0}, secret=tmp_path / "fresh.secret").principal_of_key("sk-bob")
    with pytest.raises(ValueError, match="already holds spends"):
        copy_ledger(source, postgres_url)
    with pytest.raises(ValueError, match="no ledger"):
        copy_ledger(tmp_path / "missing.sqlite", postgres_url)


def test_privlm_ledger_migrate_copies_and_says_which_secret_to_use(postgres_url, tmp_path):
    source = tmp_path / "chat.sqlite"
    Ledger(source, budgets={"epsilon": 10.0}).spend("k", Spend(EPS, 4.0))
    password_url = postgres_url.replace("postgres@", "postgres:hunter2@")  # trust auth: the password is not checked
    result = CliRunner().invoke(app, ["ledger", "migrate", str(source), password_url])
    assert result.exit_code == 0, result.output
    assert "Copied 1 totals of 1 principals and 1 spends" in result.output and f"{source}.secret" in result.output
    assert "hunter2" not in result.output and redacted(password_url) in " ".join(result.output.split())
    again = CliRunner().invoke(app, ["ledger", "migrate", str(source), postgres_url])
    assert again.exit_code == 1 and "already holds spends" in again.output
    close_pools(password_url)


def test_without_postgresql_the_tests_say_how_to_install_it(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setattr("glob.glob", lambda pattern: [])
    with pytest.raises(PostgresMissingError, match="apt-get install postgresql"):
        server_programs()


def test_a_busy_pool_refuses_in_time_but_is_kept(postgres_url):
    from privlm.accounting import database

    db = database.PostgresDatabase(postgres_url)
    pool = database._pool(postgres_url)
    held, release = threading.Barrier(database.POOL_SIZE + 1), threading.Event()

    def hold() -> None:
        with db.transaction():
            held.wait()
            release.wait()

    holders = [threading.Thread(target=hold) for _ in range(database.POOL_SIZE)]
    for thread in holders:
        thread.start()
    held.wait()  # every pooled connection is lent
    try:
        with pytest.raises(DatabaseUnavailableError), db.transaction():
            pass
    finally:
        release.set()
        for thread in holders:
            thread.join()
    assert database._pool(postgres_url) is pool  # the server answers: the pool was busy, not broken
    with db.transaction() as session:
        assert session.execute("SELECT 1") == [(1,)]


def test_a_read_only_standby_fails_closed(postgres_url, tmp_path):
    import psycopg

    ledger = Ledger(postgres_url, budgets={"epsilon": 10.0}, secret=tmp_path / "s.secret")
    ledger.spend("alice", Spend(EPS, 1.0))
    name = postgres_url.rsplit("/", 1)[1]
    with psycopg.connect(postgres_url, autocommit=True) as admin:  # as a standby answers after a failover
        admin.execute(f"ALTER DATABASE {name} SET default_transaction_read_only = on")
    close_pools(postgres_url)  # new connections take the setting
    with pytest.raises(DatabaseUnavailableError, match="unavailable"):
        ledger.spend("alice", Spend(EPS, 1.0))
    with psycopg.connect(postgres_url, autocommit=True) as admin:
        admin.execute("SET default_transaction_read_only = off")
        admin.execute(f"ALTER DATABASE {name} RESET default_transaction_read_only")
    close_pools(postgres_url)
    assert ledger.spend("alice", Spend(EPS, 1.0)).total == 2.0
