"""`privlm serve --ray`: the same app as a Ray Serve deployment on a local single-node Ray cluster."""

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from privlm.models import SplitModel
from privlm.service.process import free_port, start_privlm, stop
from privlm.snd import Client
from privlm.wire import RAW, read_rows, write_sequences
from tests.models.tiny import tiny_bert_folder

pytestmark = pytest.mark.slow
KEY = "ray-test-key"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> SplitModel:
    return SplitModel.from_pretrained(tiny_bert_folder(tmp_path_factory.mktemp("tiny")), device="cpu")


@pytest.fixture(scope="module")
def ray_server(tiny):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process = start_privlm(["serve", "--ray", "--model", str(tiny.name), "--port", str(port), "--replicas", "2",
                            "--replica-cpus", "0.5", "--api-key", KEY], f"{url}/health", timeout=300)
    yield url
    stop(process)
    assert process.returncode is not None


def _authorised() -> dict[str, str]:
    return {"authorization": f"Bearer {KEY}"}


def test_replicas_serve_the_same_model(ray_server, tiny):
    assert httpx.get(f"{ray_server}/health").json()["fingerprint"] == tiny.fingerprint
    batch = tiny.tokenize(["the cat sat on the mat", "a dog"])
    embeddings = tiny.embed_tokens(batch.input_ids).detach()
    body, headers = write_sequences(embeddings, batch.attention_mask, dtype="float32", fmt=RAW)

    def post(_: int) -> torch.Tensor:
        response = httpx.post(f"{ray_server}/v1/snd/encode", content=body, headers={**headers, **_authorised()},
                              timeout=60)
        assert response.status_code == 200, response.text
        return read_rows(response.content, response.headers)

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(post, range(16)))
    with torch.no_grad():
        expected = tiny.encode(embeddings, batch.attention_mask)
    for pooled in answers:
        torch.testing.assert_close(pooled, expected, atol=1e-5, rtol=0)


def test_errors_and_keys_pass_through_the_ray_proxy(ray_server):
    assert httpx.get(f"{ray_server}/v1/models").status_code == 401
    response = httpx.post(f"{ray_server}/v1/snd/encode", content=b"\x00" * 12,
                          headers={"content-type": RAW, "x-privlm-dtype": "float64", "x-privlm-shape": "1,1,1",
                                   **_authorised()})
    assert 400 <= response.status_code < 500 and response.json()["error"]["param"] == "dtype"


def test_client_round_trip(ray_server, tiny, tmp_path):
    client = Client(ray_server, eta=50.0, api_key=KEY, denoiser=None, cache_dir=tmp_path)
    embeddings = client.encode(["the cat sat", "a dog ran on the mat"])
    assert embeddings.shape == (2, tiny.hidden_size) and embeddings.dtype == np.float32
    assert np.isfinite(embeddings).all()


def test_shipped_ray_config_is_valid_and_builds_the_app():
    import yaml
    from ray.serve.schema import ServeDeploySchema

    from privlm.snd.service.ray import app_builder

    config = yaml.safe_load((Path(__file__).parents[3] / "deploy" / "ray-serve.yaml").read_text())
    application = ServeDeploySchema.model_validate(config).applications[0]
    assert application.import_path == "privlm.snd.service.ray:app_builder"
    deployment = app_builder({**application.args, "api_keys": "a,b"})._bound_deployment
    assert deployment.num_replicas == application.args["replicas"]
    assert deployment.init_args == ("minilm",) and deployment.init_kwargs["api_keys"] == ("a", "b")


@pytest.mark.parametrize("bad", [{"replicas": 0}, {"replica_cpus": 0}, {"replica_cpus": float("nan")}])
def test_bad_deployment_sizes_are_refused(bad):
    from privlm.snd.service.ray import snd_application

    with pytest.raises(ValueError, match=next(iter(bad))):
        snd_application("minilm", **bad)
