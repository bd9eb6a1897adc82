"""`privlm sap vendor --ray`: two replicas over one shared store on a local single-node Ray cluster."""

from __future__ import annotations

import threading

import pytest
import torch

from privlm.sap import Client, ClientOptions, SapConfig, connect, fine_tune, split_pretrained
from privlm.service.process import start_privlm, stop
from tests.sap.conftest import LABELS, TEXTS
from tests.sap.service.conftest import KEYS
from tests.service.localhost import start_privlm_on_free_port

pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.xdist_group("ray")]  # one Ray cluster at a time
VALIDATION, VALIDATION_LABELS = TEXTS[:4], LABELS[:4]


def test_replicas_share_the_sessions_and_a_restart_loses_none(vendor_model, tmp_path):
    """Training runs through two replicas; the whole deployment is stopped mid-epoch and started again on the same
    store. The client resumes, and the adapter is the one of an uninterrupted run in one process."""
    def vendor(port: int) -> list[str]:
        return ["sap", "vendor", "--ray", "--replicas", "2", "--replica-cpus", "0.5", "--model", str(vendor_model),
                "--store", str(tmp_path / "store"), "--port", str(port), "--api-key", KEYS[0]]

    first, port = start_privlm_on_free_port(vendor, timeout=300)
    args, health = vendor(port), f"http://127.0.0.1:{port}/health"
    processes = [first]
    restarts: list[threading.Thread] = []
    config = SapConfig(blocks=0, eta=50.0, head="customer", epochs=2, batch_size=2, noise_seed=3)
    try:
        with Client(f"http://127.0.0.1:{port}", config=config, n_classes=2, api_key=KEYS[0],
                    cache_dir=tmp_path / "cache", options=ClientOptions(retry_for=300)) as client:
            sent, count = client.transport.exchange, 0

            def exchange(message):  # type: ignore[no-untyped-def]
                nonlocal count
                count += 1
                if count == 7:  # mid-epoch: the deployment goes down, and comes back on the same store
                    stop(processes[0])
                    restarts.append(threading.Thread(
                        target=lambda: processes.append(start_privlm(args, health, timeout=300))))
                    restarts[-1].start()
                return sent(message)

            client.transport.exchange = exchange  # type: ignore[method-assign]
            report = client.fit(TEXTS, LABELS, VALIDATION, VALIDATION_LABELS, progress=False)
            remote, _ = client.adapter()
    finally:
        for thread in restarts:  # a restart still under way is waited for, so that it is stopped too
            thread.join(timeout=330)
        stop(*processes)
    # the step in flight is replayed at least once (more if Ray routes a step's two requests apart)
    assert len(processes) == 2 and report.steps == 8 and report.rewinds >= 1
    parties = connect(split_pretrained(str(vendor_model), config=config, n_classes=2), config=config, n_classes=2)
    local = fine_tune(parties, TEXTS, LABELS, VALIDATION, VALIDATION_LABELS)
    adapted = parties.vendor.adapter_state()  # the chosen epoch's: fine_tune leaves the vendor there
    assert [vars(e) for e in report.epochs] == [vars(e) for e in local.epochs]
    assert all(torch.equal(remote[k], adapted[k]) for k in remote)


def test_a_replica_loads_its_model_and_serves_a_shared_store_with_the_options_given(vendor_model, tmp_path,
                                                                                    monkeypatch):
    """The application carries the settings, never a loaded model; each replica loads the model itself, reads its
    keys on its node, and serves the store shared."""
    import httpx

    from privlm.sap.service.ray import SapVendorServer, sap_vendor_application
    from privlm.settings.sap import SapVendorSettings
    from tests.service.localhost import serving

    settings = SapVendorSettings(store=str(tmp_path / "store"), model=str(vendor_model), splits=(0, 1),
                                 api_keys_env="PRIVLM_SAP_TEST_KEYS", checkpoint_every=7, max_sessions=3,
                                 replicas=2, replica_cpus=0.5, device="auto")
    deployment = sap_vendor_application(settings)._bound_deployment
    (bound,) = deployment.init_args
    assert deployment.num_replicas == 2 and bound.model == str(vendor_model) and bound.device in ("cpu", "cuda")
    monkeypatch.setenv("PRIVLM_SAP_TEST_KEYS", KEYS[0])  # read by the replica, not stored by Ray
    app = SapVendorServer(bound).__serve_build_asgi_app__()
    sessions = app.state.sessions
    assert sessions.shared and sessions.checkpoint_every == 7 and sessions.limits.max_sessions == 3
    assert sorted(sessions.bottoms) == [0, 1]
    with serving(app) as url:
        for key, status in ((KEYS[0], 200), (KEYS[1], 401)):
            assert httpx.get(f"{url}/metrics", headers={"authorization": f"Bearer {key}"}).status_code == status
