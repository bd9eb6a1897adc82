"""Issue 25, point 6, "LiteLLM, as the real proxy uses it": the guardrail as LiteLLM 1.108.7 calls it (its body, its
``x-api-key``, and what it does with each answer: tests/support/litellm.py), on real uvicorn servers.

- A burst from LiteLLM, one caller, queues for the device model instead of being refused, up to the route's own
  ``guardrail_max_in_flight``; beyond it, BLOCKED, which LiteLLM never forwards past, even set to fail open.
- Per-request epsilon reaches privlm as LiteLLM forwards it: the client's ``x-privlm-epsilon`` header in
  ``request_headers`` (with ``extra_headers``); its dynamic ``extra_body`` params never arrive.
- Budgets: by default the key *and* the end user are charged, together, and both must have budget left, so a key
  holder who names new end users mints no budget.
- The ``config.yaml`` of docs/litellm.md: complete, and what LiteLLM 1.108.7 needs (its own loader checks it too,
  where a LiteLLM venv is given: scripts/check_litellm.py).
"""

from __future__ import annotations

import os
import re
import subprocess
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from privlm.accounting import Ledger, joint_principal
from privlm.chat.service.audit import AuditLog
from privlm.chat.service.guardrail import (
    END_USER_PREFIX,
    GUARDRAIL_PATH,
    KEY_PREFIX,
)
from privlm.chat.service.privacy import PromptPrivacy
from privlm.mechanisms import PrivacyUnit, Spend
from privlm.models.perturbation import PerturbedPrompt
from tests.service.localhost import serving, serving_guarded
from tests.support import litellm
from tests.support.chat import EPS, FakePerturber, fake_privacy
from tests.support.gateway import guardrail_app
from tests.support.litellm import END_USER, KEY_HASH

ROOT = Path(__file__).parents[2]
KEY = "litellm-key"  # LiteLLM's api_key setting: it sends it as x-api-key
TEXT = "Alice lives in Paris"  # four words: FakePerturber charges EPS per word
COST = EPS * len(TEXT.split())


def post(client: httpx.Client, body: dict[str, Any], api_key: str | None = KEY) -> httpx.Response:
    return client.post(GUARDRAIL_PATH, json=body, headers=litellm.headers(api_key))


def action(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return str(response.json()["action"])


def reason(response: httpx.Response) -> str:
    assert action(response) == "BLOCKED", response.text
    return str(response.json()["blocked_reason"])


class Counting:
    """The app, counting the guardrail requests that reached the server (before any of its limits)."""

    def __init__(self, app: Any) -> None:
        self.app, self.arrived = app, 0

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] == GUARDRAIL_PATH:
            self.arrived += 1
        await self.app(scope, receive, send)


def gated_privacy(gate: threading.Event, entered: threading.Event) -> PromptPrivacy:
    """FakePerturber, whose perturbation waits for ``gate``: the first request holds the device model."""
    class Gated(FakePerturber):
        def perturb_batch(self, texts: Sequence[str]) -> list[PerturbedPrompt]:
            entered.set()
            assert gate.wait(60)
            return super().perturb_batch(texts)

    return fake_privacy(Gated)


# -- concurrency: a burst queues --------------------------------------------------------------------------------

def test_a_litellm_burst_queues_for_the_device_model_instead_of_being_refused():
    """The issue's trial: LiteLLM, one key, 12 requests at once. The service's own limits (max_in_flight=4: one
    place per key) would refuse 11 of them; the route's own places take them all, and they wait their turn."""
    gate, entered = threading.Event(), threading.Event()
    app = Counting(guardrail_app(gated_privacy(gate, entered), api_keys=[KEY], max_in_flight=4))
    burst = 12
    with serving_guarded(app) as url, httpx.Client(base_url=url, timeout=60) as http, \
            ThreadPoolExecutor(burst) as pool:
        first = pool.submit(post, http, litellm.body([TEXT]))
        assert entered.wait(30)  # the first holds the device model
        rest = [pool.submit(post, http, litellm.body([TEXT])) for _ in range(burst - 1)]
        deadline = time.monotonic() + 30
        while app.arrived < burst:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        time.sleep(0.3)  # a refusal would be answered by now: no body to read, nothing to wait for
        assert not any(future.done() for future in rest)  # all queued
        gate.set()
        answers = [first.result(), *(future.result() for future in rest)]
    assert [action(answer) for answer in answers] == ["GUARDRAIL_INTERVENED"] * burst
    for answer in answers:  # what LiteLLM forwards, even set to fail open: the perturbed texts
        assert litellm.outcome(answer, unreachable_fallback="fail_open") == "rewritten"
        assert TEXT not in answer.json()["texts"]


def test_beyond_its_own_places_a_burst_is_blocked_never_forwarded():
    """Two places, the first held: of three more requests at once, one queues and two are BLOCKED at once."""
    gate, entered = threading.Event(), threading.Event()
    app = guardrail_app(gated_privacy(gate, entered), api_keys=[KEY], guardrail_max_in_flight=2)
    with serving_guarded(app) as url, httpx.Client(base_url=url, timeout=60) as http, ThreadPoolExecutor(4) as pool:
        first = pool.submit(post, http, litellm.body([TEXT]))
        assert entered.wait(30)
        more = [pool.submit(post, http, litellm.body([TEXT])) for _ in range(3)]
        completed = as_completed(more, timeout=30)
        refused = [next(completed), next(completed)]  # answered while the gate is still closed
        assert not first.done() and sum(future.done() for future in more) == 2
        for answer in (future.result() for future in refused):
            assert "guardrail_max_in_flight=2" in reason(answer) and "nothing may be sent" in reason(answer)
            for fallback in ("fail_closed", "fail_open"):
                assert litellm.outcome(answer, unreachable_fallback=fallback) == "blocked"
        assert post(http, litellm.body([TEXT]), api_key=None).status_code == 401  # keys first, as before
        gate.set()
        [queued] = [future for future in more if future not in refused]
        assert action(first.result()) == action(queued.result()) == "GUARDRAIL_INTERVENED"


def test_the_services_other_routes_keep_their_own_places():
    """The guardrail's places are its own: a held guardrail request takes none of max_in_flight (here 1), so
    /health-style and other routes with a body still answer; and a guardrail burst is not limited by it."""
    gate, entered = threading.Event(), threading.Event()
    app = guardrail_app(gated_privacy(gate, entered), api_keys=[KEY], max_in_flight=1)
    with serving_guarded(app) as url, httpx.Client(base_url=url, timeout=60) as http, ThreadPoolExecutor(2) as pool:
        first = pool.submit(post, http, litellm.body([TEXT]))
        assert entered.wait(30)
        other = http.post("/metrics", content=b"{}", headers={"x-api-key": KEY})  # a body, on another route
        assert other.status_code == 405  # reached the app: not refused as busy (503)
        second = pool.submit(post, http, litellm.body([TEXT]))
        gate.set()
        assert action(first.result()) == action(second.result()) == "GUARDRAIL_INTERVENED"


def test_the_gateway_gives_the_guardrail_its_own_places_too(stub):
    """``privlm gateway --guardrail``: the same places of its own (``ChatSetup.guardrail_max_in_flight``)."""
    from privlm.chat.service.upstream import ChatUpstream
    from privlm.gateway import ChatSetup, create_privacy_gateway
    from privlm.settings.chat import ChatOptions

    gate, entered = threading.Event(), threading.Event()
    setup = ChatSetup(privacy=gated_privacy(gate, entered), upstream=ChatUpstream(stub.url),
                      options=ChatOptions(guardrail=True, guardrail_max_in_flight=1))
    app = create_privacy_gateway(chat=setup, api_keys=[KEY], max_in_flight=1)
    with serving_guarded(app) as url, httpx.Client(base_url=url, timeout=60) as http, ThreadPoolExecutor(1) as pool:
        first = pool.submit(post, http, litellm.body([TEXT]))
        assert entered.wait(30)
        assert "guardrail_max_in_flight=1" in reason(post(http, litellm.body([TEXT])))
        other = http.post("/v1/chat/completions", content=b"{}", headers={"x-api-key": KEY})
        assert other.status_code == 400  # the chat route's place is free: it read the body and refused it
        gate.set()
        assert action(first.result()) == "GUARDRAIL_INTERVENED"


# -- per-request epsilon -----------------------------------------------------------------------------------------

@pytest.fixture
def working() -> Any:
    with serving(guardrail_app(fake_privacy())) as url, httpx.Client(base_url=url, timeout=60) as http:
        yield http


@pytest.mark.parametrize(("config", "header", "applied"), [(None, "2", 2.0), (4, "2", 2.0), (2, "4", 2.0),
                                                           (4, None, 4.0), (None, None, EPS)])
def test_the_clients_epsilon_header_lowers_epsilon_with_the_configs(working, config, header, applied):
    params = {} if config is None else {"epsilon": config}
    forwarded = {} if header is None else {"x-privlm-epsilon": header}  # as extra_headers forwards it
    answer = post(working, litellm.body([TEXT], params=params, client_headers=forwarded), api_key=None)
    assert action(answer) == "GUARDRAIL_INTERVENED"
    assert float(answer.headers["x-privlm-epsilon"]) == applied


def test_an_epsilon_header_litellm_did_not_forward_or_above_the_limit_is_blocked(working):
    hidden = post(working, litellm.body([TEXT], client_headers={"x-privlm-epsilon": litellm.PRESENT}), api_key=None)
    assert "extra_headers" in reason(hidden)  # the client asked for an epsilon it would not get
    assert "never raise" in reason(post(working, litellm.body([TEXT], client_headers={"X-Privlm-Epsilon": "60"}),
                                        api_key=None))
    for bad in ("abc", "0", "-1", "nan", "inf"):
        assert "x-privlm-epsilon" in reason(post(working, litellm.body([TEXT], client_headers={
            "x-privlm-epsilon": bad}), api_key=None))


# -- budgets: the key and the end user together -----------------------------------------------------------------

def budgeted(tmp_path: Path, budget: float, **options: Any) -> tuple[Ledger, Any]:
    ledger = Ledger(tmp_path / "l.sqlite", budgets={PrivacyUnit.EPSILON: budget})
    return ledger, guardrail_app(fake_privacy(ledger=ledger), **options)


def data(key: str = KEY_HASH, user: str | None = END_USER) -> dict[str, str]:
    return {"user_api_key_hash": key} | ({} if user is None else {"user_api_key_end_user_id": user})


def spent(ledger: Ledger, principal: str) -> float:
    return ledger.spent(principal, PrivacyUnit.EPSILON)


def test_by_default_the_key_and_the_end_user_are_charged_together(tmp_path):
    ledger, app = budgeted(tmp_path, 3 * COST)
    key, user, other = KEY_PREFIX + KEY_HASH, END_USER_PREFIX + END_USER, END_USER_PREFIX + "customer-7"
    with serving(app) as url, httpx.Client(base_url=url, timeout=60) as http:
        first = post(http, litellm.body([TEXT], request_data=data()), api_key=None)
        assert action(first) == "GUARDRAIL_INTERVENED"
        assert spent(ledger, key) == spent(ledger, user) == COST  # one release, charged to both

        ledger.spend(user, Spend(PrivacyUnit.EPSILON, COST))  # the same end user through another key
        second = post(http, litellm.body([TEXT], request_data=data()), api_key=None)
        assert float(second.headers["x-privlm-budget-remaining"]) == pytest.approx(0.0)  # the smaller: the user's
        assert (spent(ledger, key), spent(ledger, user)) == (2 * COST, 3 * COST)

        refused = post(http, litellm.body([TEXT], request_data=data()), api_key=None)
        assert user in reason(refused) and "budget exhausted" in reason(refused)  # the user has none left
        assert spent(ledger, key) == 2 * COST  # nor was the key charged

        assert action(post(http, litellm.body([TEXT], request_data=data(user="customer-7")), api_key=None)
                      ) == "GUARDRAIL_INTERVENED"
        minted = post(http, litellm.body([TEXT], request_data=data(user="customer-8")), api_key=None)
        assert key in reason(minted)  # a new end user has budget, but the key has none left
        assert spent(ledger, other) == COST and spent(ledger, END_USER_PREFIX + "customer-8") == 0.0


def test_end_user_charging_alone_lets_a_key_holder_mint_budgets(tmp_path):
    """Why it is not the default: with ``charge_to="end-user"``, each new ``user`` a client names has a fresh
    budget, so one key releases far past any one budget."""
    ledger, app = budgeted(tmp_path, COST, guardrail_charge="end-user")
    with serving(app) as url, httpx.Client(base_url=url, timeout=60) as http:
        for n in range(3):
            assert action(post(http, litellm.body([TEXT], request_data=data(user=f"fresh-{n}")), api_key=None)
                          ) == "GUARDRAIL_INTERVENED"
    assert sum(spent(ledger, END_USER_PREFIX + f"fresh-{n}") for n in range(3)) == 3 * COST  # three budgets' worth


def test_a_joint_audit_record_names_both(tmp_path):
    audit = AuditLog(tmp_path / "a.jsonl")
    ledger = Ledger(tmp_path / "l.sqlite", budgets={PrivacyUnit.EPSILON: 10 * COST})
    with serving(guardrail_app(fake_privacy(ledger=ledger), audit=audit)) as url, \
            httpx.Client(base_url=url, timeout=60) as http:
        post(http, litellm.body([TEXT]), api_key=None)
    [record] = audit.records()
    assert record["principal"] == joint_principal(KEY_PREFIX + KEY_HASH, END_USER_PREFIX + END_USER)


# -- the documented config.yaml ---------------------------------------------------------------------------------

# Each a field of LiteLLM 1.108.7's guardrail LitellmParams (litellm/types/guardrails.py), which takes unknown ones too.
GUARDRAIL_PARAMS = frozenset({
    "guardrail", "mode", "default_on", "api_base", "api_key", "unreachable_fallback", "fail_on_error",
    "extra_headers", "additional_provider_specific_params", "skip_system_message_in_guardrail", "timeout"})


def documented_config() -> dict[str, Any]:
    text = (ROOT / "docs" / "litellm.md").read_text()
    section = text[text.index("## LiteLLM's `config.yaml`"):]
    return dict(yaml.safe_load(re.search(r"```yaml\n(.*?)```", section, re.S).group(1)))  # type: ignore[union-attr]


def test_the_documented_config_is_complete():
    """What LiteLLM 1.108.7 needs to start and to call privlm safely. It refuses to start without a master key
    (``UnsafeMasterKeyError``); it serves only the models of ``model_list``; it resolves every ``os.environ/``
    value, an unset one to None (a ``headers`` entry then makes every request a 500, hence ``api_key``); and it
    drops a guardrail whose config it cannot read, starting without it."""
    config = documented_config()
    assert config["general_settings"]["master_key"].startswith("os.environ/")
    assert config["model_list"] and all(entry["model_name"] and entry["litellm_params"]["model"]
                                        for entry in config["model_list"])
    [guardrail] = config["guardrails"]
    params = guardrail["litellm_params"]
    assert set(params) <= GUARDRAIL_PARAMS and "headers" not in params
    assert params["guardrail"] == "generic_guardrail_api" and params["mode"] == "pre_call"
    assert params["default_on"] is True
    assert params.get("unreachable_fallback", "fail_closed") == "fail_closed" and params.get("fail_on_error", True)
    assert params["api_key"].startswith("os.environ/") and "x-privlm-epsilon" in params["extra_headers"]
    assert "timeout" not in params  # LiteLLM's 600 s: a shorter one times out queued requests
    assert httpx.URL(params["api_base"]).host == "127.0.0.1"


def test_the_documented_config_calls_privlm_as_the_tests_do(tmp_path):
    """The config's guardrail settings, as LiteLLM turns them into a request, reach a keyed privlm: its api_key as
    x-api-key, its epsilon as the provider param, the client's header through extra_headers."""
    params = documented_config()["guardrails"][0]["litellm_params"]
    config_epsilon = params["additional_provider_specific_params"]["epsilon"]
    app = guardrail_app(fake_privacy(), api_keys=[KEY])
    with serving(app) as url, httpx.Client(base_url=url, timeout=60) as http:
        body = litellm.body([TEXT], params=params["additional_provider_specific_params"])
        assert float(post(http, body).headers["x-privlm-epsilon"]) == config_epsilon
        lower = litellm.body([TEXT], params=params["additional_provider_specific_params"],
                             client_headers={name: "1" for name in params["extra_headers"]})
        assert float(post(http, lower).headers["x-privlm-epsilon"]) == 1.0
        assert post(http, body, api_key=None).status_code == 401  # the variable unset: no key sent, refused


LITELLM_PYTHON = os.environ.get("PRIVLM_LITELLM_PYTHON")  # a python with litellm==1.108.7 (not privlm's venv)


@pytest.mark.slow
@pytest.mark.skipif(LITELLM_PYTHON is None, reason="PRIVLM_LITELLM_PYTHON names no python with litellm==1.108.7")
def test_litellm_itself_agrees():
    """LiteLLM's own code: it loads the documented config, posts what tests/support/litellm.py says, and treats
    every kind of answer as ``litellm.outcome`` says (scripts/check_litellm.py)."""
    run = subprocess.run([str(LITELLM_PYTHON), str(ROOT / "scripts" / "check_litellm.py")], capture_output=True,
                         text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
