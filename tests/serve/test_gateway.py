"""The OpenAI-compatible gateway, driven by the real ``openai`` client, over a real SnD server."""

import base64

import numpy as np
import openai
import pytest

from privlm.models import SplitModel
from privlm.serve.gateway import create_gateway
from privlm.serve.server import create_app
from privlm.snd import Client
from tests.models.tiny import tiny_bert_folder, train_tiny_denoiser
from tests.serve.localhost import serving


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    root = tmp_path_factory.mktemp("gateway")
    model = SplitModel.from_pretrained(tiny_bert_folder(root / "model"), device="cpu")
    train_tiny_denoiser(model, root / "snd-tiny")
    with serving(create_app(model, denoiser_dirs=[root / "snd-tiny"])) as server_url:
        client = Client(server_url, eta=5.0, cache_dir=root / "cache", device="cpu")
        with serving(create_gateway(client, api_keys=["local-key"])) as gateway_url:
            yield openai.OpenAI(base_url=f"{gateway_url}/v1", api_key="local-key", max_retries=0)
        client.close()


def test_openai_client_gets_private_embeddings(stack):
    response = stack.embeddings.create(model="privlm-snd-minilm", input=["the cat sat", "a dog"])
    assert [d.index for d in response.data] == [0, 1]
    assert len(response.data[0].embedding) == 32
    assert response.usage.prompt_tokens > 0


def test_base64_encoding_matches_float(stack):
    response = stack.embeddings.create(model="x", input="the cat sat", encoding_format="base64")
    raw = response.data[0].embedding
    vector = np.frombuffer(base64.b64decode(raw), dtype="<f4") if isinstance(raw, str) else np.asarray(raw)
    assert vector.shape == (32,) and np.isfinite(vector).all()


def test_bad_requests_are_4xx(stack):
    with pytest.raises(openai.BadRequestError):
        stack.embeddings.create(model="x", input=[""])
    with pytest.raises(openai.BadRequestError):
        stack.embeddings.create(model="x", input=[[1, 2, 3]])  # token ids are refused: send text
    wrong_key = openai.OpenAI(base_url=str(stack.base_url), api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong_key.embeddings.create(model="x", input="hi")
