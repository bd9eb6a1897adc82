"""Per-key epsilon budgets under concurrency (Cape on SmolLM2, a SQLite ledger, the stub upstream).

32 requests from one key at once, half of them streaming, with a budget for 10.5 of them: exactly 10 go
through, the ledger never passes the budget and holds exactly what the successful answers report, the refused
ones are 429s naming the budget and what is left, and the upstream saw the 10 and only them. Another key has its
own budget, and a gateway restarted on the same ledger file sees every spend.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, NamedTuple

import httpx
import pytest

from privlm.accounting import Ledger
from privlm.chat.service.privacy import PromptPrivacy
from privlm.mechanisms import PrivacyUnit
from tests.support.chat import EPS, TIMEOUT, B, StubUpstream, assert_openai_error, chat_body, chat_gateway

pytestmark = pytest.mark.slow

KEY_A, KEY_B = "key-alpha-0001", "key-beta-0002"
PROMPT = "Alice from Boston has asthma."
N_REQUESTS, AFFORDABLE = 32, 10


class Budgeted(NamedTuple):
    ledger_path: Path
    budget: float
    cost: float  # what one request of PROMPT costs (its sound total)


@pytest.fixture(scope="module")
def budgeted(cape_privacy, tmp_path_factory) -> Budgeted:
    cost = cape_privacy.privatize([PROMPT], principal="probe").spent  # deterministic: the utilities are
    return Budgeted(tmp_path_factory.mktemp("budgets") / "ledger.sqlite", (AFFORDABLE + 0.5) * cost, cost)


@pytest.fixture
def gateway_on_ledger(smollm2_lm, stub, budgeted):
    """A factory: a gateway with keys A and B on a fresh Ledger object over the module's ledger file."""
    def start() -> Any:
        ledger = Ledger(budgeted.ledger_path, budgets={PrivacyUnit.EPSILON: budgeted.budget})
        privacy = PromptPrivacy.cape(smollm2_lm, epsilon=EPS, logit_bound=B, ledger=ledger)
        # The per-caller cap on requests in flight (8 by default with keys) is lifted: all 32 reach the ledger.
        return chat_gateway(privacy, stub.url, api_keys=[KEY_A, KEY_B], max_in_flight=2 * N_REQUESTS,
                            max_in_flight_per_caller=2 * N_REQUESTS)
    return start


async def burst(url: str, key: str, n: int) -> list[tuple[httpx.Response, bytes]]:
    """``n`` requests at once from ``key``, every other one streaming; each marked in its ``user`` field."""
    async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT, headers={"authorization": f"Bearer {key}"},
                                 limits=httpx.Limits(max_connections=n)) as client:
        async def one(i: int) -> tuple[httpx.Response, bytes]:
            body = chat_body(PROMPT, user=f"burst-{i}", stream=bool(i % 2))
            async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                return response, await response.aread()
        return list(await asyncio.gather(*(one(i) for i in range(n))))


def post(url: str, key: str, marker: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", json=chat_body(PROMPT, user=marker), timeout=TIMEOUT,
                      headers={"authorization": f"Bearer {key}"})


def test_concurrent_requests_from_one_key_never_overspend(gateway_on_ledger, budgeted, stub: StubUpstream):
    stub.clear()
    with gateway_on_ledger() as url:
        answers = asyncio.run(burst(url, KEY_A, N_REQUESTS))
        other = post(url, KEY_B, "other-key")
    ledger = Ledger(budgeted.ledger_path, budgets={PrivacyUnit.EPSILON: budgeted.budget})
    spent_a = ledger.spent(ledger.principal_of_key(KEY_A), PrivacyUnit.EPSILON)

    ok = [response for response, _ in answers if response.status_code == 200]
    refused = [(response, body) for response, body in answers if response.status_code != 200]
    assert len(ok) == AFFORDABLE and len(refused) == N_REQUESTS - AFFORDABLE
    assert spent_a <= budgeted.budget
    assert spent_a == pytest.approx(sum(float(r.headers["x-privlm-epsilon-spent"]) for r in ok), rel=1e-5)
    assert spent_a == pytest.approx(AFFORDABLE * budgeted.cost)
    # Each success saw its own total after it: the spends were serialised, none counted twice.
    left = sorted(float(r.headers["x-privlm-budget-remaining"]) for r in ok)
    assert left == pytest.approx(sorted(budgeted.budget - k * budgeted.cost for k in range(1, AFFORDABLE + 1)),
                                 rel=1e-5)
    remaining = budgeted.budget - spent_a
    for response, _ in refused:
        error = assert_openai_error(response, 429, code="budget_exhausted", param="epsilon budget")
        assert error["type"] == "insufficient_quota"
        assert "epsilon budget" in error["message"] and f"{remaining:.6g} left" in error["message"]
        assert float(response.headers["x-privlm-budget-remaining"]) == pytest.approx(remaining, rel=1e-5)
        assert response.headers["x-should-retry"] == "false"
    # The upstream received exactly the successful ones.
    assert sorted(b["user"] for b in stub.received("burst-")) == sorted(
        f"burst-{i}" for i, (response, _) in enumerate(answers) if response.status_code == 200)
    # Key B has its own budget.
    assert other.status_code == 200, other.text
    assert float(other.headers["x-privlm-budget-remaining"]) == pytest.approx(budgeted.budget - budgeted.cost,
                                                                              rel=1e-5)


def test_the_ledger_survives_a_restart(gateway_on_ledger, budgeted, stub: StubUpstream):
    """A new gateway on the same ledger file (after the test above): key A is still out, key B has spent once."""
    stub.clear()
    with gateway_on_ledger() as url:
        refused = post(url, KEY_A, "after-restart-a")
        allowed = post(url, KEY_B, "after-restart-b")
    assert_openai_error(refused, 429, code="budget_exhausted")
    assert allowed.status_code == 200, allowed.text
    assert float(allowed.headers["x-privlm-budget-remaining"]) == pytest.approx(budgeted.budget - 2 * budgeted.cost,
                                                                                rel=1e-5)
    assert [b["user"] for b in stub.received()] == ["after-restart-b"]
