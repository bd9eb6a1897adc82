"""Issue 22, note "A guardrail body without `request_data` gets a 400": every JSON object posted to the guardrail
is answered 200, BLOCKED when it is not a valid request, since LiteLLM set to fail open forwards the original
request on an error status. Since issue 37 (item 7), so is a body that is not a JSON object at all.

The bodies are LiteLLM's own (``litellm_body``, copied from its source in tests/chat/test_guardrail.py) with one
thing off each; the guardrail runs on a real server on localhost, without a model (nothing here gets as far as
perturbing).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from privlm.accounting import Ledger
from privlm.chat.service.audit import AuditLog
from privlm.chat.service.guardrail import GUARDRAIL_PATH
from privlm.mechanisms import PrivacyUnit
from tests.chat.test_guardrail import SECRET, assert_blocked, fake_privacy, litellm_body, post
from tests.service.localhost import serving
from tests.support.gateway import guardrail_app

Mutation = Callable[[dict[str, Any]], object]


@pytest.fixture(params=["no ledger", "ledger"])
def guardrail(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[httpx.Client]:
    """The guardrail without and with a ledger (the missing id is handled differently with one)."""
    ledger = Ledger(tmp_path / "l.sqlite", budgets={PrivacyUnit.EPSILON: 10.0}) if request.param == "ledger" else None
    with serving(guardrail_app(fake_privacy(ledger))) as url, httpx.Client(base_url=url, timeout=60) as http:
        yield http


@pytest.mark.parametrize("mutate", [
    lambda body: body.pop("request_data"),
    lambda body: body.update(request_data=None),
    lambda body: body.update(request_data="user-42"),
    lambda body: body.update(request_data=[{"user_api_key_hash": "a" * 64}]),
], ids=["missing", "null", "a string", "a list"])
def test_note_guardrail_a_body_without_request_data_is_blocked_not_a_4xx(guardrail, mutate: Mutation):
    body = litellm_body([SECRET])
    mutate(body)
    assert_blocked(post(guardrail, body), "request_data", "not LiteLLM's guardrail request")


@pytest.mark.parametrize(("mutate", "param"), [
    (lambda body: body.pop("input_type"), "input_type"),
    (lambda body: body.update(input_type="both"), "input_type"),
    (lambda body: body.update(texts=[1, 2]), "texts.0"),
    (lambda body: body.update(texts="one text"), "texts"),
    (lambda body: body.update(request_data={"user_api_key_hash": 7}), "request_data.user_api_key_hash"),
    (lambda body: body.update(images="AAAA"), "images"),
    (lambda body: body.update(additional_provider_specific_params=[6]), "additional_provider_specific_params"),
    (lambda body: body.clear(), "input_type"),
])
def test_note_guardrail_a_litellm_shaped_body_that_is_off_is_blocked_naming_the_field(guardrail, mutate: Mutation,
                                                                                      param: str):
    body = litellm_body([SECRET])
    mutate(body)
    response = post(guardrail, body)
    reason = assert_blocked(response, f"{param}: ")
    assert response.headers["x-privlm-request-id"].startswith("privlm-")
    assert "one text" not in reason and "AAAA" not in reason  # the fields are named, never their values


def test_note_guardrail_a_blocked_shape_is_audited_without_its_values(tmp_path):
    audit = AuditLog(tmp_path / "audit.jsonl")
    body = litellm_body([SECRET])
    del body["request_data"]
    with serving(guardrail_app(fake_privacy(), audit=audit)) as url, httpx.Client(base_url=url) as http:
        response = post(http, body)
    assert_blocked(response, "request_data")
    [record] = [json.loads(line) for line in (tmp_path / "audit.jsonl").read_text().splitlines()]
    assert record["event"] == "blocked" and record["request_id"] == response.headers["x-privlm-request-id"]
    assert SECRET not in json.dumps(record)


def test_a_body_that_is_not_a_json_object_is_blocked_too(guardrail):  # issue 37, item 7 (test_round3_guardrail.py)
    for content in (b"{not json", b"[1, 2]", b'"texts"', b"null", b"7"):
        response = guardrail.post(GUARDRAIL_PATH, content=content, headers={"Content-Type": "application/json"})
        assert_blocked(response, "nothing may be sent")
