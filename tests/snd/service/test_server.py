"""The SnD server in-process (FastAPI's TestClient runs the real app and its lifespan)."""

import hashlib

import pytest
import torch
from fastapi.testclient import TestClient
from safetensors.torch import load, save

from privlm.snd.service.server import create_app
from privlm.wire import RAW, SAFETENSORS, read_rows, write_sequences


@pytest.fixture(scope="module")
def client(tiny_bert):
    # base_url: an open server answers loopback Host names only (DNS rebinding); TestClient's default is testserver
    app = create_app(tiny_bert, denoiser_dirs=[], max_wait_ms=2.0)
    with TestClient(app, base_url="http://localhost") as test_client:
        yield test_client


def _private_batch(tiny_bert, texts):
    batch = tiny_bert.tokenize(texts)
    return tiny_bert.embed_tokens(batch.input_ids).detach(), batch.attention_mask


@pytest.mark.parametrize("fmt", [SAFETENSORS, RAW])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_encode_matches_the_model(client, tiny_bert, fmt, dtype):
    embeddings, mask = _private_batch(tiny_bert, ["the cat sat on the mat", "a dog"])
    body, headers = write_sequences(embeddings, mask, dtype=dtype, fmt=fmt)
    response = client.post("/v1/snd/encode", content=body, headers=headers)
    assert response.status_code == 200, response.text
    pooled = read_rows(response.content, response.headers)
    with torch.no_grad():
        expected = tiny_bert.encode(embeddings.to(getattr(torch, dtype)).float(), mask)
    torch.testing.assert_close(pooled, expected, atol=1e-2 if dtype == "float16" else 1e-5, rtol=0)


def test_bundle_lists_verifiable_files(client, tiny_bert):
    manifest = client.get("/v1/snd/bundle").json()
    assert manifest["model"]["fingerprint"] == tiny_bert.fingerprint
    assert manifest["model"]["clip_norm"] == pytest.approx(tiny_bert.max_embedding_norm)
    names = {f["name"] for f in manifest["files"]}
    assert {"model.json", "embeddings.safetensors"} <= names and any(n.startswith("tokenizer/") for n in names)
    for entry in manifest["files"]:
        content = client.get(f"/v1/snd/bundle/files/{entry['name']}").content
        assert hashlib.sha256(content).hexdigest() == entry["sha256"]
    matrix = load(client.get("/v1/snd/bundle/files/embeddings.safetensors").content)["embeddings"]
    assert torch.equal(matrix, tiny_bert.embedding_matrix)
    assert client.get("/v1/snd/bundle/files/nope").status_code == 404


def test_health_models_and_metrics(client, tiny_bert):
    assert client.get("/health").json()["status"] == "ok"
    assert client.get("/v1/models").json()["data"][0]["dim"] == 32
    metrics = client.get("/metrics").text
    assert "privlm_requests_total" in metrics and "privlm_batch_rows" in metrics


# Safetensors bodies with headers declaring (1, 2, 32) float32 of length 2: the cases are about the body
# (the dim case declares what it sends, 31, and is refused on the declaration).
DECLARED = {"content-type": SAFETENSORS, "x-privlm-dtype": "float32", "x-privlm-shape": "1,2,32",
            "x-privlm-lengths": "2"}


@pytest.mark.parametrize(("body", "headers", "status", "limit"), [
    (b"{}", {"content-type": "application/json"}, 415, "content-type"),
    (b"\x00" * 40, DECLARED, 422, "format"),
    (save({"embeddings": torch.ones(1, 2, 31), "attention_mask": torch.ones(1, 2, dtype=torch.uint8)}),
     DECLARED | {"x-privlm-shape": "1,2,31"}, 422, "dim"),
    (save({"embeddings": torch.full((1, 2, 32), float("nan")), "attention_mask": torch.ones(1, 2, dtype=torch.uint8)}),
     DECLARED, 422, "finite"),
    (save({"input_ids": torch.ones(1, 2, dtype=torch.long)}), DECLARED, 422, "format"),
    (save({"embeddings": torch.ones(1, 2, 32), "attention_mask": torch.ones(1, 2, dtype=torch.uint8)}),
     {"content-type": SAFETENSORS}, 422, "dtype"),  # no X-Privlm-* headers: the first one missing is named
])
def test_malformed_requests_get_4xx_json(client, body, headers, status, limit):
    response = client.post("/v1/snd/encode", content=body, headers=headers)
    assert response.status_code == status
    assert response.json()["error"]["param"] == limit


def test_api_keys_guard_everything_but_health(tiny_bert):
    with TestClient(create_app(tiny_bert, denoiser_dirs=[], api_keys=["s3cret"])) as guarded:
        assert guarded.get("/health").status_code == 200
        response = guarded.get("/v1/models")
        assert response.status_code == 401 and "API key" in response.json()["error"]["message"]
        assert guarded.get("/v1/models", headers={"Authorization": "Bearer s3cret"}).status_code == 200


def test_concurrent_requests_share_batches(tiny_bert):
    import concurrent.futures

    app = create_app(tiny_bert, denoiser_dirs=[], max_wait_ms=50.0)
    with TestClient(app, base_url="http://localhost") as test_client:
        embeddings, mask = _private_batch(tiny_bert, ["the cat", "a dog sat"])
        body, headers = write_sequences(embeddings, mask)
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            codes = list(pool.map(lambda _: test_client.post("/v1/snd/encode", content=body,
                                                             headers=headers).status_code, range(16)))
        assert codes == [200] * 16
        metrics = test_client.get("/metrics").text
    count = next(float(line.split()[-1]) for line in metrics.splitlines()
                 if line.startswith("privlm_batch_rows_count"))
    assert count < 16  # fewer forward passes than requests
