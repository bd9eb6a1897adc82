"""What may cross verbatim in a chat request's messages (issue 37, item 6).

Every key of every message, whatever its role and whether or not its text is perturbed, of its text parts and of an
assistant's tool calls (and the legacy ``function_call``) is handled on purpose: identifiers (ids, types, function
names, ``tool_call_id``), the provider's prompt-cache settings in their documented form, and the texts the gateway
perturbs or documents as crossing. Anything else is a 400 naming it, and nothing reaches the upstream; before, a
planted key of a tool message or tool call, or a note inside ``cache_control``, crossed as sent, even with
``--perturb-tool-results``.

A mechanism without a model (``FakePerturber``) does the perturbing: the mechanism is not the point here; the stub
upstream's record of what it received is the proof of what crossed.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from privlm.chat.service.memory import ConversationMemory
from privlm.settings.chat import ChatOptions
from tests.chat.test_request_fields import client, post
from tests.service.localhost import serving
from tests.support.chat import StubUpstream, assert_openai_error, chat_gateway, fake_privacy

SECRET = "Maria Gonzalez has HIV"
MESSAGES: list[dict[str, Any]] = [  # every identifier and provider setting the gateway forwards
    {"role": "system", "content": "Be brief.", "name": "ops", "cache_control": {"type": "ephemeral", "ttl": "1h"}},
    {"role": "user", "content": [{"type": "text", "text": "find the patient", "cache_control": {"type": "ephemeral"},
                                  "prompt_cache_breakpoint": {"mode": "explicit", "ttl": "12h"}}]},
    {"role": "assistant", "content": None, "refusal": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "lookup_patient", "arguments": '{"id": "p-7"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "name": "lookup_patient", "cache_control": {"type": "ephemeral"},
     "content": [{"type": "text", "text": "found", "prompt_cache_breakpoint": {"mode": "explicit"}}]},
    {"role": "assistant", "content": None, "audio": {"id": "audio_1"},
     "function_call": {"name": "lookup", "arguments": "{}"}},
    {"role": "function", "name": "lookup", "content": "found", "prompt_cache_breakpoint": {"mode": "explicit",
                                                                                          "ttl": "30m"}},
]
CUSTOM_CALL = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_2", "type": "custom", "custom": {"name": "grep", "input": "diabetes"}}]}  # not perturbable: no flag


@pytest.fixture(scope="module")
def gateways(stub) -> Iterator[dict[bool, str]]:
    """The fake mechanism's gateway, by ``perturb_tool_results``: tool results as sent, or perturbed."""
    with (chat_gateway(fake_privacy(), stub.url) as as_sent,
          chat_gateway(fake_privacy(), stub.url, options=ChatOptions(perturb_tool_results=True)) as perturbed):
        yield {False: as_sent, True: perturbed}


def settings(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages without their texts (contents, text parts' text, tool-call arguments and inputs): what must
    cross exactly as sent, whatever the gateway perturbs."""
    out = copy.deepcopy(messages)
    for message in out:
        if isinstance(message.get("content"), str):
            message["content"] = "<text>"
        for part in message["content"] if isinstance(message.get("content"), list) else []:
            part["text"] = "<text>"
        calls = [message.get("function_call"), *(call[call["type"]] for call in message.get("tool_calls", []))]
        for called in filter(None, calls):
            for text in {"arguments", "input"} & set(called):
                called[text] = "<text>"
    return out


def planted(where: Callable[[list[dict[str, Any]]], dict[str, Any]], key: str, value: Any = SECRET
            ) -> Callable[[list[dict[str, Any]]], None]:
    """Sets ``key`` to ``value`` (the secret, by default) in the object ``where`` finds in the messages."""
    def plant(messages: list[dict[str, Any]]) -> None:
        where(messages)[key] = value
    return plant


# Each planted key, value or marker crossed as sent on main; param: where the gateway now names it.
PLANTED = [
    pytest.param(planted(lambda m: m[3], "x_note"), "messages.3.x_note", "unsupported_field", id="tool-message-key"),
    pytest.param(planted(lambda m: m[3]["content"][0], "x_note"), "messages.3.content.0.x_note",
                 "unsupported_field", id="tool-text-part-key"),
    pytest.param(planted(lambda m: m[5], "x_note"), "messages.5.x_note", "unsupported_field",
                 id="function-message-key"),
    pytest.param(planted(lambda m: m[2]["tool_calls"][0], "x_note"), "messages.2.tool_calls.0.x_note",
                 "unsupported_field", id="tool-call-key"),
    pytest.param(planted(lambda m: m[2]["tool_calls"][0]["function"], "x_note"),
                 "messages.2.tool_calls.0.function.x_note", "unsupported_field", id="tool-call-function-key"),
    pytest.param(planted(lambda m: m[4]["function_call"], "x_note"), "messages.4.function_call.x_note",
                 "unsupported_field", id="legacy-function-call-key"),
    pytest.param(planted(lambda m: m[4]["audio"], "x_note"), "messages.4.audio.x_note", "unsupported_field",
                 id="assistant-audio-key"),
    pytest.param(planted(lambda m: m[2], "x_note"), "messages.2.x_note", "unsupported_field",
                 id="assistant-message-key"),  # assistant text is not perturbed here: no restore, no extraction
    pytest.param(planted(lambda m: m[2], "annotations", [{"type": "url_citation", "url_citation": {
        "title": SECRET, "url": "https://example.org", "start_index": 0, "end_index": 1}}]),
        "messages.2.annotations", "unsupported_field", id="assistant-annotation"),  # only [] or null crosses
    pytest.param(planted(lambda m: m[2], "reasoning_content", {"note": SECRET}), "messages.2.reasoning_content",
                 "invalid_request", id="assistant-reasoning-object"),  # the upstream's reasoning is a string
    pytest.param(planted(lambda m: m[2], "refusal", [SECRET]), "messages.2.refusal", "invalid_request",
                 id="assistant-refusal-list"),
    pytest.param(planted(lambda m: m[0], "x_note"), "messages.0.x_note", "unsupported_field",
                 id="system-message-key"),  # not perturbed here either: no --perturb-system
    pytest.param(planted(lambda m: m[2]["tool_calls"][0], "id", {"note": SECRET}), "messages.2.tool_calls.0.id",
                 "invalid_request", id="tool-call-id-object"),
    pytest.param(planted(lambda m: m[2]["tool_calls"][0]["function"], "name", {"note": SECRET}),
                 "messages.2.tool_calls.0.function.name", "invalid_request", id="function-name-object"),
    pytest.param(planted(lambda m: m[3], "tool_call_id", [SECRET]), "messages.3.tool_call_id", "invalid_request",
                 id="tool-call-id-list"),
    pytest.param(planted(lambda m: m[3], "cache_control", {"type": "ephemeral", "note": SECRET}),
                 "messages.3.cache_control", "unsupported_field", id="tool-message-cache-control-note"),
    pytest.param(planted(lambda m: m[3]["content"][0], "cache_control", {"type": SECRET}),
                 "messages.3.content.0.cache_control", "unsupported_field", id="tool-part-cache-control-type"),
    pytest.param(planted(lambda m: m[1]["content"][0], "cache_control", {"type": "ephemeral", "note": SECRET}),
                 "messages.1.content.0.cache_control", "unsupported_field", id="user-part-cache-control-note"),
    pytest.param(planted(lambda m: m[1], "cache_control", {"type": "ephemeral", "ttl": SECRET}),
                 "messages.1.cache_control", "unsupported_field", id="user-cache-control-ttl"),
    pytest.param(planted(lambda m: m[0], "cache_control", SECRET), "messages.0.cache_control", "unsupported_field",
                 id="system-cache-control-string"),
    pytest.param(planted(lambda m: m[1]["content"][0], "prompt_cache_breakpoint", {"mode": "explicit", "x": SECRET}),
                 "messages.1.content.0.prompt_cache_breakpoint", "unsupported_field", id="breakpoint-extra-key"),
    pytest.param(planted(lambda m: m[3]["content"][0], "prompt_cache_breakpoint", {"mode": SECRET}),
                 "messages.3.content.0.prompt_cache_breakpoint", "unsupported_field", id="breakpoint-mode"),
    pytest.param(planted(lambda m: m[5], "prompt_cache_breakpoint", {"ttl": "30m"}),
                 "messages.5.prompt_cache_breakpoint", "unsupported_field", id="breakpoint-without-mode"),
]


@pytest.mark.parametrize("perturb_tool_results", [False, True], ids=["tool-results-as-sent", "tool-results-perturbed"])
@pytest.mark.parametrize(("plant", "param", "code"), PLANTED)
def test_round3_6_a_key_or_value_planted_in_any_message_or_tool_call_is_refused_by_name(
        gateways, stub, perturb_tool_results, plant, param, code):
    messages = copy.deepcopy(MESSAGES)
    plant(messages)
    stub.clear()
    response = post(gateways[perturb_tool_results], {"model": "stub-model", "messages": messages})
    error = assert_openai_error(response, 400, code=code, param=param)
    assert SECRET not in error["message"]
    assert stub.received() == []  # nothing crossed


def test_round3_6_a_custom_tool_call_keeps_only_its_own_keys(gateways, stub):
    """A custom tool's call (forwarded without --perturb-tool-results) is held to its keys too."""
    messages = [{"role": "user", "content": "grep it"}, copy.deepcopy(CUSTOM_CALL)]
    messages[1]["tool_calls"][0]["custom"]["x_note"] = SECRET
    stub.clear()
    response = post(gateways[False], {"model": "stub-model", "messages": messages})
    assert_openai_error(response, 400, code="unsupported_field", param="messages.1.tool_calls.0.custom.x_note")
    assert stub.received() == []


@pytest.mark.parametrize("perturb_tool_results", [False, True], ids=["tool-results-as-sent", "tool-results-perturbed"])
def test_identifiers_function_names_and_cache_settings_cross_as_sent(gateways, stub, perturb_tool_results):
    """The other side of the rule (passes before and after the fix): what is documented as crossing still does,
    through OpenAI's own client: ids, types, function names, ``tool_call_id``, a tool message's ``name``, every
    documented form of ``cache_control`` and ``prompt_cache_breakpoint``, ``refusal`` and ``audio``."""
    messages = copy.deepcopy(MESSAGES) + ([] if perturb_tool_results else [copy.deepcopy(CUSTOM_CALL)])
    stub.clear()
    client(gateways[perturb_tool_results]).chat.completions.create(model="stub-model", messages=messages)
    [received] = stub.received()
    assert settings(received["messages"]) == settings(messages)
    texts_as_sent = received["messages"][2:] == messages[2:]
    assert texts_as_sent is not perturb_tool_results  # the tool texts were perturbed only with the flag


# -- the answer as openai-python sends it back (review finding 1) ----------------------------------------------------

# An answer's message as each upstream returns it, every field it sets: openai-python resends all of them when a
# client appends ``completion.choices[0].message`` to its history.
ANSWERS: dict[str, dict[str, Any]] = {
    "openai": {"role": "assistant", "content": "Rest, and drink water.", "refusal": None, "annotations": []},
    "vllm": {"role": "assistant", "content": "Rest, and drink water.", "refusal": None, "annotations": None,
             "audio": None, "function_call": None, "tool_calls": [], "reasoning_content": None, "reasoning": None},
    "vllm-reasoning": {"role": "assistant", "content": "Rest, and drink water.", "tool_calls": [],
                       "reasoning_content": "They ask about a cold; the usual advice.",
                       "reasoning": "They ask about a cold; the usual advice."},
}


def answering_app(record: StubUpstream) -> FastAPI:
    """An upstream that answers the message of :data:`ANSWERS` its request's model names, recording each body."""
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> JSONResponse:
        body = await record.take(request)
        return JSONResponse({"id": "chatcmpl-answering", "object": "chat.completion", "created": 1700000000,
                             "model": body["model"], "choices": [{"index": 0, "message": ANSWERS[body["model"]],
                                                                  "finish_reason": "stop"}]})

    return app


@pytest.fixture(scope="module")
def answering() -> Iterator[tuple[StubUpstream, dict[str, str]]]:
    """The upstream, and the fake mechanism's gateways to it: plain, and restoring with memory (where an assistant
    message is a perturbed one, held against what the gateway returned)."""
    upstream = StubUpstream()
    with (serving(answering_app(upstream)) as url, chat_gateway(fake_privacy(), url) as plain,
          chat_gateway(fake_privacy(), url, memory=ConversationMemory(None),
                       options=ChatOptions(restore=True)) as restoring):
        yield upstream, {"plain": plain, "restore": restoring}


@pytest.mark.parametrize("gateway", ["plain", "restore"])
@pytest.mark.parametrize("upstream", list(ANSWERS))
def test_round3_6_an_answer_sent_back_with_every_field_its_upstream_set_is_accepted(answering, gateway, upstream):
    """``messages.append(completion.choices[0].message)``, the usual way to keep a conversation with openai-python:
    the resent answer holds ``annotations: []`` (OpenAI), ``reasoning_content`` or ``reasoning`` (vLLM), each the
    upstream's own output or empty. It was a 400 ``unsupported_field`` on every gateway after item 6's first fix; it
    goes up as the upstream wrote it."""
    record, urls = answering
    openai_client = client(urls[gateway])
    history: list[Any] = [{"role": "user", "content": "I have a cold, what should I do?"}]
    completion = openai_client.chat.completions.create(model=upstream, messages=history)
    history += [completion.choices[0].message, {"role": "user", "content": "And for the fever?"}]
    openai_client.chat.completions.create(model=upstream, messages=history)
    resent = record.bodies[-1]["messages"][1]
    assert resent == ANSWERS[upstream]
