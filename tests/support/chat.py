"""What the private chat gateway's tests share (the fixtures ``stub``, in tests/conftest.py, and ``cape_privacy``,
in tests/chat/conftest.py, are built from it).

- ``stub_app``: a fast OpenAI-compatible upstream on a real uvicorn server that records every request it receives
  and answers canned bytes: a completion, or an SSE stream. Special model names make it misbehave (slow, 500,
  404, a stream that stalls), so no test changes shared state to get a failure.
- ``FakePerturber``: a mechanism without a model (each word replaced by a random one, epsilon per word charged
  to the ledger first), for the tests about the gateway's plumbing rather than about Cape.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import zlib
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from privlm.accounting import Ledger
from privlm.chat.service.privacy import PromptPrivacy
from privlm.chat.service.upstream import ChatUpstream
from privlm.mechanisms import PrivacyUnit, Spend
from privlm.models.perturbation import PerturbedPrompt, PromptReport, TokenOutcome, TokenRecord
from tests.service.localhost import serving
from tests.support.gateway import chat_app

EPS = 6.0
B = 30.0  # a fixed logit bound: no calibration in these tests
TIMEOUT = 60.0  # client-side, generous: a 2-core machine shared with others

# Model names that make the stub misbehave.
SLOW = "stub:slow"  # answers after SLOW_SECONDS
STALL = "stub:stall"  # streams one chunk, then stalls for SLOW_SECONDS
FAILING = "stub:500"  # answers 500
MISSING = "stub:404"  # answers 404, OpenAI's model_not_found
ECHO = "stub:echo"  # answers the last user message as it arrived ("You said: ..."), streamed in small pieces
ECHO_PREFIX = "You said: "
SLOW_SECONDS = 3.0

# The stub's answers, as bytes: odd spacing and an unknown field on purpose, so that byte equality through the
# gateway proves the body was passed on, not re-serialised.
CANNED_CONTENT = "Paris is the capital of France."
CANNED = (b'{"id": "chatcmpl-stub",  "object": "chat.completion", "created": 1700000000, "model": "stub-model",'
          b' "choices": [{"index": 0, "message": {"role": "assistant", "content": "Paris is the capital of France."},'
          b' "finish_reason": "stop", "logprobs": null}], "usage": {"prompt_tokens": 5, "completion_tokens": 7,'
          b' "total_tokens": 12},   "system_fingerprint": "fp_stub", "x_stub_extra": {"kept": [1, 2.50, "\\u00e9"]}}')
STREAM_PIECES = ("Paris", " is", " the", " capital", ".")


def _chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
    payload = {"id": "chatcmpl-stub", "object": "chat.completion.chunk", "created": 1700000000, "model": "stub-model",
               "system_fingerprint": "fp_stub", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    return f"data: {json.dumps(payload)}\n\n".encode()


CHUNKS = (_chunk({"role": "assistant", "content": ""}), *(_chunk({"content": piece}) for piece in STREAM_PIECES),
          _chunk({}, "stop"), b"data: [DONE]\n\n")
NOT_FOUND = (b'{"error": {"message": "The model `stub:404` does not exist", "type": "invalid_request_error", '
             b'"param": "model", "code": "model_not_found"}}')


@dataclass
class StubUpstream:
    """The stub's record: every body it received (JSON) and the request headers, in arrival order."""

    url: str = ""
    port: int = 0
    bodies: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def clear(self) -> None:
        with self.lock:
            self.bodies.clear()
            self.headers.clear()

    def received(self, marker: str | None = None) -> list[dict[str, Any]]:
        """The bodies received, or those whose JSON holds ``marker`` somewhere."""
        with self.lock:
            bodies = list(self.bodies)
        return [b for b in bodies if marker is None or marker in json.dumps(b, ensure_ascii=False)]

    def last_messages(self) -> list[dict[str, Any]]:
        """The messages of the last body received."""
        return list(self.received()[-1]["messages"])

    async def take(self, request: Request) -> dict[str, Any]:
        """Record a request's JSON body and headers (an upstream app's first step); the body."""
        body: dict[str, Any] = json.loads(await request.body())
        with self.lock:
            self.bodies.append(body)
            self.headers.append(dict(request.headers))
        return body


def stub_app(record: StubUpstream) -> FastAPI:
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body = await record.take(request)
        model = body.get("model")
        if model == SLOW:
            await asyncio.sleep(SLOW_SECONDS)
        if model == FAILING:
            return Response(b'{"error": {"message": "boom", "type": "server_error"}}', status_code=500,
                            media_type="application/json")
        if model == MISSING:
            return Response(NOT_FOUND, status_code=404, media_type="application/json",
                            headers={"x-stub-header": "kept"})
        if model == ECHO:
            return _echo(body)
        if body.get("stream"):
            return StreamingResponse(_stream(stall=model == STALL), media_type="text/event-stream",
                                     headers={"x-stub-header": "kept"})
        return Response(CANNED, media_type="application/json", headers={"x-stub-header": "kept"})

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "stub-model", "object": "model", "created": 0, "owned_by": "stub"}]}

    return app


def echoed(body: dict[str, Any]) -> str:
    """What the echo model answers to ``body``: its last user message's text, after :data:`ECHO_PREFIX`."""
    content = [m for m in body["messages"] if m.get("role") == "user"][-1]["content"]
    text = content if isinstance(content, str) else "\n".join(p.get("text", "") for p in content)
    return ECHO_PREFIX + text


def _echo(body: dict[str, Any]) -> Response:
    text = echoed(body)
    if not body.get("stream"):
        return Response(json.dumps({"id": "chatcmpl-echo", "object": "chat.completion", "created": 1700000000,
                                    "model": ECHO, "choices": [{"index": 0, "message": {"role": "assistant",
                                                                                        "content": text},
                                                                "finish_reason": "stop"}]}),
                        media_type="application/json")
    pieces = [text[i:i + 3] for i in range(0, len(text), 3)]  # 3 characters a chunk: replacements cut across
    events = [_chunk({"role": "assistant", "content": ""}), *(_chunk({"content": p}) for p in pieces),
              _chunk({}, "stop"), b"data: [DONE]\n\n"]
    return StreamingResponse(iter(events), media_type="text/event-stream")


async def _stream(*, stall: bool) -> AsyncIterator[bytes]:
    for i, chunk in enumerate(CHUNKS):
        yield chunk
        await asyncio.sleep(0.01)
        if stall and i == 1:
            await asyncio.sleep(SLOW_SECONDS)


@contextmanager
def chat_gateway(privacy: PromptPrivacy, upstream_url: str, *, read_timeout: float = 300.0,
                 upstream_key: str | None = None, **options: Any) -> Iterator[str]:
    """The chat gateway (:func:`tests.support.gateway.chat_app`, ``options``) on a real uvicorn server, forwarding to
    ``upstream_url`` with ``upstream_key``; yields its base URL."""
    upstream = ChatUpstream(upstream_url, read_timeout=read_timeout, api_key=upstream_key)
    with serving(chat_app(privacy, upstream, **options)) as url:
        yield url


def chat_body(*texts: str, model: str = "stub-model", **fields: Any) -> dict[str, Any]:
    """A chat request with one user message per text."""
    return {"model": model, "messages": [{"role": "user", "content": text} for text in texts], **fields}


def in_order(text: str, pieces: tuple[str, ...]) -> bool:
    """Whether ``pieces`` occur in ``text`` in this order (stopwords a mechanism must send unchanged)."""
    at = 0
    for piece in pieces:
        at = text.find(piece, at)
        if at < 0:
            return False
        at += len(piece)
    return True


def sse_events(raw: bytes) -> list[bytes]:
    """The events of an SSE body, each with its trailing blank line (as the stub wrote them)."""
    return [event + b"\n\n" for event in raw.replace(b"\r\n", b"\n").split(b"\n\n") if event.strip()]


def assert_openai_error(response: Any, status: int, *, code: str | None = None, param: str | None = None
                        ) -> dict[str, Any]:
    """A JSON error in OpenAI's shape with ``status`` (and ``code`` / ``param`` when given); returns ``error``."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    if code is not None:
        assert error["code"] == code, error
    if param is not None:
        assert error["param"] == param, error
    return dict(error)


# -- a mechanism without a model ------------------------------------------------------------------------------

WORDS = ("apple", "river", "stone", "cloud", "maple", "tiger", "lemon", "piano")


class _TestPerturber:
    """What the test mechanisms share: the perturber's constructor, one text through the batch path, and the
    charge of every text's total to the ledger first, in one transaction."""

    unit = PrivacyUnit.EPSILON

    def __init__(self, epsilon: float, generator: torch.Generator, ledger: Ledger | None, principal: str) -> None:
        self.epsilon, self.generator, self.ledger, self.principal = epsilon, generator, ledger, principal

    @property
    def vocabulary(self) -> Any:
        raise NotImplementedError

    def perturb(self, text: str) -> PerturbedPrompt:
        return self.perturb_batch([text])[0]

    def perturb_batch(self, texts: Sequence[str]) -> list[PerturbedPrompt]:
        raise NotImplementedError

    def charge(self, totals: Sequence[float]) -> None:
        if self.ledger is not None:
            self.ledger.spend_all(self.principal, [Spend(PrivacyUnit.EPSILON, t) for t in totals if t > 0])


class FakePerturber(_TestPerturber):
    """Every word replaced by one of ``WORDS`` drawn with ``generator``; epsilon per word, charged first."""

    name = "fake"

    def perturb_batch(self, texts: Sequence[str]) -> list[PerturbedPrompt]:
        totals = [self.epsilon * len(text.split()) for text in texts]
        self.charge(totals)
        out = []
        for text, total in zip(texts, totals, strict=True):
            draws = torch.randint(len(WORDS), (len(text.split()),), generator=self.generator).tolist()
            report = PromptReport(mechanism="fake", tokens=(), candidate_set_size=len(WORDS),
                                  accounting={"privlm": total}, guarantee="a test mechanism",
                                  spent=total if self.ledger is not None else None)
            out.append(PerturbedPrompt(text=" ".join(WORDS[d] for d in draws), report=report))
        return out


class NamePerturber(_TestPerturber):
    """A deterministic mechanism for the restore and memory tests: each word of ``REPLACEMENTS`` is released as its
    replacement (a token record per word, leading space included), every other word unchanged; epsilon per
    replaced word, charged to the ledger first."""

    name = "names"
    REPLACEMENTS: ClassVar[dict[str, str]] = {"Maria": "Jake", "Gonzalez": "Rodriguez", "Rotterdam": "Denver",
                                              "Krakow": "Denver", "Lisbon": "Paris"}

    def perturb_batch(self, texts: Sequence[str]) -> list[PerturbedPrompt]:
        pieces = [re.findall(r"\s*[\w']+|\s*[^\w\s]", text) for text in texts]
        totals = [self.epsilon * sum(p.strip() in self.REPLACEMENTS for p in ps) for ps in pieces]
        self.charge(totals)
        out = []
        for ps, total in zip(pieces, totals, strict=True):
            records = []
            for i, piece in enumerate(ps):
                word = piece.strip()
                released = piece.replace(word, self.REPLACEMENTS.get(word, word))
                records.append(TokenRecord(position=i, original=piece, original_id=zlib.crc32(word.encode()),
                                           released=released, released_id=zlib.crc32(released.strip().encode()),
                                           outcome=TokenOutcome.PERTURBED if word in self.REPLACEMENTS
                                           else TokenOutcome.NON_SENSITIVE))
            report = PromptReport(mechanism="names", tokens=tuple(records), candidate_set_size=2,
                                  accounting={"privlm": total}, guarantee="a test mechanism",
                                  spent=total if self.ledger is not None else None)
            out.append(PerturbedPrompt(text="".join(r.released for r in records), report=report))
        return out


def fake_privacy(factory: Any = FakePerturber, *, ledger: Ledger | None = None, epsilon: float = EPS,
                 max_prompt_tokens: int = 8192) -> PromptPrivacy:
    return PromptPrivacy(factory, mechanism="fake", epsilon=epsilon, count_tokens=lambda text: len(text.split()),
                         ledger=ledger, max_prompt_tokens=max_prompt_tokens, device="cpu")  # the fake draws there

