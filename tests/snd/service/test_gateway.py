"""The OpenAI-compatible gateway, driven by the real ``openai`` client, over a real SnD server."""

import base64
from typing import NamedTuple

import httpx
import numpy as np
import openai
import pytest

from privlm.models import SplitModel
from privlm.snd import Client
from privlm.snd.service.gateway import create_gateway
from privlm.snd.service.server import create_app
from tests.models.tiny import tiny_bert_folder, train_tiny_denoiser
from tests.service.localhost import serving


class Stack(NamedTuple):
    sdk: openai.OpenAI  # the real OpenAI client on a gateway with a Bearer key
    truncating_url: str  # a second gateway: --truncate, max_request_bytes=20,000


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    root = tmp_path_factory.mktemp("gateway")
    model = SplitModel.from_pretrained(tiny_bert_folder(root / "model"), device="cpu")
    train_tiny_denoiser(model, root / "snd-tiny")
    with serving(create_app(model, denoiser_dirs=[root / "snd-tiny"])) as server_url:
        client = Client(server_url, eta=5.0, cache_dir=root / "cache", device="cpu")
        with (serving(create_gateway(client, api_keys=["local-key"])) as gateway_url,
              serving(create_gateway(client, truncate=True, max_request_bytes=20_000)) as truncating_url):
            yield Stack(openai.OpenAI(base_url=f"{gateway_url}/v1", api_key="local-key", max_retries=0),
                        truncating_url)
        client.close()


def test_openai_client_gets_private_embeddings(stack):
    response = stack.sdk.embeddings.create(model="privlm-snd-minilm", input=["the cat sat", "a dog"])
    assert [d.index for d in response.data] == [0, 1]
    assert len(response.data[0].embedding) == 32
    assert response.usage.prompt_tokens > 0


def test_base64_encoding_matches_float(stack):
    response = stack.sdk.embeddings.create(model="x", input="the cat sat", encoding_format="base64")
    raw = response.data[0].embedding
    vector = np.frombuffer(base64.b64decode(raw), dtype="<f4") if isinstance(raw, str) else np.asarray(raw)
    assert vector.shape == (32,) and np.isfinite(vector).all()


def test_bad_requests_are_4xx(stack):
    with pytest.raises(openai.BadRequestError):
        stack.sdk.embeddings.create(model="x", input=[""])
    with pytest.raises(openai.BadRequestError):
        stack.sdk.embeddings.create(model="x", input=[[1, 2, 3]])  # token ids are refused: send text
    wrong_key = openai.OpenAI(base_url=str(stack.sdk.base_url), api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong_key.embeddings.create(model="x", input="hi")


def test_over_long_texts_are_refused_or_cut_visibly(stack):
    long_text = " ".join(["cat"] * 2000)
    with pytest.raises(openai.BadRequestError) as refused:
        stack.sdk.embeddings.create(model="x", input=["a dog", long_text])
    assert refused.value.body["param"] == "input" and refused.value.body["code"] == "context_length_exceeded"
    assert "[1]" in refused.value.body["message"]
    cut = httpx.post(f"{stack.truncating_url}/v1/embeddings", json={"model": "x", "input": ["a dog", long_text]})
    assert cut.status_code == 200 and cut.headers["x-privlm-truncated"] == "1"
    assert len(cut.json()["data"]) == 2


def test_request_bytes_are_bounded_before_parsing(stack):
    response = httpx.post(f"{stack.truncating_url}/v1/embeddings",
                          json={"model": "x", "input": ["cat " * 10_000]})
    assert response.status_code == 413 and response.json()["error"]["param"] == "max_request_bytes"
