"""`privlm serve --ray`: the same app as a Ray Serve deployment on a local single-node Ray cluster."""

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from privlm.service.process import stop
from privlm.snd import Client
from privlm.wire import RAW, read_rows, write_sequences
from tests.service.localhost import start_privlm_on_free_port

pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.xdist_group("ray")]  # one Ray cluster at a time
KEY = "ray-test-key"


@pytest.fixture(scope="module")
def ray_server(tiny_bert, tmp_path_factory):
    key_file = tmp_path_factory.mktemp("keys") / "api-keys"  # read by each replica (finding 5 of issue 10)
    key_file.write_text(f"# the test's key\n{KEY}\n")
    key_file.chmod(0o600)
    process, port = start_privlm_on_free_port(
        lambda port: ["serve", "--ray", "--model", str(tiny_bert.name), "--port", str(port), "--replicas", "2",
                      "--replica-cpus", "0.5", "--api-key-file", str(key_file)], timeout=300)
    yield f"http://127.0.0.1:{port}"
    stop(process)
    assert process.returncode is not None


def _authorised() -> dict[str, str]:
    return {"authorization": f"Bearer {KEY}"}


def test_replicas_serve_the_same_model(ray_server, tiny_bert):
    assert httpx.get(f"{ray_server}/health").json()["weights_fingerprint"] == tiny_bert.weights_fingerprint
    batch = tiny_bert.tokenize(["the cat sat on the mat", "a dog"])
    embeddings = tiny_bert.embed_tokens(batch.input_ids).detach()
    body, headers = write_sequences(embeddings, batch.attention_mask, dtype="float32", fmt=RAW)

    def post(_: int) -> torch.Tensor:
        response = httpx.post(f"{ray_server}/v1/snd/encode", content=body, headers={**headers, **_authorised()},
                              timeout=60)
        assert response.status_code == 200, response.text
        return read_rows(response.content, response.headers)

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(post, range(16)))
    with torch.no_grad():
        expected = tiny_bert.encode(embeddings, batch.attention_mask)
    for pooled in answers:
        torch.testing.assert_close(pooled, expected, atol=1e-5, rtol=0)


def test_errors_and_keys_pass_through_the_ray_proxy(ray_server):
    assert httpx.get(f"{ray_server}/v1/models").status_code == 401
    response = httpx.post(f"{ray_server}/v1/snd/encode", content=b"\x00" * 12,
                          headers={"content-type": RAW, "x-privlm-dtype": "float64", "x-privlm-shape": "1,1,1",
                                   **_authorised()})
    assert 400 <= response.status_code < 500 and response.json()["error"]["param"] == "dtype"


def test_client_round_trip(ray_server, tiny_bert, tmp_path):
    client = Client(ray_server, eta=50.0, api_key=KEY, denoiser=None, cache_dir=tmp_path)
    embeddings = client.encode(["the cat sat", "a dog ran on the mat"])
    assert embeddings.shape == (2, tiny_bert.hidden_size) and embeddings.dtype == np.float32
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
    [settings] = deployment.init_args
    assert settings.model == "minilm" and settings.api_keys == ("a", "b")
    assert settings.max_batch_rows == application.args["max_batch_rows"]


@pytest.mark.parametrize("bad", [{"replicas": 0}, {"replica_cpus": 0}, {"replica_cpus": float("nan")},
                                 {"replicas": "two"}])
def test_bad_deployment_sizes_are_refused(bad):
    from privlm.settings.options import SettingError
    from privlm.snd.service.ray import app_builder

    with pytest.raises(SettingError, match=f"--{next(iter(bad)).replace('_', '-')}|{next(iter(bad))}"):
        app_builder({"model": "minilm", **bad})


def test_ray_cli_strings_are_read_as_the_fields_types_and_a_config_file_under_them(tmp_path):
    """``serve run ...:app_builder replicas=4 denoisers=a,b`` gives strings; a ``config`` file gives the rest."""
    from privlm.snd.service.ray import app_builder

    config = tmp_path / "snd.yaml"
    config.write_text("model: minilm\nmax_wait_ms: 9\nreplicas: 3\n")
    deployment = app_builder({"config": str(config), "replicas": "4", "denoisers": "a,b", "docs": "yes"})
    [settings] = deployment._bound_deployment.init_args
    assert deployment._bound_deployment.num_replicas == 4
    assert (settings.max_wait_ms, settings.denoisers, settings.docs) == (9.0, ("a", "b"), True)


def test_finding_5_ray_replicas_read_keys_from_a_file_or_the_environment(tiny_bert, tmp_path, monkeypatch):
    """Keys need not sit in Ray's config (which Ray stores): each replica reads the key file and the variable
    on its own node; an explicitly empty source is refused, never an open server."""
    from privlm.service.auth import KeySourceError
    from privlm.settings.snd import SndServeSettings
    from privlm.snd.service.ray import SnDServer, app_builder
    from tests.service.localhost import serving

    key_file = tmp_path / "keys"
    key_file.write_text("# replica keys\nfile-key\n")
    key_file.chmod(0o600)
    deployment = app_builder({"model": "minilm", "api_key_file": str(key_file)})._bound_deployment
    [settings] = deployment.init_args
    assert settings.api_keys == () and settings.api_key_file == str(key_file)
    assert settings.api_keys_env == "PRIVLM_API_KEYS"
    assert "file-key" not in repr((deployment.init_args, deployment.init_kwargs))
    monkeypatch.setenv("PRIVLM_API_KEYS", "env-key")
    replica = SnDServer(SndServeSettings(model=str(tiny_bert.name), api_key_file=str(key_file), device="cpu"))
    with serving(replica.__serve_build_asgi_app__()) as url:
        for key, status in (("file-key", 200), ("env-key", 200), ("other", 401)):
            assert httpx.get(f"{url}/metrics", headers={"authorization": f"Bearer {key}"}).status_code == status
    with pytest.raises(KeySourceError, match="api_keys"):
        app_builder({"model": "minilm", "api_keys": ""})
    monkeypatch.setenv("PRIVLM_API_KEYS", "")
    with pytest.raises(KeySourceError, match="PRIVLM_API_KEYS"):
        SnDServer(SndServeSettings(model=str(tiny_bert.name), device="cpu"))


def _loopback(address: str) -> bool:
    import ipaddress

    ip = ipaddress.ip_address(address.split("%")[0])
    mapped = getattr(ip, "ipv4_mapped", None)  # ::ffff:127.0.0.1
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


def test_finding_10_ray_listens_on_loopback_only(ray_server):
    """`privlm serve --ray` on 127.0.0.1 used to start Ray with its GCS, raylet, agents and workers listening
    on every interface ('::', '0.0.0.0', the machine's address); now every listening socket of the whole
    process tree is on loopback."""
    import psutil

    port = int(ray_server.rsplit(":", 1)[1])
    (root,) = [child for child in psutil.Process().children()
               if "--ray" in child.cmdline() and str(port) in child.cmdline()]
    listening: dict[tuple[str, int], str] = {}
    for process in [root, *root.children(recursive=True)]:
        try:
            name = process.name()
            for connection in process.net_connections(kind="inet"):
                if connection.status == psutil.CONN_LISTEN:
                    listening[(name, connection.laddr.port)] = connection.laddr.ip
        except psutil.NoSuchProcess:
            continue
    assert {"gcs_server", "raylet"} <= {name for name, _ in listening} and port in {p for _, p in listening}
    assert {where: ip for where, ip in listening.items() if not _loopback(ip)} == {}
