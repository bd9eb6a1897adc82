"""A ten-turn conversation (every other turn streamed) through the real ``openai`` client, the gateway
(cape-public on SmolLM2 at epsilon 8, the demo's readable setting, with a ledger, conversation memory and
restore) and ``serve-llm`` (real SmolLM2 generation), with a TCP capture between the gateway and serve-llm.

Each user message is charged once, on the turn it is first sent; on every later turn the upstream receives the
very text it received then; every assistant message it receives is the answer it wrote itself, never the
restored one the client saw; and a gateway restarted on the same files after turn five keeps all of it. In the
bench kit's tests: ``serve-llm`` is the kit's.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from privlm.accounting import Ledger
from privlm.chat.service.memory import ConversationMemory
from privlm.chat.service.privacy import PromptPrivacy
from privlm.mechanisms import PrivacyUnit
from privlm.models.chat import ChatModel
from privlm.settings.chat import ChatOptions
from privlm_bench.chat.llm_server import create_llm_app
from tests.service.localhost import RecordingProxy, serving
from tests.support.chat import TIMEOUT, chat_gateway

pytestmark = pytest.mark.slow

KEY = "ten-turn-key"
EPSILON = 8.0
SYSTEM = "Repeat the user's last message word for word, and nothing else."
MESSAGES = [
    "My name is Maria Gonzalez and I live in Rotterdam.",
    "My brother Piotr Kowalski works at Siemens in Munich.",
    "Our doctor, Dr. Helena Strand, moved to Uppsala last year.",
    "Send the invoice to Tomasz Nowak at Kraków Street 12.",
    "Maria Gonzalez said the meeting is on Friday.",
    "My sister Ingrid Olsen studies law in Bergen.",
    "Call Rafael Moreno about the flat in Valencia.",
    "Helena Strand recommended a clinic near Stockholm.",
    "Piotr Kowalski bought a car from Henrik Lund.",
    "Please remind Ingrid Olsen about the Bergen trip.",
]


def posted(raw: bytes) -> dict[str, Any]:
    """The JSON body of the one HTTP message in ``raw`` (a capture of one direction of one exchange)."""
    _, _, body = bytes(raw).partition(b"\r\n\r\n")
    return dict(json.loads(body))


def streamed_text(raw: bytes) -> str:
    """The content of a captured SSE answer (chunked transfer encoding undone), its deltas joined."""
    head, _, body = bytes(raw).partition(b"\r\n\r\n")
    if b"chunked" in head.lower():
        data, rest = b"", body
        while rest:
            size, _, rest = rest.partition(b"\r\n")
            n = int(size, 16)
            data, rest = data + rest[:n], rest[n + 2:]
            if n == 0:
                break
        body = data
    text = ""
    for line in body.split(b"\n"):
        if line.startswith(b"data: {"):
            for choice in json.loads(line[6:])["choices"]:
                text += choice["delta"].get("content") or ""
    return text


def ask(client: openai.OpenAI, model: str, history: list[dict[str, str]], *, stream: bool
        ) -> tuple[dict[str, Any], str, int]:
    """One turn: the report, the answer as the client got it, and how many replacements it restored."""
    options: dict[str, Any] = {"model": model, "messages": history, "max_tokens": 24, "temperature": 0,
                               "extra_body": {"privlm": {"report": True}}}
    if not stream:
        raw = client.chat.completions.with_raw_response.create(**options)
        completion = raw.parse()
        return (completion.model_extra or {})["privlm"], completion.choices[0].message.content or "", \
            int(raw.headers["x-privlm-restored"])
    with client.chat.completions.with_streaming_response.create(stream=True, **options) as response:
        chunks = list(response.parse())
    first, *answer, last = chunks
    text = "".join(c.choices[0].delta.content or "" for c in answer if c.choices)
    return (first.model_extra or {})["privlm"], text, (last.model_extra or {})["privlm"]["restore"]["restored"]


@contextmanager
def stack(smollm2_lm: Any, llm_url: str, proxy: RecordingProxy, files: Path) -> Iterator[openai.OpenAI]:
    """The gateway on fresh objects over the same ledger and memory files (a restart: nothing kept in memory)."""
    ledger = Ledger(files / "ledger.sqlite", budgets={PrivacyUnit.EPSILON: 1e6})
    privacy = PromptPrivacy.of("cape-public", smollm2_lm, epsilon=EPSILON, logit_bound=None, ledger=ledger)
    memory = ConversationMemory(files / "memory.sqlite")
    with chat_gateway(privacy, f"http://127.0.0.1:{proxy.port}", api_keys=[KEY], memory=memory,
                      options=ChatOptions(restore=True)) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=TIMEOUT)
    memory.close()


def test_ten_turns_charge_each_message_once_and_send_each_release_identically(smollm2_lm, tmp_path):
    ledger = Ledger(tmp_path / "ledger.sqlite", budgets={PrivacyUnit.EPSILON: 1e6})
    principal = ledger.principal_of_key(KEY)
    history: list[dict[str, str]] = [{"role": "system", "content": SYSTEM}]
    first_release: list[str] = []  # each user message as it first went up
    upstream_answers: list[str] = []  # each answer as serve-llm wrote it
    charged: list[float] = []
    with serving(create_llm_app(ChatModel(smollm2_lm))) as llm_url:
        model = httpx.get(f"{llm_url}/v1/models").json()["data"][0]["id"]
        proxy = RecordingProxy(int(llm_url.rsplit(":", 1)[1]))
        for half in (MESSAGES[:5], MESSAGES[5:]):
            with stack(smollm2_lm, llm_url, proxy, tmp_path) as client:
                for message in half:
                    history.append({"role": "user", "content": message})
                    proxy.clear()
                    stream = len(first_release) % 2 == 1  # every other turn streams
                    report, answer, restored = ask(client, model, history, stream=stream)
                    sent = posted(proxy.upstream)

                    texts = [t for t in report["texts"] if t["role"] == "user"]
                    answers = [t for t in report["texts"] if t["role"] == "assistant"]
                    assert [t["remembered"] for t in texts] == [True] * len(first_release) + [False]
                    assert all(t["remembered"] for t in answers)  # every answer known: free, as written
                    first_release.append(texts[-1]["sent"])
                    charged.append(texts[-1]["epsilon_spent"])
                    assert report["epsilon_spent"] == pytest.approx(charged[-1]) and charged[-1] > 0
                    assert ledger.spent(principal, PrivacyUnit.EPSILON) == pytest.approx(sum(charged))

                    users = [m["content"] for m in sent["messages"] if m["role"] == "user"]
                    assistants = [m["content"] for m in sent["messages"] if m["role"] == "assistant"]
                    assert users == first_release  # every earlier message exactly as it first went up
                    assert assistants == upstream_answers  # the upstream's own words, never a restored span

                    upstream_answers.append(streamed_text(proxy.downstream) if stream else
                                            posted(proxy.downstream)["choices"][0]["message"]["content"])
                    assert (answer == upstream_answers[-1]) == (restored == 0)
                    history.append({"role": "assistant", "content": answer})
        proxy.close()
    # Whether any answer here was restored is up to the draws (the history makes SmolLM2 quote less): the
    # deterministic two-turn test (test_chat_conversations.py) shows a restored answer going back unrestored, and
    # the test below that serve-llm's answers do get restored.
    assert len(charged) == 10


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_answers_from_serve_llm_are_restored(smollm2_lm, tmp_path, stream):
    """Told to repeat, SmolLM2 quotes the readable release, so its answers get restored: one try per message until
    one is, each consistent (the answer differs from what the upstream wrote exactly when something was restored).
    In a probe, 4 of 6 single turns restored 1 to 3 replacements (a release of one-character replacements, "My P is
    a 2", has nothing restorable), so ten tries all failing would take odds near (1/3)^10."""
    with serving(create_llm_app(ChatModel(smollm2_lm))) as llm_url:
        model = httpx.get(f"{llm_url}/v1/models").json()["data"][0]["id"]
        proxy = RecordingProxy(int(llm_url.rsplit(":", 1)[1]))
        with stack(smollm2_lm, llm_url, proxy, tmp_path) as client:
            for message in MESSAGES:
                proxy.clear()
                _, answer, restored = ask(client, model, [{"role": "system", "content": SYSTEM},
                                                          {"role": "user", "content": message}], stream=stream)
                upstream = streamed_text(proxy.downstream) if stream else \
                    posted(proxy.downstream)["choices"][0]["message"]["content"]
                assert (answer == upstream) == (restored == 0)
                if restored:
                    break
        proxy.close()
    assert restored > 0
