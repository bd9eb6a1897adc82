"""The LiteLLM guardrail endpoint on a real uvicorn server, with requests shaped exactly as LiteLLM 1.108.7 sends
them (tests/support/litellm.py: its body, its headers, and what it does with each answer)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
import torch

from privlm.accounting import Ledger, joint_principal
from privlm.chat.service.audit import AuditLog
from privlm.chat.service.guardrail import (
    END_USER_PREFIX,
    GUARDRAIL_PATH,
    KEY_PREFIX,
)
from privlm.chat.service.privacy import PromptPrivacy
from privlm.mechanisms import PrivacyUnit
from tests.cape.conftest import PROMPT, B
from tests.service.localhost import serving, serving_guarded
from tests.support import litellm
from tests.support.chat import in_order
from tests.support.gateway import guardrail_app
from tests.support.litellm import END_USER, KEY_HASH
from tests.support.litellm import body as litellm_body

EPS = 6.0
OTHER_HASH = "f" * 64
SECRET = "my passport number is X93-771-SECRET"  # only ever in requests that must be blocked
STOPWORDS_IN_ORDER = ("My", " in", " the", " with her", " and", " as a", ".")  # Cape's non-sensitive tokens


def post(client: httpx.Client, body: object, **headers: str) -> httpx.Response:
    """As LiteLLM posts: its headers (``x-api-key="..."`` for its api_key setting), then ``headers``."""
    return client.post(GUARDRAIL_PATH, json=body, headers=litellm.headers() | headers)


def _broken(epsilon: float, generator: torch.Generator, ledger: Ledger | None, principal: str) -> Any:
    raise RuntimeError("the device model is gone")


def fake_privacy(ledger: Ledger | None = None, *, max_prompt_tokens: int = 8192, count_tokens: Any = None
                 ) -> PromptPrivacy:
    """A privacy step without a model whose perturber always fails: for every path that must block first."""
    return PromptPrivacy(_broken, mechanism="broken", epsilon=EPS, ledger=ledger, max_prompt_tokens=max_prompt_tokens,
                         count_tokens=count_tokens or (lambda text: len(text.split())))


@pytest.fixture(scope="module")
def privacy(smollm2_lm) -> PromptPrivacy:
    return PromptPrivacy.cape(smollm2_lm, epsilon=EPS, logit_bound=B)


@pytest.fixture(scope="module")
def client(privacy) -> Iterator[httpx.Client]:
    """The guardrail on the packaged SmolLM2, no ledger, no keys."""
    with serving(guardrail_app(privacy)) as url, httpx.Client(base_url=url, timeout=60) as http:
        yield http


@pytest.fixture
def fake_client() -> Iterator[httpx.Client]:
    with serving(guardrail_app(fake_privacy())) as url, httpx.Client(base_url=url, timeout=60) as http:
        yield http


def assert_blocked(response: httpx.Response, *needles: str) -> str:
    """A 200 BLOCKED with a reason naming ``needles``, no texts, and never the secret."""
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["action"] == "BLOCKED" and "texts" not in body, body
    reason = body["blocked_reason"]
    assert all(needle in reason for needle in needles), reason
    assert SECRET not in reason and PROMPT not in reason
    return str(reason)


# -- perturbation ---------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_a_chat_request_is_perturbed_in_place_keeping_stopwords(client):
    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": PROMPT},
                {"role": "assistant", "content": "Sure."},
                {"role": "user", "content": [{"type": "text", "text": "Also, my email is alice@example.com."}]}]
    body = litellm_body(messages=messages)
    assert len(body["texts"]) == 4

    response = post(client, body)

    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["action"] == "GUARDRAIL_INTERVENED"
    assert len(answer["texts"]) == len(body["texts"])  # LiteLLM maps them back by index
    released = answer["texts"][1]
    assert released != PROMPT and "Alice lives in Paris" not in released
    assert in_order(released, STOPWORDS_IN_ORDER), released
    assert "blocked_reason" not in answer and "images" not in answer  # LiteLLM keeps what is not returned
    assert response.headers["x-privlm-mechanism"] == "cape"
    assert float(response.headers["x-privlm-epsilon"]) == EPS
    assert float(response.headers["x-privlm-duration-ms"]) > 0  # the privacy step's own time
    assert float(response.headers["x-privlm-epsilon-spent"]) > 0
    assert int(response.headers["x-privlm-tokens-perturbed"]) > 0


@pytest.mark.slow
def test_blank_texts_keep_their_place_and_nothing_to_perturb_is_none(client):
    mixed = post(client, litellm_body(["", PROMPT, "   "])).json()
    assert mixed["action"] == "GUARDRAIL_INTERVENED"
    assert mixed["texts"][0] == "" and mixed["texts"][2] == "   " and mixed["texts"][1] != PROMPT

    for texts in ([], ["", "  "]):
        response = post(client, litellm_body(texts))
        assert response.status_code == 200 and response.json()["action"] == "NONE", response.text


@pytest.mark.slow
def test_a_request_may_lower_epsilon_through_the_provider_params(client):
    response = post(client, litellm_body([PROMPT], params={"epsilon": 2}))
    assert response.json()["action"] == "GUARDRAIL_INTERVENED"
    assert float(response.headers["x-privlm-epsilon"]) == 2.0


def test_epsilon_above_the_limit_or_invalid_is_blocked(fake_client):
    reason = assert_blocked(post(fake_client, litellm_body([SECRET], params={"epsilon": 60})),
                            "additional_provider_specific_params.epsilon", f"at most {EPS:g}")
    assert "never raise" in reason
    for bad in ("abc", -1, 0, True):
        assert_blocked(post(fake_client, litellm_body([SECRET], params={"epsilon": bad})), "epsilon")


def test_a_response_is_not_perturbed_nor_charged(tmp_path):
    ledger = Ledger(tmp_path / "l.sqlite", budgets={PrivacyUnit.EPSILON: 10.0})
    with serving(guardrail_app(fake_privacy(ledger))) as url, httpx.Client(base_url=url) as http:
        response = post(http, litellm_body([SECRET], input_type="response"))
    assert response.status_code == 200
    assert response.json() == {"action": "NONE"}  # no texts: LiteLLM keeps the model's answer as it is
    assert ledger.spent(KEY_PREFIX + KEY_HASH, PrivacyUnit.EPSILON) == 0.0


# -- budgets ---------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_a_key_budget_is_charged_to_its_hash_and_blocks_once_spent(smollm2_lm, privacy, tmp_path):
    cost = privacy.privatize([PROMPT], principal="probe").spent  # charged before drawing: the same every call
    budget = 1.5 * cost
    ledger = Ledger(tmp_path / "l.sqlite", budgets={PrivacyUnit.EPSILON: budget})
    charged = PromptPrivacy.cape(smollm2_lm, epsilon=EPS, logit_bound=B, ledger=ledger)
    app = guardrail_app(charged, guardrail_charge="key")
    with serving(app) as url, httpx.Client(base_url=url, timeout=60) as http:
        first = post(http, litellm_body([PROMPT]))
        assert first.json()["action"] == "GUARDRAIL_INTERVENED", first.text
        assert ledger.spent(KEY_PREFIX + KEY_HASH, PrivacyUnit.EPSILON) == pytest.approx(cost)
        assert float(first.headers["x-privlm-budget-remaining"]) == pytest.approx(budget - cost, rel=1e-5)

        second = post(http, litellm_body([PROMPT]))
        reason = assert_blocked(second, "budget exhausted", KEY_PREFIX + KEY_HASH, f"({budget - cost:.6g} left)")
        assert f"{budget:.6g}" in reason
        assert float(second.headers["x-privlm-budget-remaining"]) == pytest.approx(budget - cost, rel=1e-5)
        assert ledger.spent(KEY_PREFIX + KEY_HASH, PrivacyUnit.EPSILON) == pytest.approx(cost)  # nothing more

        other = post(http, litellm_body([PROMPT], request_data={"user_api_key_hash": OTHER_HASH}))
        assert other.json()["action"] == "GUARDRAIL_INTERVENED"  # another key, another budget
        assert ledger.spent(KEY_PREFIX + OTHER_HASH, PrivacyUnit.EPSILON) == pytest.approx(cost)


@pytest.mark.slow
def test_end_user_charging_charges_the_end_user_not_the_key(smollm2_lm, tmp_path):
    ledger = Ledger(tmp_path / "l.sqlite", budgets={PrivacyUnit.EPSILON: 1e6})
    charged = PromptPrivacy.cape(smollm2_lm, epsilon=EPS, logit_bound=B, ledger=ledger)
    app = guardrail_app(charged, guardrail_charge="end-user")
    with serving(app) as url, httpx.Client(base_url=url, timeout=60) as http:
        data = {"user_api_key_hash": KEY_HASH, "user_api_key_end_user_id": "customer-42"}
        response = post(http, litellm_body([PROMPT], request_data=data))
        assert response.json()["action"] == "GUARDRAIL_INTERVENED"
        spent = float(response.headers["x-privlm-epsilon-spent"])
        assert ledger.spent(END_USER_PREFIX + "customer-42", PrivacyUnit.EPSILON) == pytest.approx(spent, rel=1e-5)
        assert ledger.spent(KEY_PREFIX + KEY_HASH, PrivacyUnit.EPSILON) == 0.0

        assert_blocked(post(http, litellm_body([SECRET], request_data={"user_api_key_hash": KEY_HASH})),
                       "request_data.user_api_key_end_user_id is missing")


@pytest.mark.parametrize(("charge_to", "present", "named"), [
    ("key", {"user_api_key_end_user_id": END_USER}, "request_data.user_api_key_hash is missing"),
    ("key-and-end-user", {"user_api_key_end_user_id": END_USER}, "request_data.user_api_key_hash is missing"),
    ("key-and-end-user", {"user_api_key_hash": KEY_HASH}, "request_data.user_api_key_end_user_id is missing")])
def test_a_missing_id_is_blocked_when_there_is_a_ledger(tmp_path, charge_to, present, named):
    ledger = Ledger(tmp_path / "l.sqlite", budgets={PrivacyUnit.EPSILON: 10.0})
    app = guardrail_app(fake_privacy(ledger), guardrail_charge=charge_to)
    missing = next(iter({"user_api_key_hash", "user_api_key_end_user_id"} - set(present)))
    with serving(app) as url, httpx.Client(base_url=url) as http:
        for data in (present, present | {missing: None}, present | {missing: "  "}):
            assert_blocked(post(http, litellm_body([SECRET], request_data=data)), named, "shared budget")
        assert_blocked(post(http, litellm_body([SECRET], request_data={})), "shared budget")
    assert ledger.spent(KEY_PREFIX + KEY_HASH, PrivacyUnit.EPSILON) == 0.0


@pytest.mark.slow
def test_a_missing_id_goes_through_without_a_ledger(client):
    assert post(client, litellm_body([PROMPT], request_data={})).json()["action"] == "GUARDRAIL_INTERVENED"


# -- fail closed -----------------------------------------------------------------------------------------------

def test_images_are_blocked_by_default(fake_client):
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    body = litellm_body(messages=[{"role": "user", "content": [{"type": "text", "text": SECRET}, image]}])
    assert body["images"] == ["data:image/png;base64,AAAA"]
    assert_blocked(post(fake_client, body), "1 image(s)", "text only")


@pytest.mark.slow
def test_images_pass_unchanged_when_asked(privacy):
    messages = [{"role": "user", "content": [{"type": "text", "text": PROMPT},
                                             {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}]
    with (serving(guardrail_app(privacy, guardrail_images="pass")) as url,
          httpx.Client(base_url=url, timeout=60) as http):
        answer = post(http, litellm_body(messages=messages)).json()
    assert answer["action"] == "GUARDRAIL_INTERVENED" and answer["texts"][0] != PROMPT
    assert "images" not in answer  # LiteLLM then keeps the request's own images


def test_over_long_texts_are_blocked():
    with serving(guardrail_app(fake_privacy(max_prompt_tokens=5))) as url, httpx.Client(base_url=url) as http:
        assert_blocked(post(http, litellm_body(["one two three", SECRET])), "more than 5 tokens")


def test_a_failing_privacy_step_is_blocked(fake_client):
    reason = assert_blocked(post(fake_client, litellm_body(["hello", SECRET])), "privacy step failed (RuntimeError)")
    assert "the device model is gone" not in reason  # the failure's type only


def test_an_unexpected_error_is_blocked():
    broken = fake_privacy(count_tokens=lambda text: 1 // 0)
    with serving(guardrail_app(broken)) as url, httpx.Client(base_url=url) as http:
        assert_blocked(post(http, litellm_body([SECRET])), "ZeroDivisionError")


def test_texts_left_out_of_the_payload_are_blocked(fake_client):
    body = litellm_body([SECRET])
    del body["texts"]  # LiteLLM's exclude_payload_fields: [texts]
    assert_blocked(post(fake_client, body), "no `texts`")


class _FailingAudit(AuditLog):
    def write(self, event: str, record: Any) -> None:
        raise OSError("disk full")


@pytest.mark.slow
def test_a_release_that_cannot_be_audited_is_blocked(privacy, tmp_path):
    app = guardrail_app(privacy, audit=_FailingAudit(tmp_path / "a.jsonl"))
    with serving(app) as url, httpx.Client(base_url=url, timeout=60) as http:
        assert_blocked(post(http, litellm_body([PROMPT])), "audit log could not be written")


# -- the audit log and the ledger ------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("name", ["audit.jsonl", "audit.sqlite"])
def test_the_audit_log_and_the_ledger_never_hold_the_original(smollm2_lm, tmp_path, name):
    ledger = Ledger(tmp_path / "l.sqlite", budgets={PrivacyUnit.EPSILON: 1e6})
    audit = AuditLog(tmp_path / name)
    charged = PromptPrivacy.cape(smollm2_lm, epsilon=EPS, logit_bound=B, ledger=ledger)
    with serving(guardrail_app(charged, audit=audit)) as url, httpx.Client(base_url=url, timeout=60) as http:
        released = post(http, litellm_body([PROMPT, ""]))
        reasons = [post(http, litellm_body([SECRET], images=["data:image/png;base64,AAAA"])).json()["blocked_reason"],
                   post(http, litellm_body([SECRET], params={"epsilon": 99})).json()["blocked_reason"]]
        post(http, litellm_body([SECRET], input_type="response"))

    records = audit.records()
    assert [r["event"] for r in records] == ["released", "blocked", "blocked", "not_perturbed"]
    first = records[0]
    assert first["texts"] == released.json()["texts"]
    assert first["principal"] == joint_principal(KEY_PREFIX + KEY_HASH, END_USER_PREFIX + END_USER)  # the default
    assert first["epsilon_spent"] == pytest.approx(float(released.headers["x-privlm-epsilon-spent"]), rel=1e-5)
    assert first["tokens_perturbed"] > 0 and first["action"] == "GUARDRAIL_INTERVENED"
    assert [r["blocked_reason"] for r in records[1:3]] == reasons
    files = [path for path in tmp_path.iterdir() if path.is_file()]  # the ledger's -wal and -shm too
    assert any(path.name.startswith("l.sqlite") for path in files) and any(path.name == name for path in files)
    for path in files:
        data = path.read_bytes()
        for original in (PROMPT, SECRET, "Alice lives in Paris"):
            assert original.encode() not in data, (path.name, original)
    assert all(SECRET not in reason for reason in reasons)


# -- bodies that are not JSON objects (more: test_guardrail_blocked_shapes.py, test_round3_guardrail.py), and keys -

def test_a_body_that_is_not_a_request_is_blocked(fake_client):
    for content in (b"{not json", b"[1, 2]", b'"texts"'):
        response = fake_client.post(GUARDRAIL_PATH, content=content, headers={"Content-Type": "application/json"})
        assert_blocked(response, "nothing may be sent")


def test_with_keys_the_route_takes_a_bearer_key(tmp_path):
    app = guardrail_app(fake_privacy(), api_keys=["guard-key-1"])
    with serving(app) as url, httpx.Client(base_url=url) as http:
        body = litellm_body([SECRET], input_type="response")
        refused = post(http, body)
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
        assert post(http, body, Authorization="Bearer guard-key-1").json() == {"action": "NONE"}


def test_bad_options_are_refused():
    with pytest.raises(ValueError, match="--guardrail-charge"):
        guardrail_app(fake_privacy(), guardrail_charge="team")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="--guardrail-images"):
        guardrail_app(fake_privacy(), guardrail_images="drop")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="--guardrail-max-in-flight"):
        guardrail_app(fake_privacy(), guardrail_max_in_flight=0)


# -- the scaffolding's refusals: BLOCKED, never an error status a fail-open LiteLLM would forward past ------------

def held_privacy(entered: threading.Event, release: threading.Event) -> PromptPrivacy:
    """A privacy step that waits in its perturbation until ``release`` is set, then fails (so: BLOCKED)."""
    def held(epsilon: float, generator: torch.Generator, ledger: Ledger | None, principal: str) -> Any:
        entered.set()
        release.wait(30)
        raise RuntimeError("released")
    return PromptPrivacy(held, mechanism="held", epsilon=EPS, ledger=None, max_prompt_tokens=8192,
                         count_tokens=lambda text: len(text.split()))


def test_a_saturated_guardrail_answers_blocked_not_an_error_status():
    """What LiteLLM posts, while the guardrail is saturated (its one place held in its privacy step): 200 BLOCKED
    naming the limit, where the scaffolding answers other routes 503; and the held request is BLOCKED when its
    step fails. A missing key is still 401. (The service's own max_in_flight and per-caller quarter do not apply to
    the route: test_guardrail_litellm.py.)"""
    entered, release = threading.Event(), threading.Event()
    named = "guardrail_max_in_flight=1"
    app = guardrail_app(held_privacy(entered, release), api_keys=["litellm-key"], guardrail_max_in_flight=1)
    auth = {"x-api-key": "litellm-key"}  # where LiteLLM sends its api_key
    with serving_guarded(app) as url, httpx.Client(base_url=url, timeout=60) as http, ThreadPoolExecutor(1) as pool:
        held = pool.submit(post, http, litellm_body([SECRET]), **auth)
        assert entered.wait(30)
        assert_blocked(post(http, litellm_body([SECRET]), **auth), named)
        assert post(http, litellm_body([SECRET])).status_code == 401  # no key: refused before the limits
        release.set()
        assert_blocked(held.result(), "privacy step failed")
        assert_blocked(post(http, litellm_body([SECRET]), **auth), "privacy step failed")  # a place again


def test_over_the_connection_cap_the_guardrail_answers_blocked():
    """max_connections=1 and one idle connection held open: a guardrail request (with LiteLLM's x-api-key) is
    answered 200 BLOCKED naming the cap, where /health gets the 503 (which a fail-open LiteLLM forwards past)."""
    import socket
    import time

    app = guardrail_app(fake_privacy(), api_keys=["litellm-key"])
    with serving_guarded(app, max_connections=1, header_timeout=30) as url:
        host, port = url.removeprefix("http://").split(":")
        idle = socket.create_connection((host, int(port)), timeout=10)
        try:
            deadline = time.monotonic() + 30
            while httpx.get(f"{url}/health", timeout=10).status_code != 503:  # the idle one is counted
                assert time.monotonic() < deadline
            answer = httpx.post(f"{url}{GUARDRAIL_PATH}", json=litellm_body([SECRET]),
                                headers={"x-api-key": "litellm-key"}, timeout=10)
            assert_blocked(answer, "too many open connections")
            assert answer.headers["connection"] == "close"
        finally:
            idle.close()
