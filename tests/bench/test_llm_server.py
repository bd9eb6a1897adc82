"""``privlm serve-llm``'s app on a real uvicorn, driven by the real ``openai`` client."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator

import httpx
import openai
import pytest

from privlm.models.chat import ChatModel, Generation
from privlm_bench.chat.llm_server import create_llm_app
from tests.service.localhost import serving

pytestmark = pytest.mark.slow
KEY = "llm-test-key"
HELLO = [{"role": "user", "content": "Name three colours."}]


class WatchedModel(ChatModel):
    """SmolLM2 with no end-of-sequence token (it talks until max_tokens), recording what its generations do."""

    def __init__(self, chat_model: ChatModel) -> None:
        super().__init__(chat_model.language_model)
        self.eos_ids = frozenset()
        self.pieces, self.active, self.most_active, self.finished = 0, 0, 0, 0
        self.lock = threading.Lock()
        self.closed = threading.Event()

    def stream(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        inner = super().stream(*args, **kwargs)

        def watched() -> Iterator[str | Generation]:
            with self.lock:
                self.active += 1
                self.most_active = max(self.most_active, self.active)
            try:
                for item in inner:
                    self.pieces += isinstance(item, str)
                    self.finished += isinstance(item, Generation)
                    yield item
            finally:
                with self.lock:
                    self.active -= 1
                self.closed.set()

        return watched()


@pytest.fixture(scope="module")
def url(chat_model: ChatModel) -> Iterator[str]:
    with serving(create_llm_app(chat_model, api_keys=[KEY], max_tokens_cap=64)) as base:
        yield base


@pytest.fixture(scope="module")
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def greedy(client: openai.OpenAI, chat_model: ChatModel) -> openai.types.chat.ChatCompletion:
    return client.chat.completions.create(model=chat_model.name, messages=HELLO, temperature=0, max_tokens=24)


def stream_text(client: openai.OpenAI, **request: object) -> tuple[str, list[object]]:
    chunks = list(client.chat.completions.create(stream=True, **request))  # type: ignore[call-overload]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks


def test_models_lists_the_one_model(client: openai.OpenAI, chat_model: ChatModel) -> None:
    assert [m.id for m in client.models.list()] == ["smollm2-135m-instruct"] == [chat_model.name]


def test_non_streaming_answer(greedy: openai.types.chat.ChatCompletion, chat_model: ChatModel) -> None:
    choice = greedy.choices[0]
    assert greedy.object == "chat.completion" and greedy.model == chat_model.name
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    expected = chat_model.generate(HELLO, max_tokens=24, temperature=0)
    assert choice.message.content == expected.text  # the server is the model, nothing added
    usage = greedy.usage
    assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (
        expected.prompt_tokens, expected.completion_tokens)
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_streaming_matches_non_streaming_greedy(client: openai.OpenAI, chat_model: ChatModel,
                                                greedy: openai.types.chat.ChatCompletion) -> None:
    text, chunks = stream_text(client, model=chat_model.name, messages=HELLO, temperature=0, max_tokens=24,
                               stream_options={"include_usage": True})
    assert text == greedy.choices[0].message.content
    first, *middle, last, usage = chunks
    assert first.choices[0].delta.role == "assistant"  # type: ignore[attr-defined]
    assert len(middle) >= 2  # the text came in pieces
    assert all(c.choices[0].finish_reason is None for c in middle)  # type: ignore[attr-defined]
    assert last.choices[0].finish_reason == greedy.choices[0].finish_reason  # type: ignore[attr-defined]
    assert usage.choices == [] and usage.usage == greedy.usage  # type: ignore[attr-defined]


def test_streaming_without_usage_ends_with_done(url: str, chat_model: ChatModel) -> None:
    body = {"model": chat_model.name, "messages": HELLO, "temperature": 0, "max_tokens": 5, "stream": True}
    response = httpx.post(url + "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {KEY}"},
                          timeout=120)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    events = [line.removeprefix("data: ") for line in response.text.split("\n\n") if line]
    assert events[-1] == "[DONE]"
    payloads = [json.loads(e) for e in events[:-1]]
    assert payloads[-1]["choices"][0]["finish_reason"] == "length"
    assert all(p["usage"] is None for p in payloads)


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_max_tokens_is_respected(client: openai.OpenAI, chat_model: ChatModel, field: str) -> None:
    answer = client.chat.completions.create(model=chat_model.name, messages=HELLO, temperature=0,
                                            **{field: 4})  # type: ignore[call-overload]
    assert answer.choices[0].finish_reason == "length" and answer.usage.completion_tokens == 4


def test_stop_is_respected(client: openai.OpenAI, chat_model: ChatModel,
                           greedy: openai.types.chat.ChatCompletion) -> None:
    full = greedy.choices[0].message.content
    assert full is not None
    stop = full.split()[3]  # a word from the middle of the answer
    answer = client.chat.completions.create(model=chat_model.name, messages=HELLO, temperature=0, max_tokens=24,
                                            stop=stop)
    text = answer.choices[0].message.content
    assert text == full[:full.index(stop)] and stop not in text
    assert answer.choices[0].finish_reason == "stop"
    streamed, chunks = stream_text(client, model=chat_model.name, messages=HELLO, temperature=0, max_tokens=24,
                                   stop=[stop, "zzz"])
    assert streamed == text and chunks[-1].choices[0].finish_reason == "stop"  # type: ignore[attr-defined]


def test_seed_gives_the_same_sampled_answer(client: openai.OpenAI, chat_model: ChatModel) -> None:
    def sampled(seed: int) -> str | None:
        answer = client.chat.completions.create(model=chat_model.name, messages=HELLO, temperature=1.0, max_tokens=24,
                                                seed=seed)
        return answer.choices[0].message.content

    first = sampled(11)
    assert sampled(11) == first
    streamed = stream_text(client, model=chat_model.name, messages=HELLO, temperature=1.0, max_tokens=24, seed=11)
    assert streamed[0] == first
    assert sampled(12) != first  # the seed is used
    assert sampled(-1) == sampled(-1)  # any int64 is a seed


def test_roles_and_text_parts(client: openai.OpenAI, chat_model: ChatModel) -> None:
    parts = [{"type": "text", "text": "Name three"}, {"type": "text", "text": "colours."}]
    messages = [{"role": "developer", "content": "Answer briefly."}, {"role": "user", "content": parts},
                {"role": "assistant", "content": "Red, green"}, {"role": "user", "content": "And one more?"}]
    answer = client.chat.completions.create(model=chat_model.name, messages=messages, temperature=0, max_tokens=8)
    assert answer.choices[0].message.content
    as_model = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name three\ncolours."},
                {"role": "assistant", "content": "Red, green"}, {"role": "user", "content": "And one more?"}]
    assert answer.usage.prompt_tokens == len(chat_model.prompt_ids(as_model))


@pytest.mark.parametrize(("change", "status", "param", "code"), [
    ({"model": "gpt-4o"}, 404, "model", "model_not_found"),
    ({"n": 2}, 400, "n", None),
    ({"temperature": 3}, 400, "temperature", None),
    ({"top_p": 0}, 400, "top_p", None),
    ({"max_tokens": 65}, 400, "max_tokens", None),
    ({"stop": ["a", "b", "c", "d", "e"]}, 400, "stop", None),
    ({"messages": [{"role": "tool", "content": "42", "tool_call_id": "call_1"}]}, 400, "messages.0.role",
     "unsupported_role"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, 400,
     "messages.0.tool_calls", "unsupported_parameter"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools", "unsupported_parameter"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "what is this?"},
                                                {"type": "image_url", "image_url": {"url": "data:,"}}]}]},
     400, "messages.0.content.1", "unsupported_content"),
    ({"messages": [{"role": "user", "content": "word " * 9000}]}, 400, "messages", "context_length_exceeded"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role", None),
    ({"messages": [{"role": "user", "content": 42}]}, 400, "messages.0.content", None),
    ({"messages": []}, 400, "messages", None),
])
def test_bad_requests_get_openai_errors(client: openai.OpenAI, chat_model: ChatModel, change: dict[str, object],
                                        status: int, param: str, code: str | None) -> None:
    request = {"model": chat_model.name, "messages": HELLO, "max_tokens": 4} | change
    with pytest.raises(openai.APIStatusError) as caught:
        client.chat.completions.create(**request)  # type: ignore[call-overload]
    error = caught.value
    assert error.status_code == status
    assert isinstance(error.body, dict) and error.body["param"] == param and error.body["message"]
    assert error.body["type"] in ("invalid_request_error", "not_found_error")
    if code is not None:
        assert error.body["code"] == code


def test_context_error_names_the_count_and_limit(client: openai.OpenAI, chat_model: ChatModel) -> None:
    messages = [{"role": "user", "content": "word " * 9000}]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=chat_model.name, messages=messages, max_tokens=10, stream=True)
    count = len(chat_model.prompt_ids(messages))
    assert f"{count} tokens" in caught.value.message and str(chat_model.context_length - 10) in caught.value.message


def test_a_key_is_required(url: str, chat_model: ChatModel) -> None:
    anonymous = openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        anonymous.chat.completions.create(model=chat_model.name, messages=HELLO, max_tokens=2)


@pytest.fixture(scope="module")
def watched(chat_model: ChatModel) -> WatchedModel:
    return WatchedModel(chat_model)


@pytest.fixture(scope="module")
def watched_url(watched: WatchedModel) -> Iterator[str]:
    with serving(create_llm_app(watched, max_tokens_cap=1000)) as base:
        yield base


def test_streaming_streams_and_a_disconnect_stops_the_generation(watched: WatchedModel, watched_url: str) -> None:
    watched.closed.clear()
    body = {"model": watched.name, "messages": HELLO, "temperature": 0, "max_tokens": 1000, "stream": True}
    with httpx.stream("POST", watched_url + "/v1/chat/completions", json=body, timeout=120) as response:
        contents = 0
        for line in response.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                contents += 1
                if contents == 3:
                    break
        assert not watched.closed.is_set() and watched.finished == 0  # chunks arrive while it generates
    assert watched.closed.wait(60)  # the client went away: the generation stopped
    assert watched.finished == 0 and watched.pieces < 1000


def test_one_generation_at_a_time(watched: WatchedModel, watched_url: str) -> None:
    client = openai.OpenAI(base_url=watched_url + "/v1", api_key="none", max_retries=0, timeout=120)
    answers: list[str | None] = []

    def ask() -> None:
        answer = client.chat.completions.create(model=watched.name, messages=HELLO, temperature=0, max_tokens=6)
        answers.append(answer.choices[0].message.content)

    threads = [threading.Thread(target=ask) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert len(answers) == 3 and len(set(answers)) == 1
    assert watched.most_active == 1


def test_a_disconnect_stops_a_non_streaming_generation(watched: WatchedModel, watched_url: str) -> None:
    watched.closed.clear()
    finished = watched.finished
    body = {"model": watched.name, "messages": HELLO, "temperature": 0, "max_tokens": 1000}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up long before 1000 tokens and goes away
        httpx.post(watched_url + "/v1/chat/completions", json=body, timeout=httpx.Timeout(120, read=1.0))
    assert watched.closed.wait(60)
    assert watched.finished == finished  # stopped, not finished


@pytest.mark.parametrize(("arguments", "hint"), [
    (["--model", "/no/such/folder"], "--model"),
    (["--max-tokens-cap", "9000"], "--max-tokens-cap"),
    (["--host", "0.0.0.0"], "--host"),
])
def test_cli_refuses_bad_options(arguments: list[str], hint: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from privlm.cli import app

    monkeypatch.delenv("PRIVLM_API_KEYS", raising=False)
    result = CliRunner().invoke(app, ["serve-llm", "--device", "cpu", *arguments])
    assert result.exit_code == 2 and hint in result.output
