"""What the gateway perturbs in a chat request, and what it forwards exactly as sent (Cape on SmolLM2, the stub).

Perturbed: the text of ``user`` messages (string content, and each text part), ``system`` and ``developer`` only
with ``perturb_system``. Forwarded unchanged: ``assistant`` messages and their ``tool_calls`` arguments, ``tool``
and ``function`` messages, ``tools`` and every other field, known or not. privlm's own ``privlm`` field is never
forwarded. Non-text parts of a perturbed message are refused (400 naming the part) unless passed on purpose.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from privlm.settings.chat import ChatOptions
from tests.support.chat import TIMEOUT, StubUpstream, assert_openai_error, chat_gateway, in_order

pytestmark = pytest.mark.slow

PROMPT = "My friend Alice lives in Paris near the river with her cat Tom and works as a nurse."
STOPWORDS_IN_ORDER = ("My", " in", " the", " with her", " and", " as a", ".")  # Cape's non-sensitive tokens
PART_1 = "Alice Smith was diagnosed with diabetes in Boston."
PART_2 = "Her brother Robert works at the Lisbon harbour."
SYSTEM = "You are the assistant of Doctor Jonathan Whitfield at Riverside Clinic."
DEVELOPER = "Answer the patient Margaret Olsen in Spanish."
ARGUMENTS = json.dumps({"name": "Alice Smith", "city": "Boston", "dob": "1970-03-14"})
IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo=", "detail": "low"}}


def request_body() -> dict[str, Any]:
    """Every kind of message and field OpenAI's chat API takes, with privlm's own field and unknown ones."""
    return {
        "model": "stub-model",
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "developer", "content": DEVELOPER},
            {"role": "user", "content": PROMPT, "name": "alice"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "lookup_patient", "arguments": ARGUMENTS}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "Alice Smith, born 1970-03-14, Boston, diabetes"},
            {"role": "assistant", "content": [{"type": "text", "text": "Alice Smith lives in Boston."},
                                              {"type": "refusal", "refusal": "I cannot share Alice's records."}]},
            {"role": "user", "content": [{"type": "text", "text": PART_1},
                                         {"type": "text", "text": PART_2, "cache_control": {"type": "ephemeral"}}]},
            {"role": "function", "name": "lookup", "content": "Robert, Lisbon harbour"},
            {"role": "user", "content": "   "},
        ],
        "tools": [{"type": "function", "function": {"name": "lookup_patient", "description": "Find a patient",
                                                    "parameters": {"type": "object", "properties": {
                                                        "name": {"type": "string"}}}}}],
        "tool_choice": "auto",
        "response_format": {"type": "json_object"},
        "temperature": 0.3,
        "max_tokens": 17,
        "user": "end-user-7",
        "metadata": {"ticket": "T-1"},
        "x_unknown_field": {"nested": [1, 2.5, {"a": None}], "flag": True},
        "privlm": {"report": True},
    }


@pytest.fixture(scope="module")
def gateways(cape_privacy, stub) -> Iterator[dict[str, str]]:
    with (chat_gateway(cape_privacy, stub.url) as default,
          chat_gateway(cape_privacy, stub.url, options=ChatOptions(perturb_system=True)) as system,
          chat_gateway(cape_privacy, stub.url, options=ChatOptions(non_text_parts="pass")) as passing,
          chat_gateway(cape_privacy, stub.url, options=ChatOptions(perturb_tool_results=True)) as tools):
        yield {"default": default, "system": system, "pass": passing, "tools": tools}


def forward(url: str, stub: StubUpstream, body: dict[str, Any]) -> tuple[httpx.Response, dict[str, Any]]:
    """Send ``body``; the response and the one body the upstream received."""
    stub.clear()
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=TIMEOUT)
    assert response.status_code == 200, response.text
    [received] = stub.received()
    return response, received


def test_only_user_text_is_perturbed_and_everything_else_is_forwarded_as_sent(gateways, stub):
    sent = request_body()
    response, received = forward(gateways["default"], stub, copy.deepcopy(sent))
    assert "privlm" not in received
    assert {k: v for k, v in received.items() if k != "messages"} == {
        k: v for k, v in sent.items() if k not in ("messages", "privlm")}  # tools, unknown fields...
    before, after = sent["messages"], received["messages"]
    assert len(after) == len(before)
    for i in (0, 1, 3, 4, 5, 7, 8):  # system, developer, assistant, tool, function; a blank user text
        assert after[i] == before[i], i
    assert after[3]["tool_calls"][0]["function"]["arguments"] == ARGUMENTS
    # user: the string content and each text part perturbed; a cache marker kept; the name dropped (reported)
    assert after[2]["content"] != PROMPT and "name" not in after[2]
    assert in_order(after[2]["content"], STOPWORDS_IN_ORDER)  # stopwords and punctuation sent unchanged
    parts = after[6]["content"]
    assert [p["type"] for p in parts] == ["text", "text"] and parts[1]["cache_control"] == {"type": "ephemeral"}
    assert parts[0]["text"] != PART_1 and parts[1]["text"] != PART_2
    report = response.json()["privlm"]
    slots = [(t["message"], t["part"], t["role"]) for t in report["texts"]]
    assert slots == [(2, None, "user"), (6, 0, "user"), (6, 1, "user"), (8, None, "user")]
    assert [t["sent"] for t in report["texts"]] == [after[2]["content"], parts[0]["text"], parts[1]["text"], "   "]
    assert report["texts"][3]["epsilon_spent"] == 0  # a blank text costs nothing
    assert report["dropped"] == ["messages.2.name"]


def test_tool_results_and_arguments_are_perturbed_json_aware_when_asked(gateways, stub):
    """--perturb-tool-results: the tool and function results (not JSON: as text) and the tool call's arguments
    (JSON: each string value, keys and structure kept) perturbed and charged like user text; the function's name,
    the call's id and the assistant's own text forwarded as sent."""
    sent = request_body()
    response, received = forward(gateways["tools"], stub, copy.deepcopy(sent))
    before, after = sent["messages"], received["messages"]
    arguments = json.loads(after[3]["tool_calls"][0]["function"]["arguments"])
    assert set(arguments) == {"name", "city", "dob"} and arguments["name"] != "Alice Smith"
    assert after[3]["tool_calls"][0]["id"] == "call_1" and after[3]["tool_calls"][0]["function"]["name"] == \
        "lookup_patient"
    assert after[4]["content"] != before[4]["content"] and after[4]["tool_call_id"] == "call_1"
    assert after[7]["content"] != before[7]["content"] and after[7]["name"] == "lookup"
    assert after[5] == before[5]  # the assistant's text: the upstream's own output
    texts = {t["path"]: t for t in response.json()["privlm"]["texts"]}
    arguments_at = "messages.3.tool_calls.0.function.arguments#/"
    tool_paths = [f"{arguments_at}name", f"{arguments_at}city", f"{arguments_at}dob", "messages.4.content",
                  "messages.7.content"]
    assert set(tool_paths) <= set(texts)
    assert all(texts[path]["epsilon_spent"] > 0 for path in tool_paths)  # charged like user text
    assert texts["messages.3.tool_calls.0.function.arguments#/name"]["sent"] == arguments["name"]


def test_system_and_developer_are_perturbed_when_asked(gateways, stub):
    sent = request_body()
    response, received = forward(gateways["system"], stub, copy.deepcopy(sent))
    after = received["messages"]
    assert after[0]["content"] != SYSTEM and after[1]["content"] != DEVELOPER
    assert after[2]["content"] != PROMPT
    for i in (3, 4, 5, 7):
        assert after[i] == sent["messages"][i]
    roles = [t["role"] for t in response.json()["privlm"]["texts"]]
    assert roles == ["system", "developer", "user", "user", "user", "user"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_non_text_part_of_a_user_message_is_refused_by_name(gateways, stub, stream):
    stub.clear()
    body = {"model": "stub-model", "stream": stream, "messages": [
        {"role": "system", "content": [IMAGE]},  # not perturbed here: not refused either
        {"role": "user", "content": [{"type": "text", "text": PART_1}, IMAGE]}]}
    response = httpx.post(f"{gateways['default']}/v1/chat/completions", json=body, timeout=TIMEOUT)
    error = assert_openai_error(response, 400, code="unsupported_content", param="messages.1.content.1")
    assert "image_url" in error["message"]
    assert stub.received() == []  # nothing left


def test_non_text_parts_pass_unchanged_when_the_gateway_is_told_to(gateways, stub):
    body = {"model": "stub-model", "messages": [{"role": "user", "content": [{"type": "text", "text": PART_1}, IMAGE]}]}
    _, received = forward(gateways["pass"], stub, body)
    text, image = received["messages"][0]["content"]
    assert image == IMAGE
    assert text["type"] == "text" and text["text"] != PART_1


def test_a_json_tool_result_keeps_its_keys_numbers_and_structure():
    """The non-blank string values of a JSON object or array are its texts (JSON-pointer paths, keys escaped);
    written back, the document keeps everything else. Anything else is one text: not JSON, a bare scalar (a
    phone number), duplicate keys (only the last would be seen), a non-finite number."""
    from privlm.chat.service.messages import perturbed_fields, with_texts
    from privlm.chat.wire import ChatCompletionRequest

    document = {"patient": {"name": "Maria Gonzalez", "age": 34, "tags": ["asthma", "x/y", " "]}, "a/b~c": "Seattle",
                "ok": True, "none": None}
    as_text = ["Maria's record: {asthma", '"Maria"', "5551234567", '{"name": "Maria Gonzalez", "name": 1}',
               '{"n": 1e400}', "[" * 100_000]
    body = {"model": "m", "messages": [
        {"role": "user", "content": "hi"}, {"role": "tool", "tool_call_id": "c", "content": json.dumps(document)},
        *({"role": "tool", "tool_call_id": f"t{i}", "content": text} for i, text in enumerate(as_text))]}
    request = ChatCompletionRequest.model_validate(body)
    assert [slot.path for slot in perturbed_fields(request).slots] == ["messages.0.content"]  # off by default
    fields = perturbed_fields(request, perturb_tool_results=True)
    assert [slot.path for slot in fields.slots] == [
        "messages.0.content", "messages.1.content#/patient/name", "messages.1.content#/patient/tags/0",
        "messages.1.content#/patient/tags/1", "messages.1.content#/a~1b~0c",
        *(f"messages.{i}.content" for i in range(2, 2 + len(as_text)))]
    assert fields.texts[1:5] == ["Maria Gonzalez", "asthma", "x/y", "Seattle"] and fields.texts[5:] == as_text
    released = with_texts(body, fields.slots, [f"t{i}" for i in range(len(fields.texts))])
    assert json.loads(released["messages"][1]["content"]) == {
        "patient": {"name": "t1", "age": 34, "tags": ["t2", "t3", " "]}, "a/b~c": "t4", "ok": True, "none": None}
    assert [m["content"] for m in released["messages"][2:]] == [f"t{i}" for i in range(5, 5 + len(as_text))]
    assert body["messages"][1]["content"] == json.dumps(document)  # the request itself is not changed


@pytest.mark.parametrize("message", [
    {"role": "tool", "tool_call_id": "c", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "custom",
                                                           "custom": {"name": "f", "input": "Maria Gonzalez"}}]},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function",
                                                           "function": {"name": "f", "arguments": {"a": "Maria"}}}]},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function", "function": None}]},
    {"role": "assistant", "content": None, "function_call": {"name": "f"}}])
def test_what_cannot_be_perturbed_in_tool_results_is_refused_by_name(message):
    from privlm.chat.service.messages import perturbed_fields
    from privlm.chat.wire import ChatCompletionRequest
    from privlm.service import ServiceError

    request = ChatCompletionRequest.model_validate({"model": "m", "messages": [message]})
    assert perturbed_fields(request).slots == []  # without the flag: forwarded as sent, as documented
    with pytest.raises(ServiceError) as refused:
        perturbed_fields(request, perturb_tool_results=True)
    assert refused.value.status == 400 and refused.value.detail.param.startswith("messages.0.")
