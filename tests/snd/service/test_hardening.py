"""Issue 10: the SnD server, client and gateway attacked by a hostile server, hostile clients and long
outages. Each test reproduces one finding against real servers on localhost and names it."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import torch
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, RedirectResponse, Response, StreamingResponse

from privlm.models import SplitModel
from privlm.service import BearerKeys, FairScheduler, RequestRefusedError, RetryPolicy, ServerError, create_service_app
from privlm.service.bundle import MANIFEST_LIMIT
from privlm.settings.gateway import MAX_REQUEST_TOKENS
from privlm.snd import Client, ClientOptions, Encoded, EncodeReport, IncompleteEncodingError, ModelChangedError
from privlm.snd.service.bundle import BUNDLE_PATH, is_snd_bundle_file, snd_bundle
from privlm.snd.service.server import create_app
from privlm.wire import MODEL_FINGERPRINT_HEADER, read_rows, write_rows, write_sequences
from tests.models.tiny import tiny_bert_folder
from tests.service.localhost import serving
from tests.support.gateway import embeddings_app

TEXTS = ["the cat sat", "a dog", "the mat", "a cat sat on the mat", "the dog sat", "a mat"]
MODEL = "privlm-snd-model"  # the gateway's id for a model loaded from a folder named "model"


class Upstream:
    """ASGI wrapper of a real server whose encode route can be swapped at run time: ``encode`` is None
    (the real server), or an ASGI app that answers in its place (an outage, another model, a liar)."""

    def __init__(self, app) -> None:
        self.app, self.encode, self.encodes = app, None, 0

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] == "/v1/snd/encode":
            self.encodes += 1
            if self.encode is not None:
                await self.encode(scope, receive, send)
                return
        await self.app(scope, receive, send)


def answering(status: int, body: dict | None = None) -> Callable:
    async def app(scope, receive, send) -> None:
        await JSONResponse(body or {"error": {"message": "down", "type": "server_error"}}, status)(scope, receive, send)
    return app


# --- finding 1: a malicious server writes files anywhere ---------------------------------------------------
def hostile_bundle_app(model: SplitModel, rename: dict[str, str], *, denoiser: str | None = None,
                       extra: Callable[[dict], None] = lambda manifest: None) -> FastAPI:
    """A server that offers the real bundle with some file names replaced (and any other manifest edit)."""
    bundle = snd_bundle(model, [])
    manifest = bundle.manifest()
    for entry in manifest["files"]:
        entry["name"] = rename.get(entry["name"], entry["name"])
    if denoiser is not None:
        manifest["denoisers"] = [{"name": denoiser, "eta_range": [1, 100], "variant": "snd", "fingerprint": "x"}]
    extra(manifest)
    contents = {rename.get(name, name): file.content for name, file in bundle.files.items()}
    app = FastAPI()

    @app.get(BUNDLE_PATH)
    async def served_manifest() -> dict:
        return manifest

    @app.get(BUNDLE_PATH + "/files/{name:path}")
    async def served_file(name: str) -> Response:
        return Response(contents.get(name, b""))

    return app


@pytest.mark.parametrize("name", ["../../escaped.pth", "/tmp/privlm-escaped.pth", "tokenizer/../../../escaped.pth",
                                  "..", "a\\..\\..\\escaped.pth", "./model.json"])
def test_finding_1_a_hostile_bundle_cannot_write_outside_the_cache(tiny_bert, tmp_path, name):
    cache = tmp_path / "cache"
    app = hostile_bundle_app(tiny_bert, {"model.json": name})
    with serving(app) as url, pytest.raises(ServerError, match="plain relative name"):
        Client(url, eta=5.0, device="cpu", denoiser=None, cache_dir=cache)
    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert all(p.is_relative_to(cache) for p in written)
    assert not Path("/tmp/privlm-escaped.pth").exists()


def test_finding_1_a_hostile_denoiser_name_is_refused(tiny_bert, tmp_path):
    with serving(hostile_bundle_app(tiny_bert, {}, denoiser="../../../etc")) as url, \
            pytest.raises(ServerError, match="plain relative name"):
        Client(url, eta=5.0, device="cpu", denoiser="auto", cache_dir=tmp_path / "cache")


def test_finding_1_a_malformed_denoiser_offer_is_a_server_error(tiny_bert, tmp_path):
    def odd_range(manifest: dict) -> None:
        manifest["denoisers"] = [{"name": "d", "variant": "snd", "eta_range": "all of them"}]
    with (serving(hostile_bundle_app(tiny_bert, {}, extra=odd_range)) as url,
          pytest.raises(ServerError, match="eta_range")):
        Client(url, eta=5.0, device="cpu", denoiser="auto", cache_dir=tmp_path / "cache")


@pytest.mark.parametrize("edit", [lambda m: m["model"].pop("weights_fingerprint"), lambda m: m.update(extra=1),
                                  lambda m: m["model"].update(dim=-3)], ids=["old-server", "unknown-key", "bad-fact"])
def test_finding_1_a_manifest_that_is_not_an_snd_manifest_is_refused_before_any_file(tiny_bert, tmp_path, edit):
    server = Counting(hostile_bundle_app(tiny_bert, {}, extra=edit))
    with serving(server) as url, pytest.raises(ServerError, match="not a SnDManifest"):
        Client(url, eta=5.0, device="cpu", denoiser=None, cache_dir=tmp_path / "cache")
    assert server.paths == [BUNDLE_PATH]


def test_finding_1_the_snd_bundle_holds_only_the_files_clients_accept(tiny_bert):
    assert all(is_snd_bundle_file(name) for name in snd_bundle(tiny_bert, []).files)
    assert all(is_snd_bundle_file(name) for name in ["denoisers/d/denoiser.safetensors", "denoisers/d/denoiser.json"])
    assert not any(is_snd_bundle_file(name) for name in ["startup/run.py", "a/b/c/d", "evil.pth", "tokenizer",
                                                         "tokenizer/sub/x.json", "denoisers/d/run.py",
                                                         "denoisers/denoiser.json", "tokenizer/../x", "../model.json"])


class Counting:
    """An ASGI wrapper that records the path of every request, and can stream an endless body for one path,
    counting the bytes it hands to the server (paced, so socket buffers hold little of it). "Endless" stops
    at ``STOP`` bytes, so that a client that reads it all fails the test instead of hanging it."""

    CHUNK, STOP = 64 << 10, 64 << 20

    def __init__(self, app, endless: str | None = None, head: bytes = b"") -> None:
        self.app, self.endless, self.head = app, endless, head
        self.paths: list[str] = []
        self.served = 0

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            self.paths.append(scope["path"])
            if scope["path"] == self.endless:
                await StreamingResponse(self.body(), media_type="application/json")(scope, receive, send)
                return
        await self.app(scope, receive, send)

    async def body(self):
        self.served += len(self.head)
        yield self.head
        while self.served < self.STOP:
            self.served += self.CHUNK
            yield b" " * self.CHUNK
            await asyncio.sleep(0.002)


@pytest.mark.parametrize("name", ["startup/run.py", "a/b/c/d", "evil.pth", "tokenizer/sub/x.json",
                                  "denoisers/d/run.py"])
def test_finding_1_a_well_formed_but_unexpected_file_is_refused_before_anything_is_written(tiny_bert, tmp_path, name):
    def plant(manifest: dict) -> None:
        manifest["files"].append({"name": name, "sha256": "0" * 64, "size": 9})
    server = Counting(hostile_bundle_app(tiny_bert, {}, extra=plant))
    with serving(server) as url, pytest.raises(ServerError, match="not a file this kind of bundle holds"):
        Client(url, eta=5.0, device="cpu", denoiser=None, cache_dir=tmp_path / "cache")
    assert server.paths == [BUNDLE_PATH]  # the manifest only: no file was fetched
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]


def test_finding_1_an_endless_bundle_file_is_cut_at_its_declared_size(tiny_bert, tmp_path):
    declared = len(snd_bundle(tiny_bert, []).files["embeddings.safetensors"].content)
    server = Counting(hostile_bundle_app(tiny_bert, {}), endless=f"{BUNDLE_PATH}/files/embeddings.safetensors")
    started = time.monotonic()
    with serving(server) as url, pytest.raises(ServerError, match=f"limit of {declared} bytes"):
        Client(url, eta=5.0, device="cpu", denoiser=None, cache_dir=tmp_path / "cache")
    assert time.monotonic() - started < 20
    assert server.served <= declared + 4 * Counting.CHUNK  # what it read, one chunk, and a little in flight
    assert not (tmp_path / "cache").exists() or not list((tmp_path / "cache").rglob("embeddings.safetensors"))


def test_finding_1_an_endless_manifest_is_refused_at_its_cap(tiny_bert, tmp_path):
    server = Counting(hostile_bundle_app(tiny_bert, {}), endless=BUNDLE_PATH, head=b'{"files": [')
    with serving(server) as url, pytest.raises(ServerError, match=f"limit of {MANIFEST_LIMIT} bytes"):
        Client(url, eta=5.0, device="cpu", denoiser=None, cache_dir=tmp_path / "cache")
    assert server.served <= MANIFEST_LIMIT + 4 * Counting.CHUNK
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]


# --- finding 2: the manifest's URLs sent the API key to any origin -----------------------------------------
class Recorder:
    """Another origin that records every request that reaches it."""

    def __init__(self) -> None:
        self.requests: list[dict[str, str]] = []
        self.app = FastAPI()

        @self.app.api_route("/{path:path}", methods=["GET", "POST"])
        async def record(request: Request) -> Response:
            self.requests.append(dict(request.headers))
            return Response(b"stolen")


def test_finding_2_the_key_never_travels_to_another_origin(tiny_bert, tmp_path):
    recorder = Recorder()
    with serving(recorder.app) as elsewhere:
        def point_elsewhere(manifest: dict) -> None:
            for entry in manifest["files"]:
                entry["url"] = f"{elsewhere}/steal/{entry['name']}"
        # URLs in the manifest are ignored: files come from the server's own fixed paths
        with serving(hostile_bundle_app(tiny_bert, {}, extra=point_elsewhere)) as url:
            Client(url, eta=5.0, device="cpu", denoiser=None, api_key="secret-key", cache_dir=tmp_path / "a").close()
        # a redirect to another origin is not followed
        redirecting = FastAPI()

        @redirecting.get(BUNDLE_PATH)
        async def moved() -> Response:
            return RedirectResponse(f"{elsewhere}/steal", status_code=307)

        with serving(redirecting) as url, pytest.raises(ServerError, match="redirect"):
            Client(url, eta=5.0, device="cpu", api_key="secret-key", cache_dir=tmp_path / "b",
                   options=ClientOptions(retry_for=2))
    assert recorder.requests == []


# --- finding 3: chunked bodies were read whole before the limit applied ------------------------------------------
def test_finding_3_the_gateway_refuses_a_chunked_body_over_its_limit(gateway):
    """9 MiB of JSON sent chunked (no Content-Length) to the gateway's default 8 MiB limit: a 413 once the
    limit is crossed (the old gateway answered 200). Flat memory: tests/service/test_scaffolding.py."""
    def chunks():
        yield b'{"model": "' + MODEL.encode() + b'", "input": ["'
        for _ in range(9 * 16):
            yield b"word " * (2**16 // 5)
        yield b'"]}'

    answer = httpx.post(f"{gateway[0]}/v1/embeddings", content=chunks(), headers={"content-type": "application/json"},
                        timeout=60)
    assert answer.status_code == 413 and answer.json()["error"]["param"] == "max_request_bytes"


# --- finding 4: a restarted server silently mixed two models -------------------------------------------------
def other_weights(tiny_bert: SplitModel, tmp_path: Path) -> SplitModel:
    """The same embedding rows and config, other transformer weights: the old fingerprint could not tell."""
    other = SplitModel.from_pretrained(tiny_bert_folder(tmp_path / "other" / "model"), device="cpu")
    with torch.no_grad():
        other.model.encoder.layer[0].attention.self.query.weight.add_(0.5)
    return other


def test_finding_4_the_fingerprint_covers_every_weight(tiny_bert, tmp_path):
    other = other_weights(tiny_bert, tmp_path)
    assert other.fingerprint == tiny_bert.fingerprint  # the client-checkable embedding rows are the same
    assert other.weights_fingerprint != tiny_bert.weights_fingerprint


def test_finding_4_a_model_swap_mid_encode_is_refused_and_nothing_mixes(tiny_bert, tmp_path):
    upstream = Upstream(create_app(tiny_bert, denoiser_dirs=[]))
    swapped = create_app(other_weights(tiny_bert, tmp_path), denoiser_dirs=[])
    with serving(upstream) as url, serving(swapped):
        client = Client(url, eta=5.0, device="cpu", denoiser=None, cache_dir=tmp_path / "cache",
                        options=ClientOptions(batch_size=2))
        reference = client.encode(TEXTS)
        assert np.isfinite(reference).all()
        served = upstream.encodes

        async def after_first_batch(scope, receive, send) -> None:  # "restarted with another model"
            await (swapped if upstream.encodes > served + 1 else upstream.app)(scope, receive, send)
        upstream.encode = after_first_batch
        with pytest.raises(IncompleteEncodingError) as failed:
            client.encode(TEXTS)
        client.close()
    error = failed.value
    assert isinstance(error.__cause__, ModelChangedError)
    assert len(error.done) == 2 and len(error.missing) == 4  # one batch from the bundle's model, then refused
    assert np.isfinite(error.encoded.vectors[error.done]).all()
    assert np.isnan(error.encoded.vectors[error.missing]).all()  # no row from the other model


def test_finding_4_every_encode_answer_names_its_weights(tiny_bert):
    with serving(create_app(tiny_bert, denoiser_dirs=[])) as url:
        body, headers = write_sequences(torch.randn(1, 3, tiny_bert.hidden_size), torch.ones(1, 3, dtype=torch.long))
        answer = httpx.post(f"{url}/v1/snd/encode", content=body, headers=headers)
        manifest = httpx.get(f"{url}{BUNDLE_PATH}").json()
    assert answer.headers[MODEL_FINGERPRINT_HEADER] == tiny_bert.weights_fingerprint
    assert manifest["model"]["weights_fingerprint"] == tiny_bert.weights_fingerprint


# --- finding 6: 500s and NaN -------------------------------------------------------------------------------------
@pytest.mark.parametrize("lie", ["rows", "width", "fingerprint", "not-a-tensor"])
def test_finding_6_a_malformed_upstream_answer_is_a_502_not_a_500(tiny_bert, tmp_path, lie):
    upstream = Upstream(create_app(tiny_bert, denoiser_dirs=[]))
    with serving(upstream) as url:
        client = Client(url, eta=5.0, device="cpu", denoiser=None, cache_dir=tmp_path / "cache")

        async def liar(scope, receive, send) -> None:
            captured: list[dict] = []

            async def keep(message) -> None:
                captured.append(message)
            await upstream.app(scope, receive, keep)
            start, body = captured[0], b"".join(m.get("body", b"") for m in captured[1:])
            headers = {k.decode(): v.decode() for k, v in start["headers"]}
            rows = read_rows(body, headers).numpy()
            if lie == "fingerprint":
                headers[MODEL_FINGERPRINT_HEADER] = "0" * 64
            elif lie == "not-a-tensor":
                body = b"garbage"
            else:
                bad = np.concatenate([rows, rows]) if lie == "rows" else rows[:, :16]
                body, fresh = write_rows(torch.from_numpy(bad.copy()), dtype="float32", fmt=headers["content-type"])
                headers |= fresh
            headers.pop("content-length", None)
            await Response(body, headers=headers)(scope, receive, send)

        upstream.encode = liar
        with pytest.raises(ServerError):
            client.encode(["the cat sat"])
        with serving(embeddings_app(client)) as gateway:
            answer = httpx.post(f"{gateway}/v1/embeddings", json={"model": MODEL, "input": ["the cat sat"]})
        client.close()
    assert answer.status_code == 502 and answer.json()["error"]["type"] == "upstream_error", answer.text


def test_finding_6_a_lone_surrogate_is_a_400_not_a_500(tiny_bert, tmp_path):
    with serving(create_app(tiny_bert, denoiser_dirs=[])) as url:
        client = Client(url, eta=5.0, device="cpu", denoiser=None, cache_dir=tmp_path / "cache")
        with serving(embeddings_app(client)) as gateway:
            body = b'{"model": "' + MODEL.encode() + b'", "input": ["fine", "bad \\ud800 text"]}'
            answer = httpx.post(f"{gateway}/v1/embeddings", content=body,
                                headers={"content-type": "application/json"})
        client.close()
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == "input" and "input.1" in answer.json()["error"]["message"]


def test_finding_6_huge_finite_inputs_get_a_4xx_never_nan(tiny_bert):
    with serving(create_app(tiny_bert, denoiser_dirs=[])) as url:
        body, headers = write_sequences(torch.full((2, 4, tiny_bert.hidden_size), 1e38),
                                        torch.ones(2, 4, dtype=torch.long))
        answer = httpx.post(f"{url}/v1/snd/encode", content=body, headers=headers)
    assert answer.status_code == 422 and answer.json()["error"]["param"] == "finite"


# --- finding 7: one request monopolised the gateway --------------------------------------------------------------
def test_finding_7_a_request_over_the_token_cap_is_refused(tiny_bert, tmp_path):
    assert MAX_REQUEST_TOKENS == 300_000  # OpenAI's cap, the default
    with serving(create_app(tiny_bert, denoiser_dirs=[])) as url:
        client = Client(url, eta=5.0, device="cpu", denoiser=None, cache_dir=tmp_path / "cache")
        with serving(embeddings_app(client, max_request_tokens=40)) as gateway:
            sdk = openai.OpenAI(base_url=f"{gateway}/v1", api_key="none", max_retries=0)
            assert len(sdk.embeddings.create(model=MODEL, input=["the cat sat"] * 5).data) == 5  # 25 tokens
            with pytest.raises(openai.BadRequestError) as refused:
                sdk.embeddings.create(model=MODEL, input=["the cat sat"] * 9)  # 45 tokens
        client.close()
    assert refused.value.body["code"] == "max_tokens_per_request"
    assert "(45 in its first 9 inputs)" in refused.value.body["message"]


def test_finding_7_turns_go_round_robin_between_callers():
    """A caller with one piece of work waits for the turns already running, not for another caller's queue."""
    async def scenario() -> list[str]:
        scheduler, order = FairScheduler(capacity=1), []

        async def work(caller: str, label: str) -> None:
            async with scheduler.turn(caller):
                order.append(label)
                await asyncio.sleep(0.01)

        big = [asyncio.create_task(work("alice", f"alice-{i}")) for i in range(6)]
        await asyncio.sleep(0)  # alice's six are queued (one running)
        small = asyncio.create_task(work("bob", "bob"))
        await asyncio.gather(*big, small)
        assert scheduler.running == 0 and scheduler.waiting == 0
        return order

    order = asyncio.run(scenario())
    assert order.index("bob") == 1  # right after the turn that was running when bob came


def test_finding_7_a_cancelled_wait_gives_its_turn_back():
    async def scenario() -> None:
        scheduler = FairScheduler(capacity=1)
        async with scheduler.turn("a"):
            waiting = asyncio.create_task(scheduler.turn("b").__aenter__())
            await asyncio.sleep(0)
            waiting.cancel()
            await asyncio.gather(waiting, return_exceptions=True)
        assert scheduler.running == 0 and scheduler.waiting == 0
    asyncio.run(scenario())


class SerialEncodes:
    """ASGI wrapper: a saturated server half. Encodes run one at a time, first come first served, and each
    takes ``delay`` s, so a request's wait is the number of encodes queued ahead of it."""

    def __init__(self, app, delay: float) -> None:
        self.app, self.delay, self.lock = app, delay, None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] == "/v1/snd/encode":
            self.lock = self.lock or asyncio.Lock()
            async with self.lock:
                await asyncio.sleep(self.delay)
                await self.app(scope, receive, send)
            return
        await self.app(scope, receive, send)


def timed_post(url: str, key: str, texts: list[str]) -> tuple[int, float]:
    started = time.perf_counter()
    status = httpx.post(f"{url}/v1/embeddings", json={"model": MODEL, "input": texts},
                        headers={"authorization": f"Bearer {key}"}, timeout=120).status_code
    return status, time.perf_counter() - started


@pytest.mark.slow
def test_finding_7_a_small_request_is_not_held_behind_a_big_one(tiny_bert, tmp_path):
    """Alice keeps 8 requests of 4 batches in flight against a saturated server (0.25 s per encode, one at a
    time: 8 s of work). Bob's one-text request, sent meanwhile, waits for the batch in progress and his own
    turn, not for the queue: bound 1.25 s (5 encodes). Without fair turns every one of alice's requests has a
    batch queued at the server ahead of bob's: 8 encodes, at least 2 s."""
    delay = 0.25
    with serving(SerialEncodes(create_app(tiny_bert, denoiser_dirs=[]), delay)) as url:
        client = Client(url, eta=5.0, device="cpu", denoiser=None, cache_dir=tmp_path / "cache",
                        options=ClientOptions(batch_size=1))
        with (serving(embeddings_app(client, api_keys=["alice", "bob"], max_concurrent_batches=1)) as gateway,
              ThreadPoolExecutor(8) as pool):
            big = [pool.submit(timed_post, gateway, "alice", ["the cat sat on the mat"] * 4) for _ in range(8)]
            time.sleep(1.5)
            small_status, small_latency = timed_post(gateway, "bob", ["a dog"])
            big_results = [future.result() for future in big]
        client.close()
    assert small_status == 200 and {status for status, _ in big_results} == {200}
    assert max(latency for _, latency in big_results) > 32 * delay  # alice's work really was queued
    assert small_latency < 5 * delay


class SlowTokenizer:
    """Delegates to a tokenizer, taking ``per_text`` s for each text it tokenizes (a slow, long request)."""

    def __init__(self, inner, per_text: float) -> None:
        self.inner, self.per_text = inner, per_text

    def __call__(self, texts, *args, **kwargs):
        time.sleep(self.per_text * (len(texts) if isinstance(texts, list) else 1))
        return self.inner(texts, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.slow
def test_finding_7_tokenizing_a_big_request_does_not_hold_others(tiny_bert, tmp_path):
    """Tokenizing alice's 2,048 texts takes 4 s (2 ms a text, one tokenizer); bob's one text, sent meanwhile,
    is tokenized between two of her 64-text turns, so he waits well under a second, not the 4 s."""
    with serving(create_app(tiny_bert, denoiser_dirs=[])) as url:
        client = Client(url, eta=5.0, device="cpu", denoiser=None, cache_dir=tmp_path / "cache")
        client.model.tokenizer = SlowTokenizer(client.model.tokenizer, per_text=0.002)
        with serving(embeddings_app(client, api_keys=["alice", "bob"])) as gateway, ThreadPoolExecutor(1) as pool:
            big = pool.submit(timed_post, gateway, "alice", ["the cat sat on the mat"] * 2048)
            time.sleep(1.0)
            small_status, small_latency = timed_post(gateway, "bob", ["a dog"])
            big_status, big_latency = big.result()
        client.close()
    assert small_status == big_status == 200
    assert big_latency > 4.0
    assert small_latency < 1.0


def test_finding_7_one_caller_cannot_fill_every_place_in_flight():
    """max_in_flight=8, a quarter per caller: alice holds 2 requests, her third is a 429 while bob is served."""
    release = threading.Event()
    router = APIRouter()

    @router.post("/hold")
    async def hold(request: Request) -> dict[str, int]:
        await request.body()
        await asyncio.to_thread(release.wait, 30)
        return {"held": 1}

    app = create_service_app(title="toy", routers=[router], auth=BearerKeys(["alice", "bob"]),
                             max_request_bytes=1024, max_in_flight=8)
    with serving(app) as url, ThreadPoolExecutor(3) as pool:
        def post(key: str) -> httpx.Response:
            return httpx.post(f"{url}/hold", content=b"x", headers={"authorization": f"Bearer {key}"}, timeout=30)

        held = [pool.submit(post, "alice") for _ in range(2)]
        time.sleep(1.0)
        third = post("alice")
        bob = pool.submit(post, "bob")
        time.sleep(0.5)
        release.set()
        statuses = [future.result().status_code for future in [*held, bob]]
    assert third.status_code == 429 and third.json()["error"]["code"] == "rate_limit_exceeded"
    assert third.headers["retry-after"] == "1"
    assert statuses == [200, 200, 200]


@pytest.mark.slow
def test_finding_8_a_client_started_with_the_server_rides_out_its_cold_start(tmp_path):
    """`privlm serve` (MiniLM) and a Client with default settings start together: the server takes about
    9 s to answer, longer than the old retry budget (about 8 s); the client waits and encodes."""
    from privlm.service.process import free_port, stop

    port = free_port()
    started = time.monotonic()
    server = subprocess.Popen([sys.executable, "-m", "privlm.cli", "serve", "--port", str(port), "--device", "cpu"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        client = Client(f"http://127.0.0.1:{port}", eta=50.0, device="cpu", cache_dir=tmp_path)
        waited = time.monotonic() - started
        vectors = client.encode(["the cat sat on the mat"])
        client.close()
    finally:
        stop(server)
    assert vectors.shape == (1, 384) and np.isfinite(vectors).all()
    assert client.retry.failed_attempts >= 1  # it really started before the server answered
    assert ClientOptions().retry_for > waited  # with room to spare over this cold start


def test_finding_8_a_refusal_part_way_keeps_the_finished_batches(tiny_bert, tmp_path):
    upstream = Upstream(create_app(tiny_bert, denoiser_dirs=[]))
    with serving(upstream) as url:
        client = Client(url, eta=5.0, device="cpu", denoiser=None, cache_dir=tmp_path / "cache",
                        options=ClientOptions(batch_size=2))
        served = upstream.encodes

        async def keys_rotated_after_two(scope, receive, send) -> None:
            if upstream.encodes > served + 2:
                await answering(401, {"error": {"message": "missing or invalid API key", "type": "x"}})(
                    scope, receive, send)
            else:
                await upstream.app(scope, receive, send)
        upstream.encode = keys_rotated_after_two
        with pytest.raises(IncompleteEncodingError) as failed:
            client.encode(TEXTS)
        client.close()
    assert isinstance(failed.value.__cause__, RequestRefusedError) and len(failed.value.done) == 4
    assert failed.value.weights_fingerprint == tiny_bert.weights_fingerprint


def test_finding_8_a_model_change_says_to_start_again(tiny_bert, tmp_path):
    error = IncompleteEncodingError(Encoded(np.zeros((2, 3)), EncodeReport()), [0], ModelChangedError("changed"))
    assert "encode every text again with a new client" in str(error)


def test_finding_8_an_outage_within_the_budget_is_ridden_out(tiny_bert, tmp_path):
    upstream = Upstream(create_app(tiny_bert, denoiser_dirs=[]))
    with serving(upstream) as url:
        client = Client(url, eta=5.0, device="cpu", denoiser=None, cache_dir=tmp_path / "cache",
                        options=ClientOptions(batch_size=2, backoff=0.1, retry_for=20))
        upstream.encode = answering(503)
        threading.Timer(1.5, lambda: setattr(upstream, "encode", None)).start()  # back after 1.5 s
        vectors = client.encode(TEXTS)
        client.close()
    assert np.isfinite(vectors).all() and client.retry.failed_attempts >= 2


def test_finding_8_finished_batches_survive_an_outage_past_the_budget(tiny_bert, tmp_path):
    upstream = Upstream(create_app(tiny_bert, denoiser_dirs=[]))
    with serving(upstream) as url:
        client = Client(url, eta=5.0, device="cpu", denoiser=None, cache_dir=tmp_path / "cache",
                        options=ClientOptions(batch_size=2, backoff=0.05, retry_for=1.0))
        served = upstream.encodes

        async def down_after_two(scope, receive, send) -> None:
            if upstream.encodes > served + 2:
                await answering(503)(scope, receive, send)
            else:
                await upstream.app(scope, receive, send)
        upstream.encode = down_after_two
        with pytest.raises(IncompleteEncodingError, match="4 of 6 texts were encoded") as failed:
            client.encode(TEXTS)
        upstream.encode = None
        rest = client.encode([TEXTS[i] for i in failed.value.missing])  # finish the rest
        client.close()
    error = failed.value
    assert len(error.done) == 4 and np.isfinite(error.encoded.vectors[error.done]).all()
    assert rest.shape == (2, tiny_bert.hidden_size)


def failing_once(error: type[httpx.TransportError]) -> tuple[httpx.Client, list[httpx.Request]]:
    """A client whose first request fails with ``error``; every later one gets a 200. Records the attempts."""
    attempts: list[httpx.Request] = []

    def answer(request: httpx.Request) -> httpx.Response:
        attempts.append(request)
        if len(attempts) == 1:
            raise error("failed", request=request)
        return httpx.Response(200)

    return httpx.Client(transport=httpx.MockTransport(answer), base_url="http://server"), attempts


def test_finding_8_timeouts_are_resent_only_when_idempotent():
    policy = RetryPolicy(retry_for=5, backoff=0.0)
    http, attempts = failing_once(httpx.ReadTimeout)
    assert policy.call(lambda: http.post("/encode")).status_code == 200 and len(attempts) == 2
    http, attempts = failing_once(httpx.ReadTimeout)
    with pytest.raises(ServerError, match="not resent"):
        policy.call(lambda: http.post("/charge"), idempotent=False)
    assert len(attempts) == 1  # it may have arrived: never sent twice
    http, attempts = failing_once(httpx.ConnectError)
    assert policy.call(lambda: http.post("/charge"), idempotent=False).status_code == 200  # it never left
    assert len(attempts) == 2


# --- finding 9: OpenAI compatibility ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gateway(tiny_bert, tmp_path_factory):
    upstream = Upstream(create_app(tiny_bert, denoiser_dirs=[], api_keys=["server-key"]))
    with serving(upstream) as url:
        client = Client(url, eta=5.0, device="cpu", denoiser=None, api_key="server-key",
                        cache_dir=tmp_path_factory.mktemp("cache"))
        with serving(embeddings_app(client)) as gateway_url:
            yield gateway_url, upstream
        client.close()


def test_finding_9_a_wrong_model_is_404_model_not_found(gateway):
    url, _ = gateway
    sdk = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.NotFoundError) as missing:
        sdk.embeddings.create(model="text-embedding-3-small", input="the cat sat")
    assert missing.value.body["code"] == "model_not_found" and missing.value.body["param"] == "model"
    assert sdk.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        sdk.models.retrieve("text-embedding-3-small")
    assert [m.id for m in sdk.models.list()] == [MODEL]


@pytest.mark.parametrize(("method", "path", "status"), [("GET", "/v1/embeddings", 405), ("GET", "/nowhere", 404),
                                                         ("DELETE", "/v1/models", 405)])
def test_finding_9_404_and_405_come_in_openais_shape(gateway, method, path, status):
    answer = httpx.request(method, gateway[0] + path)
    assert answer.status_code == status
    assert set(answer.json()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("payload", [
    {"model": MODEL, "input": ["fine", {"text": "my secret diagnosis"}]},
    {"model": MODEL, "input": "my secret diagnosis", "encoding_format": "my secret diagnosis"},
    {"model": MODEL, "input": ["my secret diagnosis"], "dimensions": "my secret diagnosis"},
    {"model": MODEL, "input": ["   ", "my secret diagnosis"]},
    {"model": MODEL, "input": [["my secret diagnosis"]]},
    {"model": "my secret diagnosis", "input": "fine"},
])
def test_finding_9_errors_never_echo_the_callers_text(gateway, payload):
    answer = httpx.post(f"{gateway[0]}/v1/embeddings", json=payload)
    assert answer.status_code in (400, 404)
    assert "secret" not in answer.text and "diagnosis" not in answer.text
    assert set(answer.json()["error"]) == {"message", "type", "param", "code"}


def test_finding_9_no_other_answer_echoes_the_caller_either(gateway, tiny_bert):
    url, _ = gateway
    answers = [httpx.get(f"{url}/v1/models/my%20secret%20diagnosis")]
    with serving(create_app(tiny_bert, denoiser_dirs=[])) as server:  # no keys: loopback Host names only
        answers.append(httpx.get(f"{server}/health", headers={"host": "my-secret-diagnosis.example"}))
        answers.append(httpx.get(f"{server}/v1/models/my%20secret%20diagnosis"))
    assert [answer.status_code for answer in answers] == [404, 400, 404]
    assert not any("secret" in answer.text for answer in answers)


@pytest.mark.parametrize(("field", "status"), [("model", 404), ("encoding_format", 400), ("user", 200)])
def test_finding_6_a_lone_surrogate_anywhere_is_never_a_500(gateway, field, status):
    """In ``model`` (where the old 404 quoted it and crashed rendering) and anywhere else; ``user`` is unused."""
    body = {"model": MODEL, "input": "fine"}
    raw = json.dumps(body | {field: "@"}).replace('"@"', '"bad \\ud800"').encode()
    answer = httpx.post(f"{gateway[0]}/v1/embeddings", content=raw, headers={"content-type": "application/json"})
    assert answer.status_code == status, answer.text[:300]
    assert status == 200 or set(answer.json()["error"]) == {"message", "type", "param", "code"}


def test_finding_9_an_upstream_401_is_a_502_not_the_callers_400(gateway):
    url, upstream = gateway
    upstream.encode = answering(401, {"error": {"message": "missing or invalid API key",
                                                "type": "authentication_error", "code": "invalid_api_key"}})
    try:
        answer = httpx.post(f"{url}/v1/embeddings", json={"model": MODEL, "input": ["the cat sat"]})
    finally:
        upstream.encode = None
    assert answer.status_code == 502
    assert answer.json()["error"]["code"] == "upstream_authentication_failed"


def test_note_retries_an_embeddings_failure_after_the_charge_is_not_retried_by_the_sdk(gateway):
    """Issue 22's note on retries, for the embeddings route: once the release is charged and its batches may have
    reached the server, the 502 says ``x-should-retry: false``, so the ``openai`` SDK (two retries by default)
    does not release and pay again: the server is asked once."""
    url, upstream = gateway
    upstream.encode = answering(401, {"error": {"message": "missing or invalid API key",
                                                "type": "authentication_error", "code": "invalid_api_key"}})
    before = upstream.encodes
    try:
        sdk = openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=30.0)
        with pytest.raises(openai.APIStatusError) as failed:
            sdk.embeddings.create(model=MODEL, input="the cat sat")
    finally:
        upstream.encode = None
    assert failed.value.status_code == 502 and failed.value.response.headers["x-should-retry"] == "false"
    assert upstream.encodes - before == 1


def test_refused_requests_carry_the_servers_status_and_code():
    http = httpx.Client(transport=httpx.MockTransport(lambda r: httpx.Response(
        413, json={"error": {"message": "too big", "type": "invalid_request_error", "code": "limit_exceeded"}})))
    with pytest.raises(RequestRefusedError) as refused:
        RetryPolicy().call(lambda: http.get("http://server/"))
    assert (refused.value.status, refused.value.code, refused.value.server_message) == (413, "limit_exceeded",
                                                                                          "too big")


# --- finding 10: smaller leaks and gaps ------------------------------------------------------------------------------
def test_finding_10_health_and_bundle_reveal_no_paths_or_credentials(tiny_bert, tmp_path):
    folder = str(Path(tiny_bert.name).parent)  # the operator's filesystem path to the model
    with serving(create_app(tiny_bert, denoiser_dirs=[])) as url:
        port = url.rsplit(":", 1)[1]
        seen = [httpx.get(f"{url}{path}").text for path in ("/health", "/v1/models", BUNDLE_PATH)]
        manifest = httpx.get(f"{url}{BUNDLE_PATH}").json()
        seen += [httpx.get(f"{url}{BUNDLE_PATH}/files/{f['name']}").content.decode("utf-8", "replace")
                 for f in manifest["files"] if not f["name"].endswith(".safetensors")]
        client = Client(f"http://operator:hunter2@127.0.0.1:{port}", eta=5.0, device="cpu", denoiser=None,
                        cache_dir=tmp_path / "cache")
        with serving(embeddings_app(client)) as gateway:
            health = httpx.get(f"{gateway}/health").text
        client.close()
    assert all(folder not in text and "_name_or_path" not in text for text in seen)
    assert "hunter2" not in health and "operator" not in health and port not in health


def test_finding_10_unknown_and_contentless_texts_are_reported(gateway):
    texts = ["the cat sat", "x" * 300, "\u200b\u200b\u200b", "a dog"]  # 300 chars: [UNK]; zero-width: nothing
    answer = httpx.post(f"{gateway[0]}/v1/embeddings", json={"model": MODEL, "input": texts})
    assert answer.status_code == 200
    assert answer.headers["x-privlm-unknown-tokens"] == "1"
    assert answer.headers["x-privlm-no-content"] == "2"


def test_finding_10_the_library_reports_and_warns_about_them_too(tiny_bert):
    from privlm.snd import SnDEncoder

    encoder = SnDEncoder(tiny_bert, eta=5.0, denoiser=None)
    with pytest.warns(UserWarning) as caught:
        encoded = encoder.encode_with_report(["x" * 300, "the cat", "\u200b"])
    messages = [str(w.message) for w in caught]
    assert any("texts [0] hold unknown tokens" in m for m in messages)
    assert any("texts [2] have no content tokens" in m for m in messages)
    assert encoded.report.unknown_indices == [0] and encoded.report.contentless_indices == [2]


# --- finding 11: the OpenAPI schemas say what the services do ------------------------------------------------------
def test_finding_11_real_answers_conform_to_the_server_openapi(tiny_bert):
    from privlm.wire import RAW, SAFETENSORS
    from tests.service.fuzz import conforming

    with serving(create_app(tiny_bert, denoiser_dirs=[], api_keys=["k"])) as url:
        key = {"authorization": "Bearer k"}
        embeddings, mask = torch.randn(2, 3, tiny_bert.hidden_size), torch.ones(2, 3, dtype=torch.long)
        statuses = []
        for fmt in (SAFETENSORS, RAW):
            body, headers = write_sequences(embeddings, mask, fmt=fmt)
            statuses.append(conforming(url, "POST", "/v1/snd/encode", body=body, media_type=fmt,
                                       headers=key | headers).status_code)
        body, _ = write_sequences(embeddings, mask, fmt=RAW)  # a raw body without its X-Privlm-* headers
        statuses.append(conforming(url, "POST", "/v1/snd/encode", body=body, media_type=RAW, headers=key).status_code)
        statuses.append(conforming(url, "POST", "/v1/snd/encode", body=body, media_type=RAW).status_code)  # no key
        statuses.append(conforming(url, "GET", "/v1/models/{model_id}", path_parameters={"model_id": "nope"},
                                   headers=key).status_code)
        statuses.append(conforming(url, "GET", "/v1/models/{model_id}", path_parameters={"model_id": "model"},
                                   headers=key).status_code)
    assert statuses == [200, 200, 422, 401, 404, 200]


def test_finding_11_real_answers_conform_to_the_gateway_openapi(gateway):
    from tests.service.fuzz import conforming

    url, upstream = gateway
    statuses = [conforming(url, "POST", "/v1/embeddings", body={"model": MODEL, "input": text}).status_code
                for text in (["the cat sat", "a dog"], "the cat sat", ["  "])]
    statuses.append(conforming(url, "POST", "/v1/embeddings", body={"model": "gpt", "input": "a"}).status_code)
    upstream.encode = answering(500)  # final at once (a busy 503 would be retried for a minute)
    try:
        statuses.append(conforming(url, "POST", "/v1/embeddings", body={"model": MODEL, "input": "a"}).status_code)
    finally:
        upstream.encode = None
    assert statuses == [200, 200, 400, 404, 502]


def test_finding_11_a_body_without_its_headers_is_schema_invalid_and_refused(tiny_bert):
    from privlm.wire import RAW, SAFETENSORS

    declaring = ("X-Privlm-Dtype", "X-Privlm-Shape", "X-Privlm-Lengths")
    with serving(create_app(tiny_bert, denoiser_dirs=[])) as url:
        schema = httpx.get(f"{url}/openapi.json").json()
        parameters = {p["name"]: p for p in schema["paths"]["/v1/snd/encode"]["post"]["parameters"]}
        assert all(parameters[name]["in"] == "header" and parameters[name]["required"] for name in declaring)
        embeddings, mask = torch.randn(2, 3, tiny_bert.hidden_size), torch.tensor([[1, 1, 1], [1, 1, 0]])
        answers = {}
        for fmt in (SAFETENSORS, RAW):
            body, headers = write_sequences(embeddings, mask, fmt=fmt)
            assert {name.lower() for name in declaring} <= set(headers)  # the client sends them with both formats
            answers[fmt] = httpx.post(f"{url}/v1/snd/encode", content=body, headers={"content-type": fmt})
    for answer in answers.values():
        assert answer.status_code == 422
        assert "X-Privlm-Dtype header is required" in answer.json()["error"]["message"]


def test_finding_1_a_bundle_declaring_too_much_is_refused_before_anything_is_fetched(tiny_bert, tmp_path):
    def huge(manifest: dict) -> None:
        manifest["files"][0]["size"] = 3 * 2**30  # 3 GiB, with a capped stream it would still be held in memory
    counting = Counting(hostile_bundle_app(tiny_bert, {}, extra=huge))
    with serving(counting) as url, pytest.raises(ServerError, match="max_bytes"):
        Client(url, eta=5.0, device="cpu", denoiser=None, cache_dir=tmp_path / "cache")
    assert counting.paths == [BUNDLE_PATH]


@pytest.mark.parametrize(("name", "value"), [("x-privlm-shape", "1" * 5000 + ",1,32"),
                                             ("x-privlm-lengths", "9" * 5000)])
def test_finding_6_an_overlong_number_in_a_header_is_a_422_not_a_500(tiny_bert, name, value):
    headers = {"content-type": "application/octet-stream", "x-privlm-dtype": "float32", "x-privlm-shape": "1,1,32",
               "x-privlm-lengths": "1", name: value}
    with serving(create_app(tiny_bert, denoiser_dirs=[])) as url:
        answer = httpx.post(f"{url}/v1/snd/encode", content=b"\0" * 128, headers=headers)
    assert answer.status_code == 422 and value not in answer.text


def test_finding_9_the_server_quotes_nothing_the_caller_sent(tiny_bert):
    from safetensors.torch import save

    with serving(create_app(tiny_bert, denoiser_dirs=[])) as url:
        answers = [httpx.get(f"{url}{BUNDLE_PATH}/files/my-secret-diagnosis"),
                   httpx.post(f"{url}/v1/snd/encode", content=b"x", headers={"content-type": "my/secret-diagnosis"}),
                   httpx.post(f"{url}/v1/snd/encode", content=save({"my_secret_diagnosis": torch.ones(1)}),
                              headers={"content-type": "application/x-safetensors", "x-privlm-dtype": "float32",
                                       "x-privlm-shape": "1,1,32", "x-privlm-lengths": "1"}),
                   httpx.post(f"{url}/v1/snd/encode", content=b"x", headers={
                       "content-type": "application/octet-stream", "x-privlm-dtype": "my-secret-diagnosis",
                       "x-privlm-shape": "1,1,32", "x-privlm-lengths": "1"})]
    assert [answer.status_code for answer in answers] == [404, 415, 422, 422]
    assert not any("secret" in answer.text for answer in answers)
