"""The privacy ledger: atomic check-and-spend, across threads and processes, and across restarts."""

import math
import multiprocessing
import sqlite3
from concurrent.futures import ThreadPoolExecutor

import pytest

from privlm.accounting import BudgetExhaustedError, Ledger, charge
from privlm.mechanisms import PrivacyUnit, Spend

EPS = PrivacyUnit.EPSILON


def test_spends_until_the_budget_then_refuses_by_name(tmp_path):
    ledger = Ledger(tmp_path / "ledger.db", budgets={"epsilon": 10.0})
    receipts = [ledger.spend("alice", Spend(EPS, 3.0)) for _ in range(3)]
    assert [r.total for r in receipts] == [3.0, 6.0, 9.0] and receipts[-1].remaining == 1.0
    with pytest.raises(BudgetExhaustedError) as refused:
        ledger.spend("alice", Spend(EPS, 3.0))
    assert refused.value.remaining == 1.0 and "epsilon budget" in str(refused.value) and "alice" in str(refused.value)
    assert ledger.spent("alice", EPS) == 9.0  # the refused spend left nothing behind
    assert ledger.spend("bob", Spend(EPS, 10.0)).remaining == 0.0  # budgets are per principal


def test_a_batch_of_spends_is_recorded_whole_or_not_at_all(tmp_path):
    ledger = Ledger(tmp_path / "ledger.db", budgets={"epsilon": 10.0})
    receipts = ledger.spend_all("alice", [Spend(EPS, 3.0), Spend(EPS, 4.0)], note="two prompts")
    assert [r.total for r in receipts] == [3.0, 7.0]
    with pytest.raises(BudgetExhaustedError) as refused:
        ledger.spend_all("alice", [Spend(EPS, 1.0), Spend(EPS, 2.5)])  # the first alone would fit
    assert refused.value.requested == 3.5
    assert ledger.spent("alice", EPS) == 7.0  # nothing of the refused batch was recorded
    assert ledger.spend_all("alice", []) == []


def test_a_restart_keeps_the_totals(tmp_path):
    Ledger(tmp_path / "ledger.db", budgets={"eta-token": 100.0}).spend("k", Spend(PrivacyUnit.ETA_TOKEN, 40.0))
    reopened = Ledger(tmp_path / "ledger.db", budgets={"eta-token": 100.0})
    assert reopened.spent("k", PrivacyUnit.ETA_TOKEN) == 40.0 and reopened.remaining("k", PrivacyUnit.ETA_TOKEN) == 60
    with sqlite3.connect(tmp_path / "ledger.db") as db:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


@pytest.mark.parametrize("amount", [-1.0, math.nan, math.inf])
def test_bad_amounts_are_refused(tmp_path, amount):
    ledger = Ledger(tmp_path / "ledger.db", budgets={"epsilon": 1.0})
    with pytest.raises(ValueError, match="amount"):
        ledger.spend("a", Spend(EPS, amount))
    assert ledger.spent("a", EPS) == 0.0


def test_bad_units_principals_and_budgets_are_refused(tmp_path):
    ledger = Ledger(tmp_path / "ledger.db", budgets={"epsilon": 1.0})
    with pytest.raises(ValueError, match="no budget"):
        ledger.spend("a", Spend(PrivacyUnit.ETA_TOKEN, 1.0))
    with pytest.raises(ValueError, match="principal"):
        ledger.spend("", Spend(EPS, 0.5))
    with pytest.raises(ValueError, match="budget"):
        Ledger(tmp_path / "other.db", budgets={"epsilon": 0.0})


def test_principals_are_key_hmacs(tmp_path):
    ledger = Ledger(tmp_path / "ledger.db", budgets={"epsilon": 1.0})
    principal = ledger.principal_of_key("sk-very-secret")
    assert "sk-very-secret" not in principal and principal == ledger.principal_of_key("sk-very-secret")


def _spend_in_threads(path: str, barrier, threads: int) -> int:
    ledger = Ledger(path, budgets={"epsilon": 20.0})
    barrier.wait()

    def one(_: int) -> bool:
        try:
            ledger.spend("shared", Spend(EPS, 1.0), note="concurrency test")
        except BudgetExhaustedError:
            return False
        return True

    with ThreadPoolExecutor(threads) as pool:
        return sum(pool.map(one, range(threads)))


@pytest.mark.slow
def test_64_concurrent_spends_from_several_processes_never_pass_the_budget(tmp_path):
    path = str(tmp_path / "ledger.db")
    Ledger(path, budgets={"epsilon": 20.0})
    context = multiprocessing.get_context("spawn")
    processes, threads = 4, 16
    barrier = context.Manager().Barrier(processes)
    with context.Pool(processes) as pool:
        granted = pool.starmap(_spend_in_threads, [(path, barrier, threads)] * processes)
    assert sum(granted) == 20  # exactly the budget: none lost, none over
    ledger = Ledger(path, budgets={"epsilon": 20.0})
    assert ledger.spent("shared", EPS) == 20.0
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT COUNT(*), SUM(amount) FROM spends").fetchone() == (20, 20.0)


# --- charge: the one way a system charges a release ---------------------------------------------------------
def test_charge_without_a_ledger_records_nothing_and_gives_no_receipt():
    assert charge(None, "alice", [Spend(EPS, 3.0)], note="no ledger") == []


def test_charge_is_all_or_nothing_and_skips_zero_spends(tmp_path):
    ledger = Ledger(tmp_path / "ledger.db", budgets={"epsilon": 10.0})
    receipts = charge(ledger, "alice", [Spend(EPS, 3.0), Spend(EPS, 0.0), Spend(EPS, 4.0)], note="three prompts")
    assert [r.spend.amount for r in receipts] == [3.0, 4.0] and ledger.spent("alice", EPS) == 7.0
    assert charge(ledger, "alice", [Spend(EPS, 0.0)], note="nothing perturbed") == []
    with pytest.raises(BudgetExhaustedError):
        charge(ledger, "alice", [Spend(EPS, 2.0), Spend(EPS, 2.0)], note="together over the budget")
    assert ledger.spent("alice", EPS) == 7.0  # the refused batch left nothing behind
    with pytest.raises(ValueError, match="finite and >= 0"):
        charge(ledger, "alice", [Spend(EPS, -1.0)], note="a bad amount is not dropped as if it were zero")


def test_the_ledger_method_and_the_function_charge_alike(tmp_path):
    ledger = Ledger(tmp_path / "ledger.db", budgets={"epsilon": 10.0})
    assert [r.spend.amount for r in ledger.charge("bob", [Spend(EPS, 0.0), Spend(EPS, 4.0)], note="method")] == [4.0]
    assert ledger.charge("bob", [Spend(EPS, 0.0)], note="nothing priced") == []
    with pytest.raises(BudgetExhaustedError):
        ledger.charge("bob", [Spend(EPS, 3.0), Spend(EPS, 4.0)], note="together over the budget")
    assert ledger.spent("bob", EPS) == 4.0
