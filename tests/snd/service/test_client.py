"""The client SDK against a real uvicorn server on localhost."""

import numpy as np
import pytest

from privlm.mechanisms import make_generator
from privlm.models import SplitModel
from privlm.snd import Client, ClientOptions, SnDEncoder
from privlm.snd.service.server import create_app
from tests.models.tiny import tiny_bert_folder, train_tiny_denoiser
from tests.service.localhost import serving

TEXTS = ["the cat sat on the mat .", "a dog", "the dog sat , the cat sat"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("client")
    model = SplitModel.from_pretrained(tiny_bert_folder(root / "model"), device="cpu")
    train_tiny_denoiser(model, root / "snd-tiny")
    return model, root


def test_round_trip_equals_the_in_process_encoder(setup, tmp_path):
    model, root = setup
    app = create_app(model, denoiser_dirs=[root / "snd-tiny"])
    with serving(app) as url, Client(url, eta=5.0, generator=make_generator(3), device="cpu",
                                     cache_dir=tmp_path) as client:
        encoded = client.encode_with_report(TEXTS)
        assert encoded.report.server_calls == 1
        remote = encoded.vectors
    local = SnDEncoder(model, eta=5.0, denoiser=root / "snd-tiny", generator=make_generator(3)).encode(TEXTS)
    assert remote.shape == (3, 32) and remote.dtype == np.float32
    np.testing.assert_allclose(remote, local, atol=1e-5)


def test_bundle_is_cached_by_hash(setup, tmp_path):
    model, root = setup
    with serving(create_app(model, denoiser_dirs=[root / "snd-tiny"])) as url:
        Client(url, eta=5.0, device="cpu", cache_dir=tmp_path).close()
        cached = sorted(p for p in tmp_path.rglob("*") if p.is_file())
        mtimes = [p.stat().st_mtime_ns for p in cached]
        Client(url, eta=5.0, device="cpu", cache_dir=tmp_path).close()
    assert [p.stat().st_mtime_ns for p in cached] == mtimes  # nothing downloaded twice


def test_retries_until_the_server_comes_up(setup, tmp_path):
    model, root = setup
    with serving(create_app(model, denoiser_dirs=[root / "snd-tiny"]), delay=1.0) as url:
        client = Client(url, eta=5.0, device="cpu", cache_dir=tmp_path, options=ClientOptions(backoff=0.2, retries=8))
        assert client.encode(TEXTS[:1]).shape == (1, 32)
        assert client.retry.failed_attempts >= 1  # it really had to retry
        client.close()


def test_refusals_are_clear_errors(setup, tmp_path):
    model, root = setup
    with serving(create_app(model, denoiser_dirs=[root / "snd-tiny"], api_keys=["k"])) as url:
        with pytest.raises(ValueError, match="API key"):
            Client(url, eta=5.0, device="cpu", cache_dir=tmp_path)
        with pytest.raises(ValueError, match="not 'nope'"):
            Client(url, eta=5.0, api_key="k", denoiser="nope", device="cpu", cache_dir=tmp_path)


def test_async_client_matches_the_sync_client(setup, tmp_path):
    import asyncio

    from privlm.snd import AsyncClient

    model, root = setup
    texts = TEXTS * 5
    with serving(create_app(model, denoiser_dirs=[root / "snd-tiny"])) as url:
        with Client(url, eta=5.0, generator=make_generator(4), device="cpu", cache_dir=tmp_path) as client:
            expected = client.encode(texts, batch_size=4)

        async def run() -> np.ndarray:
            async with AsyncClient(url, eta=5.0, generator=make_generator(4), device="cpu", cache_dir=tmp_path,
                                   options=ClientOptions(max_concurrency=3)) as async_client:
                encoded = await async_client.encode_with_report(texts, batch_size=4)
                assert encoded.report.server_calls == 4
                return encoded.vectors

        got = asyncio.run(run())
    np.testing.assert_allclose(got, expected, atol=1e-5)
