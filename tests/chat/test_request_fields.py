"""What a chat request may carry through the gateway (issue 22: finding 1, finding 5, and the notes on
``stream: "yes"``, a 5 MB ``model`` and words that survive perturbation).

- Finding 1: a perturbed message's ``name`` never crosses in the clear (dropped and reported by default,
  perturbed and charged, or refused), and any key of a perturbed message or text part that the gateway does not
  handle on purpose is refused by name, never forwarded.
- Finding 5: with both the ``x-privlm-epsilon`` header and the body's ``privlm.epsilon``, the smaller one applies.
- Notes: ``stream``, the integers privlm reads, ``temperature`` and ``top_p`` are strict JSON types; ``model``
  is a short non-empty string; the report counts the perturbed tokens that were released unchanged.

A mechanism without a model (``FakePerturber``) does the perturbing: the mechanism is not the point here.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from privlm.chat.service.audit import AuditLog
from privlm.chat.service.messages import perturbed_fields
from privlm.chat.wire import ChatCompletionRequest
from privlm.models.perturbation import PerturbedPrompt, PromptReport, TokenOutcome, TokenRecord
from privlm.settings.chat import ChatOptions
from tests.support.chat import (
    EPS,
    TIMEOUT,
    WORDS,
    FakePerturber,
    StubUpstream,
    assert_openai_error,
    chat_body,
    chat_gateway,
    fake_privacy,
)

NAME = "Maria_Gonzalez"
SECRET = "Seattle-diabetes-secret"
OPENAI_NAME = re.compile(r"^[^\s<|\\/>]+$")  # what OpenAI accepts as a message name


@contextmanager
def gateway(stub: StubUpstream, *, privacy: Any = None, audit: AuditLog | None = None,
            **options: Any) -> Iterator[str]:
    """A gateway with the fake mechanism (or ``privacy``) and ``ChatOptions(**options)``, the stub upstream."""
    with chat_gateway(privacy or fake_privacy(), stub.url, options=ChatOptions(**options), audit=audit) as url:
        stub.clear()
        yield url


def post(url: str, body: dict[str, Any], **headers: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=TIMEOUT)


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)


# -- finding 1: a message's name, and keys nothing handles ----------------------------------------------------

def test_finding_1_a_user_name_is_dropped_before_forwarding_and_reported(stub, tmp_path: Path):
    audit = AuditLog(tmp_path / "audit.jsonl")
    tool_call = {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}
    messages: list[Any] = [
        {"role": "system", "content": "Be brief.", "name": "ops_team"},  # not perturbed: forwarded as sent
        {"role": "user", "name": NAME, "cache_control": {"type": "ephemeral"},
         "content": [{"type": "text", "text": "hello from me", "cache_control": {"type": "ephemeral"}}]},
        {"role": "assistant", "name": "helper", "content": None, "tool_calls": [tool_call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "found"}]
    with gateway(stub, audit=audit) as url:
        raw = client(url).chat.completions.with_raw_response.create(
            model="stub-model", messages=messages, extra_body={"privlm": {"report": True}})
        [received] = stub.received()
    assert NAME not in json.dumps(received)
    system, user, assistant, tool = received["messages"]
    assert "name" not in user and user["cache_control"] == {"type": "ephemeral"}
    [part] = user["content"]
    assert part["cache_control"] == {"type": "ephemeral"} and part["text"] != "hello from me"
    assert [system, assistant, tool] == [messages[0], messages[2], messages[3]]
    assert raw.headers["x-privlm-fields-dropped"] == "messages.1.name"
    assert raw.http_response.json()["privlm"]["dropped"] == ["messages.1.name"]
    [released] = [record for record in audit.records() if record["event"] == "released"]
    assert released["dropped"] == ["messages.1.name"] and NAME not in json.dumps(released)


def test_finding_1_a_name_is_perturbed_and_charged_when_the_gateway_is_told_to(stub):
    body = {"model": "stub-model", "privlm": {"report": True},
            "messages": [{"role": "user", "content": "hello there", "name": "Maria Gonzalez"}]}
    with gateway(stub, message_names="perturb") as url:
        response = post(url, body)
        [received] = stub.received()
    assert response.status_code == 200, response.text
    name = received["messages"][0]["name"]
    assert OPENAI_NAME.match(name) and set(name.split("_")) <= set(WORDS)  # perturbed, then made a valid name
    assert "x-privlm-fields-dropped" not in response.headers
    report = response.json()["privlm"]
    assert [(t["field"], t["sent"]) for t in report["texts"]] == [("name", name),
                                                                  ("content", received["messages"][0]["content"])]
    assert float(response.headers["x-privlm-epsilon-spent"]) == pytest.approx(EPS * 4)  # 2 words of name, 2 of text


@pytest.mark.parametrize("stream", [False, True])
def test_finding_1_a_name_is_refused_when_the_gateway_is_told_to(stub, stream):
    body = chat_body("hello", stream=stream)
    body["messages"][0]["name"] = NAME
    with gateway(stub, message_names="refuse") as url:
        response = post(url, body)
        assert_openai_error(response, 400, code="unsupported_field", param="messages.0.name")
        assert stub.received() == []


@pytest.mark.parametrize(("message", "param"), [
    ({"role": "user", "content": "hello", "foo": SECRET}, "messages.0.foo"),
    ({"role": "user", "content": [{"type": "text", "text": "hi", "note": SECRET}]}, "messages.0.content.0.note"),
    ({"role": "developer", "content": "hello", "x_meta": SECRET}, "messages.0.x_meta"),  # perturbed: see options
])
def test_finding_1_an_unknown_key_of_a_perturbed_message_is_refused_by_name(stub, message, param):
    with gateway(stub, perturb_system=True) as url:
        response = post(url, {"model": "stub-model", "messages": [message]})
        error = assert_openai_error(response, 400, code="unsupported_field", param=param)
        assert SECRET not in error["message"]
        assert stub.received() == []


@pytest.mark.parametrize("message_names", ["drop", "perturb"])
def test_finding_1_one_pass_decides_every_name_either_perturbed_or_dropped(message_names):
    request = ChatCompletionRequest.model_validate({"model": "m", "messages": [
        {"role": "system", "content": "Be brief.", "name": "ops"},  # not perturbed: neither
        {"role": "user", "content": "hi", "name": NAME}, {"role": "assistant", "content": "hello", "name": "bot"},
        {"role": "user", "content": [{"type": "text", "text": "and you"}], "name": "Bob"}]})
    fields = perturbed_fields(request, perturb_assistant=True, message_names=message_names)
    names = [slot.path for slot in fields.slots if slot.field == "name"]
    assert sorted(names + fields.dropped) == ["messages.1.name", "messages.2.name", "messages.3.name"]
    assert (names if message_names == "drop" else fields.dropped) == []
    assert fields.texts == [*([NAME] if message_names == "perturb" else []), "hi",
                            *(["bot"] if message_names == "perturb" else []), "hello",
                            *(["Bob"] if message_names == "perturb" else []), "and you"]


# -- finding 5: header and body epsilon -----------------------------------------------------------------------

def test_finding_5_the_smaller_of_header_and_body_epsilon_applies(stub):
    with gateway(stub) as url:
        for header, body, applied in [("1", 6, 1.0), ("6", 2, 2.0), ("3", None, 3.0)]:
            fields = {} if body is None else {"privlm": {"epsilon": body}}
            response = post(url, chat_body("one two three", **fields), **{"x-privlm-epsilon": header})
            assert response.status_code == 200, response.text
            assert float(response.headers["x-privlm-epsilon"]) == applied, (header, body)
            assert float(response.headers["x-privlm-epsilon-spent"]) == pytest.approx(3 * applied)


@pytest.mark.parametrize(("header", "code"), [("abc", "invalid_epsilon"), ("7", "epsilon_above_limit"),
                                              ("nan", "invalid_epsilon")])
def test_finding_5_a_bad_header_epsilon_is_refused_even_beside_a_body_epsilon(stub, header, code):
    with gateway(stub) as url:
        response = post(url, chat_body("hello", privlm={"epsilon": 2}), **{"x-privlm-epsilon": header})
        assert_openai_error(response, 400, code=code, param="x-privlm-epsilon")
        assert stub.received() == []


# -- notes: strict types, and the model's name ----------------------------------------------------------------

@pytest.mark.parametrize(("field", "value"), [("stream", "yes"), ("stream", "true"), ("stream", 1), ("stream", 0),
                                              ("max_tokens", True), ("n", "2"), ("seed", "7")])
def test_note_stream_and_the_integers_privlm_reads_take_only_their_json_type(stub, field, value):
    with gateway(stub) as url:
        response = post(url, chat_body("hello", **{field: value}))
        assert_openai_error(response, 400, code="invalid_request", param=field)
        assert stub.received() == []


@pytest.mark.parametrize(("field", "value"), [("temperature", True), ("temperature", "0.5"), ("top_p", True),
                                              ("top_p", "0.5"), ("temperature", False)])
def test_note_temperature_and_top_p_take_only_a_json_number(stub, field, value):
    with gateway(stub) as url:
        response = post(url, chat_body("hello", **{field: value}))
        assert_openai_error(response, 400, code="invalid_request", param=field)
        assert stub.received() == []


def test_note_temperature_and_top_p_take_a_json_int_or_float(stub):
    with gateway(stub) as url:
        for fields in ({"temperature": 0, "top_p": 1}, {"temperature": 0.7, "top_p": 0.5}):
            response = post(url, chat_body("hello", **fields))
            assert response.status_code == 200, response.text
            [received] = stub.received()
            assert {key: received[key] for key in fields} == fields
            stub.clear()


@pytest.mark.parametrize("model", ["", "m" * 257, "m" * (3 * 2**20)], ids=["empty", "257-chars", "3-MiB"])
def test_note_a_model_name_must_be_a_short_non_empty_string(stub, model):
    with gateway(stub) as url:
        response = post(url, chat_body("hello", model=model))
        error = assert_openai_error(response, 400, code="invalid_request", param="model")
        assert len(error["message"]) < 300  # the name is not echoed
        assert stub.received() == []


# -- note: words survive; the report says how many ------------------------------------------------------------

KEPT = frozenset({"Seattle", "diabetes"})  # what the test mechanism releases as itself
STOPWORDS = frozenset({"and", "the", "in"})


class KeepingPerturber(FakePerturber):
    """Every word perturbed but the stopwords; the words of ``KEPT`` released as themselves, others as "apple"
    (nothing charged: the gateway here has no ledger)."""

    name = "keeping"

    def perturb_batch(self, texts: Sequence[str]) -> list[PerturbedPrompt]:
        return [self._one(text) for text in texts]

    def _one(self, text: str) -> PerturbedPrompt:
        records = []
        for i, word in enumerate(text.split()):
            stop, kept = word in STOPWORDS, word in KEPT
            released = word if stop or kept else "apple"
            records.append(TokenRecord(position=i, original=word, original_id=i, released=released,
                                       released_id=i if released == word else -1,
                                       outcome=TokenOutcome.NON_SENSITIVE if stop else TokenOutcome.PERTURBED,
                                       epsilon=None if stop else self.epsilon))
        perturbed = sum(1 for r in records if r.outcome is TokenOutcome.PERTURBED)
        report = PromptReport(mechanism="keeping", tokens=tuple(records), candidate_set_size=2,
                              accounting={"privlm": self.epsilon * perturbed}, guarantee="a test mechanism")
        return PerturbedPrompt(text=" ".join(r.released for r in records), report=report)


def test_note_the_report_counts_the_sensitive_tokens_released_unchanged(stub, tmp_path: Path):
    audit = AuditLog(tmp_path / "audit.jsonl")
    body = chat_body("Seattle and the diabetes clinic", "Maria lives in Seattle", privlm={"report": True})
    with gateway(stub, privacy=fake_privacy(KeepingPerturber), audit=audit) as url:
        response = post(url, body)
    assert response.status_code == 200, response.text
    assert response.headers["x-privlm-tokens-perturbed"] == "6"
    assert response.headers["x-privlm-tokens-unchanged"] == "3"  # Seattle, diabetes; Seattle
    report = response.json()["privlm"]
    assert report["tokens_unchanged"] == 3 and [t["tokens_unchanged"] for t in report["texts"]] == [2, 1]
    duration = float(response.headers["x-privlm-duration-ms"])  # the privacy step's own time, in the body too
    assert duration > 0 and report["duration_ms"] == round(duration, 1)
    [released] = [record for record in audit.records() if record["event"] == "released"]
    assert released["tokens_unchanged"] == 3
