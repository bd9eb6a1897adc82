"""The OpenAI-compatible gateway, driven by the real ``openai`` client, over a real SnD server."""

import asyncio
import base64
import time
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import httpx
import numpy as np
import openai
import pytest

from privlm.accounting import BudgetExhaustedError, Ledger
from privlm.mechanisms import PrivacyUnit
from privlm.models import SplitModel
from privlm.snd import Client, ClientOptions
from privlm.snd.service.server import create_app
from tests.models.tiny import tiny_bert_folder, train_tiny_denoiser
from tests.service.localhost import serving
from tests.support.gateway import embeddings_app

MODEL = "privlm-snd-model"  # the gateway's id for the tiny_bert model, loaded from a folder named "model"


class Stack(NamedTuple):
    sdk: openai.OpenAI  # the real OpenAI client on a gateway with a Bearer key
    truncating_url: str  # a second gateway: --truncate, max_request_bytes=20,000


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    root = tmp_path_factory.mktemp("gateway")
    model = SplitModel.from_pretrained(tiny_bert_folder(root / "model"), device="cpu")
    train_tiny_denoiser(model, root / "snd-tiny")
    with serving(create_app(model, denoiser_dirs=[root / "snd-tiny"])) as server_url:
        client = Client(server_url, eta=5.0, device="cpu", cache_dir=root / "cache")
        with (serving(embeddings_app(client, api_keys=["local-key"])) as gateway_url,
              serving(embeddings_app(client, truncate=True, max_request_bytes=20_000)) as truncating_url):
            yield Stack(openai.OpenAI(base_url=f"{gateway_url}/v1", api_key="local-key", max_retries=0),
                        truncating_url)
        client.close()


def test_openai_client_gets_private_embeddings(stack):
    response = stack.sdk.embeddings.create(model=MODEL, input=["the cat sat", "a dog"])
    assert [d.index for d in response.data] == [0, 1]
    assert len(response.data[0].embedding) == 32
    assert response.usage.prompt_tokens > 0


def test_base64_encoding_matches_float(stack):
    response = stack.sdk.embeddings.create(model=MODEL, input="the cat sat", encoding_format="base64")
    raw = response.data[0].embedding
    vector = np.frombuffer(base64.b64decode(raw), dtype="<f4") if isinstance(raw, str) else np.asarray(raw)
    assert vector.shape == (32,) and np.isfinite(vector).all()


def test_bad_requests_are_4xx(stack):
    with pytest.raises(openai.BadRequestError):
        stack.sdk.embeddings.create(model=MODEL, input=[""])
    with pytest.raises(openai.BadRequestError):
        stack.sdk.embeddings.create(model=MODEL, input=[[1, 2, 3]])  # token ids are refused: send text
    wrong_key = openai.OpenAI(base_url=str(stack.sdk.base_url), api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong_key.embeddings.create(model=MODEL, input="hi")


def test_over_long_texts_are_refused_or_cut_visibly(stack):
    long_text = " ".join(["cat"] * 2000)
    with pytest.raises(openai.BadRequestError) as refused:
        stack.sdk.embeddings.create(model=MODEL, input=["a dog", long_text])
    assert refused.value.body["param"] == "input" and refused.value.body["code"] == "context_length_exceeded"
    assert "[1]" in refused.value.body["message"]
    cut = httpx.post(f"{stack.truncating_url}/v1/embeddings", json={"model": MODEL, "input": ["a dog", long_text]})
    assert cut.status_code == 200 and cut.headers["x-privlm-truncated"] == "1"
    assert len(cut.json()["data"]) == 2


def test_request_bytes_are_bounded_before_parsing(stack):
    response = httpx.post(f"{stack.truncating_url}/v1/embeddings",
                          json={"model": MODEL, "input": ["cat " * 10_000]})
    assert response.status_code == 413 and response.json()["error"]["param"] == "max_request_bytes"


@pytest.mark.slow
def test_the_gateway_openapi_never_answers_5xx(stack):
    from tests.service.fuzz import fuzz_openapi

    seen = fuzz_openapi(str(stack.sdk.base_url).removesuffix("/v1/"), headers={"authorization": "Bearer local-key"},
                        max_examples=15)
    assert {path for path, _ in seen} >= {"/v1/embeddings", "/v1/models", "/health", "/metrics"}


def test_every_answer_carries_the_privacy_report(stack):
    raw = stack.sdk.embeddings.with_raw_response.create(model=MODEL, input=["the cat sat", "a dog"])
    assert raw.headers["x-privlm-mechanism"] == "snd-dchi" and raw.headers["x-privlm-eta"] == "5"
    assert int(raw.headers["x-privlm-tokens-perturbed"]) == raw.parse().usage.prompt_tokens > 0
    assert "x-privlm-budget-remaining" not in raw.headers  # no ledger on this gateway


class InFlight:
    """ASGI middleware for a deliberately slow upstream: each encode takes ``delay`` s; records the peak
    number of encodes in flight at once."""

    def __init__(self, app, delay: float) -> None:
        self.app, self.delay, self.now, self.peak = app, delay, 0, 0

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] != "/v1/snd/encode":
            await self.app(scope, receive, send)
            return
        self.now += 1
        self.peak = max(self.peak, self.now)
        try:
            await asyncio.sleep(self.delay)
            await self.app(scope, receive, send)
        finally:
            self.now -= 1


def test_two_requests_are_in_flight_at_the_same_time(tmp_path):
    """Against an upstream that takes 1 s per call, two concurrent gateway requests overlap upstream: no
    gateway-wide lock serialises them."""
    model = SplitModel.from_pretrained(tiny_bert_folder(tmp_path / "model"), device="cpu")
    upstream = InFlight(create_app(model, denoiser_dirs=[]), delay=1.0)
    with serving(upstream) as server_url:
        client = Client(server_url, eta=5.0, denoiser=None, device="cpu", cache_dir=tmp_path / "cache")
        with serving(embeddings_app(client)) as gateway_url:
            def post(text: str) -> int:
                return httpx.post(f"{gateway_url}/v1/embeddings", json={"model": MODEL, "input": [text]},
                                  timeout=30).status_code

            started = time.perf_counter()
            with ThreadPoolExecutor(2) as pool:
                codes = list(pool.map(post, ["the cat sat", "a dog ran"]))
            elapsed = time.perf_counter() - started
        client.close()
    assert codes == [200, 200]
    assert upstream.peak == 2  # both were upstream at once
    assert elapsed < 1.9  # not one after the other (2 s)


def test_per_key_budgets_are_spent_before_release_and_survive_a_restart(tmp_path):
    model = SplitModel.from_pretrained(tiny_bert_folder(tmp_path / "model"), device="cpu")
    tokens = model.token_counts(["the cat sat"])[0]
    ledger_path = tmp_path / "ledger.sqlite"

    def gateway_stack(server_url: str):
        ledger = Ledger(ledger_path, budgets={PrivacyUnit.ETA_TOKEN: 2.5 * 5.0 * tokens})  # 2.5 requests' worth
        client = Client(server_url, eta=5.0, denoiser=None, device="cpu", cache_dir=tmp_path / "cache",
                        options=ClientOptions(ledger=ledger))
        return client, embeddings_app(client, api_keys=["alice", "bob"])

    upstream = InFlight(create_app(model, denoiser_dirs=[]), delay=0.0)
    with serving(upstream) as server_url:
        client, gateway = gateway_stack(server_url)
        with serving(gateway) as gateway_url:
            alice = openai.OpenAI(base_url=f"{gateway_url}/v1", api_key="alice", max_retries=0)
            first = alice.embeddings.with_raw_response.create(model=MODEL, input="the cat sat")
            assert float(first.headers["x-privlm-eta-tokens-spent"]) == pytest.approx(5.0 * tokens)
            assert float(first.headers["x-privlm-budget-remaining"]) == pytest.approx(1.5 * 5.0 * tokens)
            alice.embeddings.create(model=MODEL, input="the cat sat")
            with pytest.raises(openai.RateLimitError) as refused:
                alice.embeddings.create(model=MODEL, input="the cat sat")
            assert refused.value.body["code"] == "budget_exhausted"
            assert refused.value.body["param"] == "eta-token budget" and "left" in refused.value.body["message"]
            bob = openai.OpenAI(base_url=f"{gateway_url}/v1", api_key="bob", max_retries=0)
            assert len(bob.embeddings.create(model=MODEL, input="the cat sat").data) == 1  # budgets are per key
        client.close()
        client, gateway = gateway_stack(server_url)  # a restart: a new ledger object on the same file
        with serving(gateway) as gateway_url:
            alice = openai.OpenAI(base_url=f"{gateway_url}/v1", api_key="alice", max_retries=0)
            with pytest.raises(openai.RateLimitError):
                alice.embeddings.create(model=MODEL, input="the cat sat")
        client.close()
    assert upstream.peak == 1


def test_a_refused_release_never_reaches_the_server(tmp_path):
    model = SplitModel.from_pretrained(tiny_bert_folder(tmp_path / "model"), device="cpu")
    upstream = InFlight(create_app(model, denoiser_dirs=[]), delay=0.0)
    with serving(upstream) as server_url:
        ledger = Ledger(tmp_path / "ledger.sqlite", budgets={PrivacyUnit.ETA_TOKEN: 1.0})  # less than one token
        client = Client(server_url, eta=5.0, denoiser=None, device="cpu", cache_dir=tmp_path / "cache",
                        options=ClientOptions(ledger=ledger))
        with pytest.raises(BudgetExhaustedError):
            client.encode(["the cat sat"])
        client.close()
    assert upstream.peak == 0  # nothing was sent


def test_client_settings_are_checked_before_anything_is_downloaded():
    requests = []
    transport = httpx.MockTransport(lambda request: requests.append(request) or httpx.Response(500))
    for bad in ({"eta": -1.0}, {"eta": float("nan")}, {"eta": 5.0, "dtype": "float64"},
                {"eta": 5.0, "batch_size": 0}, {"eta": 5.0, "wire_format": "json"}):
        with pytest.raises(ValueError, match=next(k for k in bad if k != "eta" or len(bad) == 1)):
            eta = bad.pop("eta")
            Client("http://127.0.0.1:9", eta=eta, options=ClientOptions(transport=transport, **bad))
    assert requests == []


class CountingTokenizer:
    """Delegates to a tokenizer and counts the calls that tokenize text."""

    def __init__(self, inner) -> None:
        self.inner, self.calls = inner, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.inner(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_each_request_is_tokenized_once(tmp_path):
    model = SplitModel.from_pretrained(tiny_bert_folder(tmp_path / "model"), device="cpu")
    with serving(create_app(model, denoiser_dirs=[])) as server_url:
        client = Client(server_url, eta=5.0, denoiser=None, device="cpu", cache_dir=tmp_path / "cache",
                        options=ClientOptions(batch_size=2))
        counting = client.model.tokenizer = CountingTokenizer(client.model.tokenizer)
        with serving(embeddings_app(client)) as gateway_url:
            response = httpx.post(f"{gateway_url}/v1/embeddings",
                                  json={"model": MODEL, "input": ["the cat sat", "a dog", "the mat", "a cat ran"]})
        client.close()
    assert response.status_code == 200 and len(response.json()["data"]) == 4
    assert counting.calls == 1  # one tokenizer call for four texts in two batches
