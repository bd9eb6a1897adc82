"""``privlm bench chat``: what ``privlm gateway`` adds to a chat API's latency and what it costs in throughput.

Every party runs in its own process on localhost, so that the clients' load shares no GIL with them:
  - a stub upstream (:func:`create_stub_upstream`): an OpenAI-compatible chat API that answers a canned
    completion at once, or a canned stream of ``stub_chunks`` chunks with no delay. Through it the gateway's
    own overhead (Cape on SmolLM2, then proxying) stands on its own;
  - ``privlm serve-llm``: real SmolLM2 generation (greedy, ``max_tokens`` tokens), the upstream of the demo;
  - ``privlm gateway --chat-upstream URL`` in front of each, Cape at ``epsilon`` per token with a logit bound
    calibrated on public prompts (:data:`CALIBRATION_PROMPTS`); and a second one with ``--device-model-int8``
    (B calibrated on the int8 model), unless ``int8`` is off.

The floor (:func:`measure_floor`): the device model's own throughput through the gateway's mechanism, measured
in this process before the gateways start: batches of :data:`FLOOR_BATCH` one-prompt requests, each batch one
call of :meth:`~privlm.chat.service.privacy.PromptPrivacy.privatize_many` (what the gateway runs per batch), and
the same prompts one request at a time. The gateway's throughput at :data:`FLOOR_BATCH` clients against the stub,
over the floor, is how much of the device model's batched throughput the gateway keeps.

Clients are asyncio tasks in this process, one ``httpx.AsyncClient`` (one kept-alive connection) each; every
client sends ``requests_per_client`` requests one after another, each a one-message chat with one of
:data:`PROMPTS`. For each upstream, mode (non-streaming, streaming), number of concurrent clients and path
(direct to the upstream, or through the gateway), a row records latency (p50/p99: until the whole answer is
read), time to first token (TTFT, streaming: until the first chunk with content) and throughput
(requests/s over the wall time of the whole run). Before anything is timed, each (path, mode) gets one
warm-up pass, and every client opens its connection (``GET /health``). The gateway's added latency is its
percentile minus the direct percentile at the same load.

The seed fixes which prompt each request carries. The gateway's perturbation draws from OS entropy on
purpose (a fresh generator per request) and serve-llm decodes greedily, so no other randomness is involved.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import httpx
import numpy as np
import torch
from fastapi import APIRouter, FastAPI
from fastapi.responses import Response, StreamingResponse
from rich.console import Console

from privlm.chat.service.privacy import PrivacyRequest, PromptPrivacy
from privlm.chat.wire import (
    SSE_DONE,
    AssistantMessage,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Choice,
    ChunkChoice,
    Delta,
    Usage,
    sse_event,
)
from privlm.mechanisms import make_generator
from privlm.models.language import LanguageModel
from privlm.provenance import provenance
from privlm.service import BearerKeys, create_service_app, run_service
from privlm.service.auth import KEY_ENV_VARS
from privlm.service.catalog import ModelEntry, catalog_router
from privlm.service.process import free_port, start_privlm, stop
from privlm.validation import check_positive_finite, check_positive_int

Mode = Literal["non-streaming", "streaming"]
MODES: tuple[Mode, ...] = ("non-streaming", "streaming")
CLIENT_COUNTS = (1, 8, 32)
STUB_MODEL = "privlm-stub-chat"
STUB_ANSWER = ("Thanks for your message. Here is a short canned answer from the stub upstream, sent at once "
               "for the benchmark.")
TIMEOUT_S = 600.0  # one request, however long the queue before it
DIRECT = "direct"
GATEWAY, GATEWAY_INT8 = "gateway", "gateway-int8"  # the paths through a gateway: fp32 or int8 device model
FLOOR_BATCH = 8  # the floor's batch, and the number of clients whose throughput is set against it

# Short prompts with (invented) personal details: what the gateway is for. Public test strings.
PROMPTS: tuple[str, ...] = (
    "My name is Alice Moreau and I live at 14 Rue des Lilas, Lyon. Write a complaint about my late parcel.",
    "I'm John Carter, 42, diagnosed with type 2 diabetes last March. What should I eat for breakfast?",
    "Draft an email to my landlord, Mr. Patel, saying I will pay the rent of 1,250 pounds on Friday.",
    "My daughter Emma Li starts at Riverside Primary School on Monday. How do I help her settle in?",
    "Summarise: Dr. Hannah Weiss prescribed 20 mg of fluoxetine to Mark Jensen on 3 May 2024.",
    "I am Carlos Ruiz, my passport number is X4821973 and it expires next month. How do I renew it?",
    "Write a birthday message for my wife Sofia, who turns 35 on the 12th of June.",
    "My phone number is 07700 900123 and someone keeps calling me at night. What can I do?",
    "I'm Priya Sharma from Leeds and I earn 38,000 a year. How much should I save each month?",
    "Help me reply to Tom Becker, who asked if I can cover his shift at the Berlin office on Sunday.",
    "My son Lucas, 9, was bullied at Oakwood School yesterday. How should I talk to his teacher?",
    "Translate into Spanish: My name is Olivia Brown and I am allergic to penicillin.",
    "I was fired from Northwind Ltd on 2 April after reporting my manager, Greg Hall. Is that legal?",
    "Write a cover letter for Nadia Haddad, a nurse with six years at St Mary's Hospital in Leeds.",
    "My credit card ending in 4417 was charged 89.99 by a shop I never used. What should I do?",
    "I'm 67, live alone in Galway and my name is Sean Murphy. Suggest hobbies to meet people.",
    "Remind me how to tell my boss, Karen Lee, that I am pregnant and due in November.",
    "My email is maria.rossi@example.com and I forgot my bank password. How do I reset it safely?",
    "Plan a week of meals for David Kim, who has coeliac disease and lives in Toronto.",
    "I'm Fatima Zahra, a student at the University of Edinburgh, and I failed my statistics exam.",
    "Write a short note to my neighbour Peter Novak at number 22 about his barking dog.",
    "My husband James was admitted to Royal Free Hospital with chest pain. What questions should I ask?",
    "I live at 5 Maple Avenue, Springfield, and my car was stolen last night. Who do I call first?",
    "Help me explain to my mother, Grace Okafor, that I am moving to Nairobi in August.",
    "My employee ID is 55-2093 at Contoso and HR lost my sick note from 14 February. What now?",
    "I'm Yuki Tanaka, 29, and I want to quit smoking after ten years. Give me a plan.",
    "Write a thank-you card to Dr. Ahmed Hassan for treating my father's kidney stones.",
    "My landlord in Bristol, Linda Green, kept my 900 pound deposit. How do I get it back?",
    "I'm Noah Schmidt and my visa for Munich expires on 30 June. Draft a letter to the immigration office.",
    "Our baby, Mia Johansson, was born on 8 January at 3.2 kg. Announce it to our family.",
    "I'm Ben Taylor, I owe 4,000 on my student loan and just lost my job in Cardiff. Any advice?",
    "Describe my symptoms for the doctor: Laura Meyer, 51, migraines every morning since January.",
)
# Public prompts with nothing personal in them, for Cape's logit bound B.
CALIBRATION_PROMPTS: tuple[str, ...] = (
    "What is the capital of France?", "Write a short poem about the sea.",
    "Summarise this report in three sentences.", "How do I bake bread at home?",
    "Translate 'good morning' into Spanish.", "Explain photosynthesis to a child.",
    "Draft a polite email declining a meeting invitation.", "What are good habits for better sleep?",
)


@dataclass(kw_only=True)
class ChatBenchSetting:
    """One run's sizes. ``clients``: the numbers of concurrent clients; ``max_tokens``: what serve-llm
    generates per answer; ``stub_chunks``: content chunks of the stub's stream; ``warmup_requests``: sequential
    requests per (path, mode) before timing; ``skip_llm``: measure the stub upstream only; ``int8``: also a
    gateway with ``--device-model-int8``; ``floor_batches``: timed batches of the floor (after one warm-up);
    ``llm_requests_per_client``: serve-llm's, when fewer (its answers take a second each; None: the same)."""

    requests_per_client: int = 8
    clients: tuple[int, ...] = CLIENT_COUNTS
    max_tokens: int = 16
    epsilon: float = 6.0
    seed: int = 0
    stub_chunks: int = 16
    warmup_requests: int = 4
    skip_llm: bool = False
    int8: bool = True
    floor_batches: int = 4
    llm_requests_per_client: int | None = None

    def __post_init__(self) -> None:
        check_positive_int("requests_per_client", self.requests_per_client)
        check_positive_int("floor_batches", self.floor_batches)
        if self.llm_requests_per_client is not None:
            check_positive_int("llm_requests_per_client", self.llm_requests_per_client)
        check_positive_int("max_tokens", self.max_tokens)
        check_positive_int("stub_chunks", self.stub_chunks)
        check_positive_finite("epsilon", self.epsilon)
        if isinstance(self.warmup_requests, bool) or not isinstance(self.warmup_requests, int) \
                or self.warmup_requests < 0:
            raise ValueError(f"warmup_requests must be an integer >= 0, got {self.warmup_requests!r}")
        if not self.clients:
            raise ValueError("clients must name at least one number of concurrent clients")
        for count in self.clients:
            check_positive_int("clients", count)
        self.clients = tuple(self.clients)

    @property
    def gateways(self) -> dict[str, bool]:
        """The gateways measured: path name -> whether its device model is int8."""
        return {GATEWAY: False, **({GATEWAY_INT8: True} if self.int8 else {})}


# ------------------------------------------------------------------------------------------- the stub upstream


def stub_pieces(chunks: int) -> list[str]:
    """:data:`STUB_ANSWER` cut into ``chunks`` non-empty pieces that join back to it."""
    if check_positive_int("chunks", chunks) > len(STUB_ANSWER):
        raise ValueError(f"chunks must be at most {len(STUB_ANSWER)}, the canned answer's length; got {chunks}")
    cuts = np.linspace(0, len(STUB_ANSWER), chunks + 1).round().astype(int)
    return [STUB_ANSWER[a:b] or " " for a, b in itertools.pairwise(cuts)]


def create_stub_upstream(*, chunks: int = 16, model: str = STUB_MODEL) -> FastAPI:
    """An OpenAI-compatible chat API that answers at once: :data:`STUB_ANSWER` as one completion, or as a
    stream of ``chunks`` content chunks (a role chunk first, a ``finish_reason`` chunk and ``[DONE]`` last).

    It parses the request like any upstream (a malformed one is a 400) and ignores what it asks for.
    """
    created = 1_700_000_000
    usage = Usage(prompt_tokens=0, completion_tokens=chunks, total_tokens=chunks)
    whole = ChatCompletion(id="chatcmpl-stub", created=created, model=model, usage=usage, choices=[
        Choice(index=0, message=AssistantMessage(content=STUB_ANSWER), finish_reason="stop")]).model_dump_json()

    def chunk(delta: Delta, finish: Literal["stop"] | None = None) -> bytes:
        return sse_event(ChatCompletionChunk(id="chatcmpl-stub", created=created, model=model, choices=[
            ChunkChoice(index=0, delta=delta, finish_reason=finish)]))

    events = [chunk(Delta(role="assistant", content="")),
              *(chunk(Delta(content=piece)) for piece in stub_pieces(chunks)), chunk(Delta(), "stop"), SSE_DONE]
    stream = b"".join(events)  # one write: no delay between chunks
    router = APIRouter(tags=["chat"])

    @router.post("/v1/chat/completions", response_model=None)
    async def chat_completions(request: ChatCompletionRequest) -> Response:
        if request.stream:
            return StreamingResponse(iter([stream]), media_type="text/event-stream")
        return Response(whole, media_type="application/json")

    return create_service_app(title="privlm stub chat upstream", routers=[catalog_router([ModelEntry(id=model)]),
                                                                          router],
                              auth=BearerKeys(), max_request_bytes=1 << 20, max_in_flight=1024)


def serve_stub(port: int, chunks: int) -> None:
    """Serve :func:`create_stub_upstream` on 127.0.0.1:``port`` until terminated (the stub's own process)."""
    run_service(create_stub_upstream(chunks=chunks), host="127.0.0.1", port=port)


# ------------------------------------------------------------------------------------------------ statistics


def summarize(seconds: Sequence[float]) -> dict[str, float]:
    """p50, p99 and mean of durations in seconds, in milliseconds (numpy's linear-interpolation percentiles)."""
    if not seconds:
        raise ValueError("seconds must hold at least one duration")
    values = np.asarray(seconds, dtype=float) * 1e3
    return {"p50_ms": float(np.percentile(values, 50)), "p99_ms": float(np.percentile(values, 99)),
            "mean_ms": float(values.mean()), "n": int(values.size)}


def requests_per_second(completed: int, wall_s: float) -> float:
    """Throughput: requests answered over the wall time of the whole run."""
    check_positive_finite("wall_s", wall_s)
    return completed / wall_s


@dataclass(frozen=True)
class Timing:
    """One answered request: until the whole answer was read, until its first content (streaming only), and
    the gateway's ``x-privlm-tokens-perturbed`` (None from an upstream)."""

    latency_s: float
    ttft_s: float | None = None
    tokens_perturbed: int | None = None


@dataclass
class LoadResult:
    """What one load run saw: every answered request's timing, the failures, the wall time."""

    clients: int
    requests_per_client: int
    wall_s: float
    timings: list[Timing] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def row(self, *, upstream: str, path: str, mode: str) -> dict[str, Any]:
        """The figures of this run, as results.json and results.md show them."""
        perturbed = [t.tokens_perturbed for t in self.timings if t.tokens_perturbed is not None]
        ttfts = [t.ttft_s for t in self.timings if t.ttft_s is not None]
        return {
            "upstream": upstream, "path": path, "mode": mode, "clients": self.clients,
            "requests_per_client": self.requests_per_client, "answered": len(self.timings),
            "errors": len(self.errors), "first_error": self.errors[0] if self.errors else None,
            "wall_s": self.wall_s, "requests_per_s": requests_per_second(len(self.timings), self.wall_s),
            "latency": summarize([t.latency_s for t in self.timings]) if self.timings else None,
            "ttft": summarize(ttfts) if ttfts else None,
            "mean_tokens_perturbed": float(np.mean(perturbed)) if perturbed else None,
        }


def added(direct: Mapping[str, Any], gateway: Mapping[str, Any]) -> dict[str, Any]:
    """The gateway's row against the direct one at the same load: added p50/p99 latency and TTFT (ms), and its
    throughput as a fraction of the direct throughput."""
    def delta(metric: str, stat: str) -> float | None:
        if direct.get(metric) is None or gateway.get(metric) is None:
            return None
        return float(gateway[metric][stat] - direct[metric][stat])

    return {"upstream": direct["upstream"], "path": gateway["path"], "mode": direct["mode"],
            "clients": direct["clients"], "added_latency_p50_ms": delta("latency", "p50_ms"),
            "added_latency_p99_ms": delta("latency", "p99_ms"),
            "added_ttft_p50_ms": delta("ttft", "p50_ms"), "added_ttft_p99_ms": delta("ttft", "p99_ms"),
            "throughput_fraction": (gateway["requests_per_s"] / direct["requests_per_s"]
                                    if direct["requests_per_s"] > 0 else None)}


def comparisons(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """:func:`added` for every gateway row whose (upstream, mode, clients) was measured directly too."""
    by_key = {(r["upstream"], r["mode"], r["clients"], r["path"]): r for r in rows}
    return [added(by_key[(*key, DIRECT)], r) for r in rows
            if r["path"] != DIRECT and (key := (r["upstream"], r["mode"], r["clients"])) + (DIRECT,) in by_key]


def throughput(rows: Sequence[Mapping[str, Any]], floors: Mapping[str, Mapping[str, Any]], *,
               upstream: str = "stub") -> list[dict[str, Any]]:
    """Per gateway path and mode against ``upstream``: the floor, the throughput at every number of clients, its
    ratio to the floor at :data:`FLOOR_BATCH` clients, and the added latency (p50, p99) at every load."""
    added_by = {(c["path"], c["mode"], c["clients"]): c for c in comparisons(rows) if c["upstream"] == upstream}
    summary = []
    for path, floor in floors.items():
        for mode in MODES:
            measured = {r["clients"]: r for r in rows
                        if r["upstream"] == upstream and r["path"] == path and r["mode"] == mode}
            if not measured:
                continue
            at_batch = measured.get(FLOOR_BATCH)
            summary.append({
                "path": path, "mode": mode, "floor_requests_per_s": floor["requests_per_s"],
                "single_requests_per_s": floor["single_requests_per_s"],
                "requests_per_s": {str(n): r["requests_per_s"] for n, r in sorted(measured.items())},
                "ratio_to_floor": (None if at_batch is None
                                   else at_batch["requests_per_s"] / floor["requests_per_s"]),
                "added_latency_ms": {str(n): {"p50": added_by[(path, mode, n)]["added_latency_p50_ms"],
                                              "p99": added_by[(path, mode, n)]["added_latency_p99_ms"]}
                                     for n in sorted(measured) if (path, mode, n) in added_by}})
    return summary


# ----------------------------------------------------------------------------------------------- one request


def chat_body(model: str, prompt: str, *, max_tokens: int, stream: bool) -> dict[str, Any]:
    """A one-message chat request: greedy, ``max_tokens`` at most."""
    return {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0.0, "stream": stream}


def _perturbed(headers: httpx.Headers) -> int | None:
    value = headers.get("x-privlm-tokens-perturbed")
    return int(value) if value is not None and value.isdigit() else None


def _failure(response: httpx.Response, body: bytes) -> RuntimeError:
    """A non-200 answer: its status and the error's message (the gateway's messages never hold the prompt)."""
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = body[:200].decode("utf-8", "replace")
    return RuntimeError(f"HTTP {response.status_code}: {message}")


async def complete(http: httpx.AsyncClient, body: Mapping[str, Any]) -> Timing:
    """POST a non-streaming chat request and read the whole answer; a non-200 or an empty answer raises."""
    started = time.perf_counter()
    response = await http.post("/v1/chat/completions", json=dict(body))
    latency = time.perf_counter() - started
    if response.status_code != 200:
        raise _failure(response, response.content)
    content = response.json()["choices"][0]["message"]["content"]
    if not isinstance(content, str) or not content:
        raise RuntimeError("the answer held no content")
    return Timing(latency, tokens_perturbed=_perturbed(response.headers))


def sse_content(line: str) -> str | None:
    """The content of one SSE ``data:`` line of a chat stream ("" for a chunk without content, None for
    ``[DONE]`` and for lines that are no data)."""
    if not line.startswith("data:"):
        return None
    data = line[len("data:"):].strip()
    if data == "[DONE]":
        return None
    choices = json.loads(data).get("choices") or [{}]
    content = (choices[0].get("delta") or {}).get("content")
    return content if isinstance(content, str) else ""


async def complete_streaming(http: httpx.AsyncClient, body: Mapping[str, Any]) -> Timing:
    """POST a streaming chat request and read it to ``[DONE]``; TTFT is the first chunk with content."""
    started = time.perf_counter()
    ttft: float | None = None
    done = False
    async with http.stream("POST", "/v1/chat/completions", json=dict(body)) as response:
        if response.status_code != 200:
            raise _failure(response, await response.aread())
        async for line in response.aiter_lines():
            if line.strip() == "data: [DONE]":
                done = True
            elif ttft is None and sse_content(line):
                ttft = time.perf_counter() - started
        perturbed = _perturbed(response.headers)
    latency = time.perf_counter() - started
    if ttft is None or not done:
        raise RuntimeError("the stream held no content" if ttft is None else "the stream ended without [DONE]")
    return Timing(latency, ttft, perturbed)


# ------------------------------------------------------------------------------------------------------ load

Send = Callable[[httpx.AsyncClient, int, int], Awaitable[Timing]]


async def run_load(base_url: str, send: Send, *, clients: int, requests_per_client: int,
                   on_response: Callable[[httpx.Response], Awaitable[None]] | None = None) -> LoadResult:
    """``clients`` concurrent clients, each its own connection, each ``requests_per_client`` requests in turn
    (``send(http, client, k)``). Connections are opened (``GET /health``) before the clock starts. A failed
    request is recorded and the client goes on. ``on_response``: called with every answer's head (its headers)."""
    hooks = {"response": [on_response]} if on_response is not None else None
    https = [httpx.AsyncClient(base_url=base_url, timeout=TIMEOUT_S, limits=httpx.Limits(max_connections=1),
                               event_hooks=hooks) for _ in range(clients)]
    result = LoadResult(clients=clients, requests_per_client=requests_per_client, wall_s=0.0)
    try:
        await asyncio.gather(*(http.get("/health") for http in https))

        async def client(index: int) -> None:
            for k in range(requests_per_client):
                try:
                    result.timings.append(await send(https[index], index, k))
                except (httpx.HTTPError, RuntimeError, ValueError, KeyError) as error:
                    result.errors.append(f"{type(error).__name__}: {error}")

        started = time.perf_counter()
        await asyncio.gather(*(client(i) for i in range(clients)))
        result.wall_s = time.perf_counter() - started
    finally:
        for http in https:
            await http.aclose()
    return result


def prompt_order(seed: int, n: int) -> list[int]:
    """A seeded permutation of the prompts' indices: request ``r`` of a run carries prompt ``order[r % n]``."""
    return [int(i) for i in torch.randperm(n, generator=make_generator(seed))]


async def first_model(base_url: str) -> str:
    """The first model id an OpenAI-compatible server lists at ``GET /v1/models``."""
    async with httpx.AsyncClient(base_url=base_url, timeout=30) as http:
        response = await http.get("/v1/models")
        response.raise_for_status()
        return str(response.json()["data"][0]["id"])


async def measure_upstream(upstream: str, urls: Mapping[str, str], setting: ChatBenchSetting,
                           prompts: Sequence[str] = PROMPTS, *, log: Callable[[str], None] = lambda _: None,
                           before: Callable[[int, Mode], None] | None = None) -> list[dict[str, Any]]:
    """Rows for ``upstream`` on every path of ``urls`` (``{"direct": ..., "gateway": ...}``), mode and number of
    clients. Paths alternate within each (clients, mode), so that a change of load on the machine hits both;
    ``before(clients, mode)`` runs before each (clients, mode) (the floor's measurements)."""
    model = await first_model(urls["direct"])
    order = prompt_order(setting.seed, len(prompts))

    def sender(mode: Mode) -> Send:
        call = complete_streaming if mode == "streaming" else complete

        async def send(http: httpx.AsyncClient, client: int, k: int) -> Timing:
            prompt = prompts[order[(client * setting.requests_per_client + k) % len(prompts)]]
            return await call(http, chat_body(model, prompt, max_tokens=setting.max_tokens,
                                              stream=mode == "streaming"))
        return send

    if setting.warmup_requests:
        for mode in MODES:
            for path, url in urls.items():
                log(f"{upstream}: warm-up, {path}, {mode}")
                warm = await run_load(url, sender(mode), clients=1, requests_per_client=setting.warmup_requests)
                if not warm.timings:
                    raise RuntimeError(f"{upstream} {path} answered no warm-up request: {warm.errors[0]}")
    rows = []
    for clients in setting.clients:
        for mode in MODES:
            if before is not None:
                before(clients, mode)
            for path, url in urls.items():
                log(f"{upstream}: {clients} clients, {path}, {mode}")
                result = await run_load(url, sender(mode), clients=clients,
                                        requests_per_client=setting.requests_per_client)
                rows.append(result.row(upstream=upstream, path=path, mode=mode))
    return rows


# ------------------------------------------------------------------------------------------------- processes


def child_env() -> dict[str, str]:
    """This environment without the variables privlm reads API keys from (the services here run open)."""
    return {name: value for name, value in os.environ.items() if name not in KEY_ENV_VARS}


def start_stub(port: int, chunks: int, *, timeout: float = 60.0) -> subprocess.Popen[bytes]:
    """:func:`serve_stub` in its own Python process; returns once ``/health`` answers 200."""
    code = f"from privlm_bench.chat.load import serve_stub; serve_stub({int(port)}, {int(chunks)})"
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               env=child_env())
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the stub upstream exited with code {process.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1.0).status_code == 200:
                return process
        except httpx.TransportError:
            time.sleep(0.2)
    stop(process)
    raise RuntimeError(f"the stub upstream did not answer within {timeout:.0f} s")


def serve_llm_args(port: int) -> list[str]:
    return ["serve-llm", "--port", str(port)]


def gateway_args(port: int, upstream_url: str, *, epsilon: float, logit_bound: Path, max_in_flight: int,
                 int8: bool = False) -> list[str]:
    """``privlm gateway`` in front of ``upstream_url``: Cape at ``epsilon`` per token, open on loopback; with
    ``int8``, its device model int8 on the CPU."""
    return ["gateway", "--chat-upstream", upstream_url, "--mechanism", "cape", "--epsilon", f"{epsilon:g}",
            "--logit-bound", str(logit_bound), "--max-in-flight", str(max_in_flight), "--port", str(port),
            "--chat-memory", "off",  # every request perturbed afresh: the cost measured is the perturbation's
            *(["--device-model-int8", "--device", "cpu"] if int8 else [])]


def calibrate_bound(path: Path, model: LanguageModel | None = None) -> dict[str, Any]:
    """Cape's logit bound B on ``model`` (default: SmolLM2 on the CPU) from :data:`CALIBRATION_PROMPTS`, saved at
    ``path`` for the gateway."""
    from privlm.cape import Cape

    model = model or LanguageModel.from_pretrained("smollm2", device="cpu")
    bound = Cape(model, epsilon=1.0).calibrate(list(CALIBRATION_PROMPTS))
    bound.save(path)
    return {"value": bound.value, "n_texts": bound.n_texts, "n_logits": bound.n_logits,
            "model_fingerprint": bound.model_fingerprint, "int8": model.quantized}


def time_floor(privacy: PromptPrivacy, prompts: Sequence[str], *, batch: int = FLOOR_BATCH, batches: int = 4
               ) -> tuple[list[float], list[float]]:
    """Seconds of ``batches`` batches of ``batch`` one-prompt requests through ``privacy`` (consecutive
    ``prompts``, cycling), each one :meth:`PromptPrivacy.privatize_many` call, after one warm-up batch; then of the
    first ``batch`` prompts one request at a time."""
    def timed(texts: Sequence[str]) -> float:
        started = time.perf_counter()
        outcomes = privacy.privatize_many([PrivacyRequest((text,), "bench") for text in texts])
        seconds = time.perf_counter() - started
        failed = [o for o in outcomes if isinstance(o, Exception)]
        if failed:
            raise RuntimeError(f"the floor's privacy step failed: {failed[0]}")
        return seconds

    def cut(k: int) -> list[str]:
        return [prompts[(k * batch + i) % len(prompts)] for i in range(batch)]

    timed(cut(0))  # warm-up
    batch_s = [timed(cut(k)) for k in range(batches)]
    return batch_s, [timed([text]) for text in cut(0)]


def floor_figures(batch_s: Sequence[float], single_s: Sequence[float], *, batch: int = FLOOR_BATCH
                  ) -> dict[str, Any]:
    """The floor from its timings: medians, and requests/s batched and one at a time."""
    median_batch, median_single = float(np.median(batch_s)), float(np.median(single_s))
    return {"batch": batch, "batch_s": list(batch_s), "median_batch_s": median_batch,
            "requests_per_s": batch / median_batch, "single_s": list(single_s), "median_single_s": median_single,
            "single_requests_per_s": 1 / median_single, "batch_speedup": median_single * batch / median_batch}


def measure_floor(privacy: PromptPrivacy, prompts: Sequence[str], *, batch: int = FLOOR_BATCH, batches: int = 4
                  ) -> dict[str, Any]:
    """:func:`time_floor` once, and its :func:`floor_figures`."""
    batch_s, single_s = time_floor(privacy, prompts, batch=batch, batches=batches)
    return floor_figures(batch_s, single_s, batch=batch)


@dataclass
class Floors:
    """The floor of every gateway path, measured several times in a run (at its start, then just before each of
    the stub's rows at :data:`FLOOR_BATCH` clients, so that it sees what load the machine had then); the figures
    pool every timing."""

    privacies: dict[str, PromptPrivacy]
    prompts: list[str]
    batches: int
    timings: dict[str, tuple[list[float], list[float]]] = field(default_factory=dict)
    measured_at: list[str] = field(default_factory=list)

    def measure(self, when: str, log: Callable[[str], None]) -> None:
        for path, privacy in self.privacies.items():
            log(f"{path}: measuring the floor ({when}: batches of {FLOOR_BATCH} prompts through Cape)")
            batch_s, single_s = time_floor(privacy, self.prompts, batches=self.batches)
            pooled = self.timings.setdefault(path, ([], []))
            pooled[0].extend(batch_s)
            pooled[1].extend(single_s)
        self.measured_at.append(when)

    def figures(self) -> dict[str, Any]:
        return {path: {**floor_figures(*timings), "measured": list(self.measured_at)}
                for path, timings in self.timings.items()}


def prepare_device_models(folder: Path, setting: ChatBenchSetting, log: Callable[[str], None]
                          ) -> tuple[dict[str, Path], dict[str, Any], Floors]:
    """Per gateway path (:attr:`ChatBenchSetting.gateways`): B calibrated on its own device model (the int8 one for
    the int8 gateway) and saved for it, and the privacy step its floor is measured through (measured once now).
    Returns the bounds' paths, their figures, the floors."""
    fp32 = LanguageModel.from_pretrained("smollm2", device="cpu")
    order = prompt_order(setting.seed, len(PROMPTS))
    paths, bounds, privacies = {}, {}, {}
    for path, int8 in setting.gateways.items():
        model = fp32.quantize_int8() if int8 else fp32
        paths[path] = folder / f"logit_bound-{path}.json"
        log(f"{path}: calibrating Cape's logit bound on public prompts")
        bounds[path] = calibrate_bound(paths[path], model)
        privacies[path] = PromptPrivacy.cape(model, epsilon=setting.epsilon, logit_bound=bounds[path]["value"])
    floors = Floors(privacies, [PROMPTS[i] for i in order], setting.floor_batches)
    floors.measure("at the start", log)
    return paths, bounds, floors


@contextmanager
def running(args: list[str], health_url: str) -> Iterator[subprocess.Popen[bytes]]:
    """``privlm ARGS`` in its own process while the block runs."""
    process = start_privlm(args, health_url, timeout=180.0, env=child_env())
    try:
        yield process
    finally:
        stop(process)


def _measure_through_gateways(upstream: str, upstream_url: str, setting: ChatBenchSetting, bounds: Mapping[str, Path],
                              log: Callable[[str], None], before: Callable[[int, Mode], None] | None = None
                              ) -> tuple[list[dict[str, Any]], dict[str, list[str]]]:
    """Start every gateway in front of ``upstream_url``, measure every path, stop the gateways."""
    urls, commands = {DIRECT: upstream_url}, {}
    with ExitStack() as stack:
        for path, int8 in setting.gateways.items():
            port = free_port()
            args = gateway_args(port, upstream_url, epsilon=setting.epsilon, logit_bound=bounds[path],
                                max_in_flight=max(32, 2 * max(setting.clients)), int8=int8)
            log(f"{upstream}: starting privlm gateway ({path})")
            stack.enter_context(running(args, f"http://127.0.0.1:{port}/health"))
            urls[path], commands[f"{path} ({upstream})"] = f"http://127.0.0.1:{port}", ["privlm", *args]
        rows = asyncio.run(measure_upstream(upstream, urls, setting, log=log, before=before))
    return rows, commands


def run_chat_bench(setting: ChatBenchSetting, out_dir: Path, console: Console) -> list[Path]:
    """The whole benchmark: the stub upstream, then serve-llm (unless ``skip_llm``), each directly and through
    its own gateway. Writes results.json and results.md in ``out_dir``, prints the tables, returns the files."""
    meta = provenance(seed=setting.seed)
    load_at_start = os.getloadavg()  # others' work on this machine shows in every figure

    def log(message: str) -> None:
        console.log(message, highlight=False)

    rows: list[dict[str, Any]] = []
    commands: dict[str, list[str]] = {}
    with tempfile.TemporaryDirectory(prefix="privlm-chat-bench-") as folder, ExitStack() as stack:
        bound_paths, bounds, floors = prepare_device_models(Path(folder), setting, log)
        stub_port = free_port()
        stub = start_stub(stub_port, setting.stub_chunks)
        stack.callback(stop, stub)
        commands["stub"] = [sys.executable, "-c", f"serve_stub({stub_port}, {setting.stub_chunks})"]

        def floor_again(clients: int, mode: Mode) -> None:
            if clients == FLOOR_BATCH:
                floors.measure(f"before the {clients}-client {mode} rows", log)

        stub_rows, gateways = _measure_through_gateways("stub", f"http://127.0.0.1:{stub_port}", setting,
                                                        bound_paths, log, before=floor_again)
        rows += stub_rows
        commands |= gateways
        stack.close()
        if not setting.skip_llm:
            llm_port = free_port()
            log("starting privlm serve-llm")
            commands["serve-llm"] = ["privlm", *serve_llm_args(llm_port)]
            llm_setting = replace(setting, requests_per_client=setting.llm_requests_per_client
                                  or setting.requests_per_client)
            with running(serve_llm_args(llm_port), f"http://127.0.0.1:{llm_port}/health"):
                llm_rows, gateways = _measure_through_gateways("serve-llm", f"http://127.0.0.1:{llm_port}",
                                                               llm_setting, bound_paths, log)
            rows += llm_rows
            commands |= gateways
    payload = chat_results(setting, rows, meta=meta, logit_bound=bounds, commands=commands, floors=floors.figures())
    payload["environment"]["load_average"] = {"start": list(load_at_start), "end": list(os.getloadavg())}
    files = write_chat_report(out_dir, payload)
    console.print(files[1].read_text(), markup=False, highlight=False)
    return files


# ---------------------------------------------------------------------------------------------------- report


def chat_results(setting: ChatBenchSetting, rows: Sequence[Mapping[str, Any]], *, meta: Mapping[str, object],
                 logit_bound: Mapping[str, Any] | None = None, commands: Mapping[str, list[str]] | None = None,
                 prompts: Sequence[str] = PROMPTS, floors: Mapping[str, Mapping[str, Any]] | None = None
                 ) -> dict[str, Any]:
    """results.json's content: provenance, the setting, the environment, every row, the comparisons, the floors
    and the throughput against them. ``logit_bound`` and ``floors``: per gateway path."""
    return {
        "metadata": {**meta, "sweep": "chat"},
        "setting": asdict(setting),
        "environment": {"cpu_count": os.cpu_count(), "thread_variables": {
            name: os.environ.get(name) for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "TORCH_NUM_THREADS")},
            "note": "stub, serve-llm, gateway and clients are separate processes on this one machine"},
        "gateway": {"mechanism": "cape", "epsilon_per_token": setting.epsilon, "logit_bound": logit_bound,
                    "device_model": "smollm2", "paths": setting.gateways},
        "commands": dict(commands or {}),
        "prompts": list(prompts),
        "rows": [dict(r) for r in rows],
        "comparisons": comparisons(rows),
        "floors": dict(floors or {}),
        "throughput": throughput(rows, floors or {}),
    }


def write_chat_report(out_dir: Path, payload: Mapping[str, Any]) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(payload, indent=2) + "\n")
    (out_dir / "results.md").write_text(chat_markdown(payload))
    return [out_dir / "results.json", out_dir / "results.md"]


def _loads(values: Sequence[float]) -> str:
    return "/".join(f"{value:.2f}" for value in values)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _stat(row: Mapping[str, Any], metric: str, stat: str) -> str:
    figures = row.get(metric)
    return "-" if figures is None else f"{figures[stat]:.1f}"


def _throughput_lines(payload: Mapping[str, Any]) -> list[str]:
    """The gateway's throughput against the floor (stub upstream), and its added latency, per path and mode."""
    summary, floors = payload.get("throughput") or [], payload.get("floors") or {}
    if not summary:
        return []
    first: Mapping[str, Any] = next(iter(floors.values()), {})
    counts = sorted({int(n) for t in summary for n in t["requests_per_s"]})
    lines = ["## Throughput against the floor (stub upstream)", "",
             f"The floor: the device model's own throughput through Cape on batches of {FLOOR_BATCH} of these prompts "
             "(one `PromptPrivacy.privatize_many` call per batch, as the gateway runs a batch), measured in this "
             "process while the gateways were idle: "
             + "; ".join(first.get("measured", []))
             + " (every timing pooled); beside it, the same prompts one at a time.", "",
             f"| path | floor: a batch of {FLOOR_BATCH}, s (median) | floor, requests/s | one at a time, requests/s "
             "| batch speed-up |",
             "|---|---|---|---|---|"]
    for path, floor in floors.items():
        lines.append(f"| {path} | {floor['median_batch_s']:.3f} (of {len(floor['batch_s'])}: "
                     f"{min(floor['batch_s']):.3f} to {max(floor['batch_s']):.3f}) | {floor['requests_per_s']:.2f} | "
                     f"{floor['single_requests_per_s']:.2f} | {floor['batch_speedup']:.2f} |")
    lines += ["", f"| path | mode | {' | '.join(f'{n} clients, requests/s' for n in counts)} | "
                  f"{FLOOR_BATCH} clients / floor | {' | '.join(f'added p50 / p99 at {n}, ms' for n in counts)} |",
              "|---" * (3 + 2 * len(counts)) + "|"]
    for t in summary:
        rates = " | ".join(f"{t['requests_per_s'][str(n)]:.2f}" if str(n) in t["requests_per_s"] else "-"
                           for n in counts)
        ratio = "-" if t["ratio_to_floor"] is None else f"{t['ratio_to_floor']:.2f}"
        added_ms = t["added_latency_ms"]
        latency = " | ".join(f"{_ms(added_ms[str(n)]['p50'])} / {_ms(added_ms[str(n)]['p99'])}"
                             if str(n) in added_ms else "-" for n in counts)
        lines.append(f"| {t['path']} | {t['mode']} | {rates} | {ratio} | {latency} |")
    return [*lines, ""]


def chat_markdown(payload: Mapping[str, Any]) -> str:
    """results.md: the gateway's added latency and TTFT, throughput side by side, then every row."""
    meta, setting = payload["metadata"], payload["setting"]
    machine = meta.get("machine", {})
    lines = ["# `privlm gateway` in front of a chat API (localhost)", "",
             f"- command: `{meta.get('command')}`", f"- git commit: `{meta.get('git_commit')}`",
             f"- machine: {machine.get('cpu_count')} CPUs, torch threads {machine.get('torch_threads')}, "
             f"{machine.get('platform')}; thread variables {payload['environment']['thread_variables']}",
             *([f"- load average (1, 5, 15 min) at the start {_loads(load['start'])} (other work on this machine), at "
                f"the end {_loads(load['end'])} (the run's own processes too)"]
               if (load := payload["environment"].get("load_average")) else []),
             f"- seed {meta.get('seed')}; Cape on SmolLM2 at epsilon {setting['epsilon']:g} per token; "
             f"{setting['requests_per_client']} requests per client"
             + (f" ({setting['llm_requests_per_client']} against serve-llm)"
                if setting.get("llm_requests_per_client") else "")
             + f" after {setting['warmup_requests']} warm-up "
             f"requests; max_tokens {setting['max_tokens']} (serve-llm, greedy); the stub streams "
             f"{setting['stub_chunks']} content chunks",
             f"- paths: `direct` (the upstream itself), `{GATEWAY}` (`privlm gateway`, fp32 device model)"
             + (f", `{GATEWAY_INT8}` (`--device-model-int8`, B calibrated on the int8 model)"
                if setting.get("int8", False) else ""), ""]
    lines += _throughput_lines(payload)
    lines += ["## Added by the gateway (gateway minus direct, ms)", "",
              "| upstream | mode | clients | path | latency p50 | latency p99 | TTFT p50 | TTFT p99 | throughput "
              "fraction |", "|---|---|---|---|---|---|---|---|---|"]
    for c in payload["comparisons"]:
        fraction = "-" if c["throughput_fraction"] is None else f"{c['throughput_fraction']:.2f}"
        lines.append(f"| {c['upstream']} | {c['mode']} | {c['clients']} | {c.get('path', GATEWAY)} | "
                     f"{_ms(c['added_latency_p50_ms'])} | "
                     f"{_ms(c['added_latency_p99_ms'])} | {_ms(c['added_ttft_p50_ms'])} | "
                     f"{_ms(c['added_ttft_p99_ms'])} | {fraction} |")
    lines += ["", "## Every run", "",
              "| upstream | path | mode | clients | requests/s | latency p50 ms | latency p99 ms | TTFT p50 ms | "
              "TTFT p99 ms | answered | errors | tokens perturbed |", "|---" * 12 + "|"]
    for r in payload["rows"]:
        perturbed = "-" if r["mean_tokens_perturbed"] is None else f"{r['mean_tokens_perturbed']:.1f}"
        lines.append(f"| {r['upstream']} | {r['path']} | {r['mode']} | {r['clients']} | {r['requests_per_s']:.2f} | "
                     f"{_stat(r, 'latency', 'p50_ms')} | {_stat(r, 'latency', 'p99_ms')} | "
                     f"{_stat(r, 'ttft', 'p50_ms')} | {_stat(r, 'ttft', 'p99_ms')} | {r['answered']} | "
                     f"{r['errors']} | {perturbed} |")
    failures = [r for r in payload["rows"] if r["errors"]]
    if failures:
        lines += ["", "First error of each run with errors:", ""]
        lines += [f"- {r['upstream']} {r['path']} {r['mode']} {r['clients']} clients: {r['first_error']}"
                  for r in failures]
    lines += ["", "Latency: until the whole answer was read. TTFT: until the first chunk with content. "
                  "Throughput: answered requests over the run's wall time. Clients, gateway and upstream share "
                  "the machine's CPUs, so at high concurrency they compete with one another."]
    return "\n".join(lines) + "\n"
