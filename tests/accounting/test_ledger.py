"""The privacy ledger: atomic check-and-spend, across threads and processes, and across restarts."""

import math
import multiprocessing
import sqlite3
from concurrent.futures import ThreadPoolExecutor

import pytest

from privlm.accounting import BudgetExhaustedError, Ledger, charge, joint_principal, principal_members
from privlm.mechanisms import PrivacyUnit, Spend

EPS = PrivacyUnit.EPSILON


@pytest.fixture(params=["sqlite", "postgresql"])
def ledger_at(request, tmp_path):
    """Where a test's ledger lives, on each backend: (location, secret)."""
    if request.param == "sqlite":
        return str(tmp_path / "ledger.db"), None
    return request.getfixturevalue("postgres_url"), tmp_path / "ledger.secret"


@pytest.fixture
def open_ledger(ledger_at):
    """Opens (or reopens) the test's ledger, with ``budgets``."""
    location, secret = ledger_at
    return lambda budgets: Ledger(location, budgets=budgets, secret=secret)


def rows(ledger: Ledger, sql: str) -> list[tuple]:
    with ledger.database.transaction() as session:
        return session.execute(sql)


def test_spends_until_the_budget_then_refuses_by_name(open_ledger):
    ledger = open_ledger({"epsilon": 10.0})
    receipts = [ledger.spend("alice", Spend(EPS, 3.0)) for _ in range(3)]
    assert [r.total for r in receipts] == [3.0, 6.0, 9.0] and receipts[-1].remaining == 1.0
    with pytest.raises(BudgetExhaustedError) as refused:
        ledger.spend("alice", Spend(EPS, 3.0))
    assert refused.value.remaining == 1.0 and "epsilon budget" in str(refused.value) and "alice" in str(refused.value)
    assert ledger.spent("alice", EPS) == 9.0  # the refused spend left nothing behind
    assert ledger.spend("bob", Spend(EPS, 10.0)).remaining == 0.0  # budgets are per principal


def test_a_batch_of_spends_is_recorded_whole_or_not_at_all(open_ledger):
    ledger = open_ledger({"epsilon": 10.0})
    receipts = ledger.spend_all("alice", [Spend(EPS, 3.0), Spend(EPS, 4.0)], note="two prompts")
    assert [r.total for r in receipts] == [3.0, 7.0]
    with pytest.raises(BudgetExhaustedError) as refused:
        ledger.spend_all("alice", [Spend(EPS, 1.0), Spend(EPS, 2.5)])  # the first alone would fit
    assert refused.value.requested == 3.5
    assert refused.value.spent == 7.0 and refused.value.remaining == 3.0  # as before the batch, not mid-way
    assert ledger.spent("alice", EPS) == 7.0  # nothing of the refused batch was recorded
    assert ledger.spend_all("alice", []) == []


def test_a_restart_keeps_the_totals(open_ledger, ledger_at):
    open_ledger({"eta-token": 100.0}).spend("k", Spend(PrivacyUnit.ETA_TOKEN, 40.0))
    reopened = open_ledger({"eta-token": 100.0})
    assert reopened.spent("k", PrivacyUnit.ETA_TOKEN) == 40.0 and reopened.remaining("k", PrivacyUnit.ETA_TOKEN) == 60
    if reopened.path is not None:
        with sqlite3.connect(ledger_at[0]) as db:
            assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


@pytest.mark.parametrize("amount", [-1.0, math.nan, math.inf])
def test_bad_amounts_are_refused(open_ledger, amount):
    ledger = open_ledger({"epsilon": 1.0})
    with pytest.raises(ValueError, match="amount"):
        ledger.spend("a", Spend(EPS, amount))
    assert ledger.spent("a", EPS) == 0.0


def test_bad_units_principals_and_budgets_are_refused(open_ledger):
    ledger = open_ledger({"epsilon": 1.0})
    with pytest.raises(ValueError, match="no budget"):
        ledger.spend("a", Spend(PrivacyUnit.ETA_TOKEN, 1.0))
    with pytest.raises(ValueError, match="principal"):
        ledger.spend("", Spend(EPS, 0.5))
    with pytest.raises(ValueError, match="budget"):
        open_ledger({"epsilon": 0.0})


def test_principals_are_key_hmacs(open_ledger):
    ledger = open_ledger({"epsilon": 1.0})
    principal = ledger.principal_of_key("sk-very-secret")
    assert "sk-very-secret" not in principal and principal == ledger.principal_of_key("sk-very-secret")


def _spend_in_threads(location: str, secret, barrier, threads: int) -> int:
    ledger = Ledger(location, budgets={"epsilon": 20.0}, secret=secret)
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
def test_64_concurrent_spends_from_several_processes_never_pass_the_budget(open_ledger, ledger_at):
    open_ledger({"epsilon": 20.0})
    context = multiprocessing.get_context("spawn")
    processes, threads = 4, 16
    barrier = context.Manager().Barrier(processes)
    with context.Pool(processes) as pool:
        granted = pool.starmap(_spend_in_threads, [(*ledger_at, barrier, threads)] * processes)
    assert sum(granted) == 20  # exactly the budget: none lost, none over
    ledger = open_ledger({"epsilon": 20.0})
    assert ledger.spent("shared", EPS) == 20.0
    assert rows(ledger, "SELECT COUNT(*), SUM(amount) FROM spends") == [(20, 20.0)]


# --- charge: the one way a system charges a release ---------------------------------------------------------
def test_charge_without_a_ledger_records_nothing_and_gives_no_receipt():
    assert charge(None, "alice", [Spend(EPS, 3.0)], note="no ledger") == []


def test_charge_is_all_or_nothing_and_skips_zero_spends(open_ledger):
    ledger = open_ledger({"epsilon": 10.0})
    receipts = charge(ledger, "alice", [Spend(EPS, 3.0), Spend(EPS, 0.0), Spend(EPS, 4.0)], note="three prompts")
    assert [r.spend.amount for r in receipts] == [3.0, 4.0] and ledger.spent("alice", EPS) == 7.0
    assert charge(ledger, "alice", [Spend(EPS, 0.0)], note="nothing perturbed") == []
    with pytest.raises(BudgetExhaustedError):
        charge(ledger, "alice", [Spend(EPS, 2.0), Spend(EPS, 2.0)], note="together over the budget")
    assert ledger.spent("alice", EPS) == 7.0  # the refused batch left nothing behind
    with pytest.raises(ValueError, match="finite and >= 0"):
        charge(ledger, "alice", [Spend(EPS, -1.0)], note="a bad amount is not dropped as if it were zero")


def test_the_ledger_method_and_the_function_charge_alike(open_ledger):
    ledger = open_ledger({"epsilon": 10.0})
    assert [r.spend.amount for r in ledger.charge("bob", [Spend(EPS, 0.0), Spend(EPS, 4.0)], note="method")] == [4.0]
    assert ledger.charge("bob", [Spend(EPS, 0.0)], note="nothing priced") == []
    with pytest.raises(BudgetExhaustedError):
        ledger.charge("bob", [Spend(EPS, 3.0), Spend(EPS, 4.0)], note="together over the budget")
    assert ledger.spent("bob", EPS) == 4.0


# --- a joint principal: a LiteLLM key *and* its end user, charged together -----------------------------------
def test_a_joint_principal_charges_every_member_only_if_each_has_budget_left(open_ledger):
    ledger = open_ledger({"epsilon": 10.0})
    both = joint_principal("key", "user")
    receipts = ledger.spend_all(both, [Spend(EPS, 2.0), Spend(EPS, 1.0)], note="two prompts")
    assert ledger.spent("key", EPS) == ledger.spent("user", EPS) == 3.0
    assert [r.principal for r in receipts] == [both, both] and receipts[-1].remaining == 7.0

    ledger.spend("user", Spend(EPS, 5.0))  # the same user through another key
    assert ledger.remaining(both, EPS) == 2.0 == ledger.remaining("user", EPS)  # the smaller of the two
    assert ledger.spent(both, EPS) == 8.0
    with pytest.raises(BudgetExhaustedError) as refused:
        ledger.spend_all(both, [Spend(EPS, 1.5), Spend(EPS, 1.5)])  # the key has 7 left, the user 2
    assert refused.value.principal == "user" and refused.value.remaining == 2.0 and refused.value.requested == 3.0
    assert (ledger.spent("key", EPS), ledger.spent("user", EPS)) == (3.0, 8.0)  # all or nothing: neither charged

    ledger.spend("key", Spend(EPS, 6.5))
    with pytest.raises(BudgetExhaustedError) as refused:
        ledger.spend(both, Spend(EPS, 4.0))  # both over: the one with the least left is named
    assert refused.value.principal == "key" and refused.value.remaining == 0.5


def test_a_joint_refund_gives_back_to_every_member(open_ledger):
    ledger = open_ledger({"epsilon": 10.0})
    both = joint_principal("key", "user")
    ledger.spend("user", Spend(EPS, 1.0))
    ledger.spend(both, Spend(EPS, 4.0))
    [receipt] = ledger.refund(both, [Spend(EPS, 4.0)], note="refund: the upstream received nothing")
    assert (ledger.spent("key", EPS), ledger.spent("user", EPS)) == (0.0, 1.0)
    assert receipt.spend.amount == 4.0 and receipt.remaining == 9.0
    recorded = rows(ledger, "SELECT principal, amount FROM spends ORDER BY id")
    assert recorded == [("user", 1.0), ("key", 4.0), ("user", 4.0), ("key", -4.0), ("user", -4.0)]
    assert both not in {principal for principal, _ in recorded}  # the ledger keeps members, never the joint id


def test_joint_principals_are_well_formed_or_refused(open_ledger):
    assert joint_principal("a") == "a" and joint_principal("a", "a") == "a"
    assert principal_members(joint_principal("b", "a", "b")) == ("b", "a") and principal_members("a") == ("a",)
    odd = 'litellm-end-user:"], "x'  # a member may hold any character: the JSON list keeps it whole
    assert principal_members(joint_principal("k", odd)) == ("k", odd)
    for bad in ((), ("",), ("a", joint_principal("b", "c"))):
        with pytest.raises(ValueError):
            joint_principal(*bad)
    ledger = open_ledger({"epsilon": 10.0})
    for forged in ("all-of:", "all-of:x", 'all-of:["a"]', 'all-of:["a", "a"]', 'all-of:["a", 1]', 'all-of:{"a": 1}'):
        with pytest.raises(ValueError, match="joint principal"):
            ledger.spend(forged, Spend(EPS, 1.0))  # never charged as one id
    assert rows(ledger, "SELECT COUNT(*) FROM spends") == [(0,)]
