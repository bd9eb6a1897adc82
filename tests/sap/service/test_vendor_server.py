"""`privlm sap vendor` and `privlm.sap.Client` on a real uvicorn server on localhost."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load as load_safetensors

from privlm.sap import (
    Forward,
    OutputGradient,
    PrivatizedBatch,
    SapConfig,
    StepDone,
    TopOutput,
    Upload,
    connect,
    fine_tune,
    from_bytes,
    split_pretrained,
    to_bytes,
)
from privlm.sap.model import VendorModel
from privlm.sap.service.client import Client, ClientOptions
from privlm.sap.service.server import VendorOptions, create_vendor_app
from privlm.sap.service.wire import SESSIONS_PATH
from privlm.sap.training import MAX_REWINDS_WITHOUT_PROGRESS
from privlm.sap.transport import VendorBehindError
from privlm.service import ServerError
from privlm.service.process import start_privlm, stop
from tests.sap.conftest import LABELS, TEXTS
from tests.sap.service.conftest import KEYS
from tests.service.localhost import serving, start_privlm_on_free_port

VALIDATION, VALIDATION_LABELS = TEXTS[:4], LABELS[:4]


def _app(model: Path, store: Path, **options):  # type: ignore[no-untyped-def]
    return create_vendor_app(VendorModel.load(str(model), splits=(0, 1)), store=store, api_keys=KEYS,
                             options=VendorOptions(**options))


def _config(**change: object) -> SapConfig:
    settings: dict[str, object] = {"blocks": 0, "eta": 50.0, "head": "customer", "epochs": 2, "batch_size": 2,
                                   "noise_seed": 3}
    return SapConfig(**(settings | change))  # type: ignore[arg-type]


@pytest.mark.parametrize("head", ["customer", "vendor"])
def test_a_remote_fit_equals_the_in_process_one(vendor_model, tmp_path, head):
    config = _config(head=head)
    with serving(_app(vendor_model, tmp_path / "store")) as url, \
            Client(url, config=config, n_classes=2, api_key=KEYS[0], cache_dir=tmp_path / "cache") as client:
        report = client.fit(TEXTS, LABELS, VALIDATION, VALIDATION_LABELS, progress=False)
        remote, facts = client.adapter()
        probabilities = client.predict(TEXTS[:3])
    parties = connect(split_pretrained(str(vendor_model), config=config, n_classes=2), config=config, n_classes=2)
    local = fine_tune(parties, TEXTS, LABELS, VALIDATION, VALIDATION_LABELS)
    adapted = parties.vendor.adapter_state()  # the chosen epoch's: fine_tune leaves the vendor there
    assert [vars(e) for e in report.epochs] == [vars(e) for e in local.epochs]
    assert report.best_epoch == local.best_epoch and report.steps == local.steps == 8
    assert remote.keys() == adapted.keys()
    assert all(torch.equal(remote[k], adapted[k]) for k in remote)
    assert facts["head"] == head and facts["steps_done"] == 8 and facts["lora"]["rank"] == 8
    assert probabilities.shape == (3, 2) and torch.allclose(probabilities.sum(dim=1), torch.ones(3))
    by_purpose = report.traffic.by_purpose
    assert by_purpose["upload"]["messages"] == 1 and by_purpose["training"]["messages"] == 16
    assert report.account.eta_tokens == local.account.eta_tokens


@pytest.mark.slow
@pytest.mark.parametrize("trainable", [False, True])
@pytest.mark.parametrize("restart_at", [9, 13])
def test_a_restarted_vendor_resumes_and_the_result_is_the_same(vendor_model, tmp_path, trainable, restart_at):
    """The vendor loses its memory mid-epoch (a restart: only its store survives) at the ``restart_at``-th message;
    the customer rewinds to the vendor's last checkpoint, replays, and ends where an uninterrupted run ends."""
    config = _config(trainable_bottom=trainable, epochs=3)
    finals = []
    for restart in (None, restart_at):
        app = _app(vendor_model, tmp_path / f"store-{restart}", checkpoint_every=3)
        with serving(app) as url, Client(url, config=config, n_classes=2, api_key=KEYS[0],
                                         cache_dir=tmp_path / "cache") as client:
            sent = client.transport.exchange
            count = 0

            def exchange(message, sent=sent, client=client, restart=restart, app=app):  # type: ignore[no-untyped-def]
                nonlocal count
                count += 1
                if count == restart:
                    app.state.sessions.forget(client.session_id)
                return sent(message)

            client.transport.exchange = exchange  # type: ignore[method-assign]
            report = client.fit(TEXTS, LABELS, VALIDATION, VALIDATION_LABELS, progress=False)
            finals.append((report, client.adapter()[0], client.customer.head.state_dict()))
    (plain, adapter, head), (resumed, adapter_again, head_again) = finals
    assert plain.rewinds == 0 and resumed.rewinds == 1
    assert [vars(e) for e in resumed.epochs] == [vars(e) for e in plain.epochs]
    assert all(torch.equal(adapter[k], adapter_again[k]) for k in adapter)
    assert all(torch.equal(head[k], head_again[k]) for k in head)
    assert resumed.account == plain.account  # a replayed step resends its release: no new noise, no new charge


def test_a_vendor_that_keeps_restarting_is_given_up_as_a_server_error(vendor_model, tmp_path):
    """The vendor restarts before every step after the first, back to its checkpoint at step 0: the customer
    rewinds and replays until it gives up, and ``Client.fit`` says so as the vendor's failure (one line)."""
    app = _app(vendor_model, tmp_path / "store")
    with serving(app) as url, Client(url, config=_config(), n_classes=2, api_key=KEYS[0],
                                     cache_dir=tmp_path / "cache") as client:
        sent, restarts = client.transport.exchange, 0

        def exchange(message):  # type: ignore[no-untyped-def]
            nonlocal restarts
            if isinstance(message, Forward) and message.train and message.step >= 1:
                restarts += 1
                assert restarts < 50, "the training loop never gave up"
                app.state.sessions.forget(client.session_id)
            return sent(message)

        client.transport.exchange = exchange  # type: ignore[method-assign]
        with pytest.raises(ServerError, match="giving up") as refused:
            client.fit(TEXTS, LABELS, VALIDATION, VALIDATION_LABELS, progress=False)
    assert isinstance(refused.value.__cause__, VendorBehindError) and "\n" not in str(refused.value)
    assert restarts == MAX_REWINDS_WITHOUT_PROGRESS + 1


def _session(url: str, key: str, fingerprint: str, **change: object) -> dict:
    request = {"blocks": 0, "n_classes": 2, "head": "customer", "bottom_fingerprint": fingerprint} | change
    response = httpx.post(f"{url}{SESSIONS_PATH}", json=request, headers={"Authorization": f"Bearer {key}"})
    assert response.status_code == 201, response.text
    return response.json()


def _fingerprint(url: str, blocks: int = 0) -> str:
    return httpx.get(f"{url}/v1/sap/bottoms/{blocks}", headers={"Authorization": f"Bearer {KEYS[0]}"}).json()[
        "fingerprint"]


def _batch(rows: int = 2, length: int = 4, dim: int = 32, **change: object) -> PrivatizedBatch:
    fields = {"example_ids": torch.arange(rows), "values": torch.randn(rows, length, dim),
              "attention_mask": torch.ones(rows, length, dtype=torch.int64)} | change
    return PrivatizedBatch(**fields)  # type: ignore[arg-type]


def test_a_session_is_its_owners_alone(vendor_model, tmp_path):
    with serving(_app(vendor_model, tmp_path / "store")) as url:
        fingerprint = _fingerprint(url)
        mine = _session(url, KEYS[0], fingerprint)
        base = f"{url}{SESSIONS_PATH}/{mine['id']}"
        theirs = {"Authorization": f"Bearer {KEYS[1]}"}
        upload = to_bytes(Upload(batch=_batch(), bottom_fingerprint=fingerprint))
        answers = [httpx.get(base, headers=theirs), httpx.post(f"{base}/exchange", content=upload, headers=theirs),
                   httpx.get(f"{base}/adapter", headers=theirs), httpx.post(f"{base}/checkpoint", headers=theirs),
                   httpx.post(f"{base}/select", json={"step": 0}, headers=theirs),
                   httpx.delete(base, headers=theirs)]
        assert [a.status_code for a in answers] == [404] * 6
        assert all(a.json()["error"]["code"] == "session_not_found" for a in answers)
        nobody = httpx.get(base)
        assert nobody.status_code == 401
        info = httpx.get(base, headers={"Authorization": f"Bearer {KEYS[0]}"}).json()
        assert info["uploaded_examples"] == 0 and info["steps_done"] == 0  # nothing the other key sent landed


def test_bad_messages_get_a_4xx_and_change_nothing(vendor_model, tmp_path):
    with serving(_app(vendor_model, tmp_path / "store")) as url:
        fingerprint = _fingerprint(url)
        headers = {"Authorization": f"Bearer {KEYS[0]}"}
        session = _session(url, KEYS[0], fingerprint)
        base = f"{url}{SESSIONS_PATH}/{session['id']}"
        good = httpx.post(f"{base}/exchange", headers=headers,
                          content=to_bytes(Upload(batch=_batch(), bottom_fingerprint=fingerprint)))
        assert good.status_code == 200 and good.headers["x-privlm-checkpoint-step"] == "0"
        bad = {
            "not a message": b"\x00" * 40,
            "pickle": b"\x80\x04\x95\x10\x00\x00\x00\x00\x00\x00\x00}\x94.",
            "a vendor's message": to_bytes(StepDone(step=0)),
            "NaN": to_bytes(Upload(batch=_batch(values=torch.full((2, 4, 32), float("nan"))),
                                   bottom_fingerprint=fingerprint)),
            "wrong width": to_bytes(Upload(batch=_batch(dim=16), bottom_fingerprint=fingerprint)),
            "wrong dtype": to_bytes(Upload(batch=_batch(values=torch.zeros(2, 4, 32, dtype=torch.float64)),
                                           bottom_fingerprint=fingerprint)),
            "too many rows": to_bytes(Upload(batch=_batch(rows=300), bottom_fingerprint=fingerprint)),
            "too long": to_bytes(Upload(batch=_batch(length=65), bottom_fingerprint=fingerprint)),
            "so large the top overflows": to_bytes(Forward(step=0, example_ids=torch.arange(2), train=True,
                                                           bottom_fingerprint=fingerprint,
                                                           batch=_batch(values=torch.full((2, 4, 32), 1e38)))),
            "another bottom": to_bytes(Upload(batch=_batch(), bottom_fingerprint="0" * 64)),
            "a step out of order": to_bytes(Forward(step=5, example_ids=torch.tensor([0]), train=True,
                                                    bottom_fingerprint=fingerprint)),
            "a gradient for no step": to_bytes(OutputGradient(step=0, gradient=torch.zeros(1, 32))),
        }
        for what, body in bad.items():
            answer = httpx.post(f"{base}/exchange", content=body, headers=headers)
            assert 400 <= answer.status_code < 500, (what, answer.status_code, answer.text)
            assert answer.json()["error"]["message"], what
        assert httpx.post(f"{base}/exchange", content=b"x" * (65 * 2**20), headers=headers).status_code == 413
        info = httpx.get(base, headers=headers).json()
        assert info["uploaded_examples"] == 2 and info["steps_done"] == 0
        for change, status in [({"bottom_fingerprint": "0" * 64}, 409), ({"blocks": 2}, 422), ({"n_classes": 1}, 400),
                               ({"head": "middle"}, 400), ({"lora": {"rank": 0}}, 400), ({"surprise": 1}, 400)]:
            request = {"blocks": 0, "n_classes": 2, "head": "customer", "bottom_fingerprint": fingerprint} | change
            answer = httpx.post(f"{url}{SESSIONS_PATH}", json=request, headers=headers)
            assert answer.status_code == status, (change, answer.text)


def test_a_gradient_sent_twice_is_applied_once(vendor_model, tmp_path):
    with serving(_app(vendor_model, tmp_path / "store")) as url:
        fingerprint = _fingerprint(url)
        headers = {"Authorization": f"Bearer {KEYS[0]}"}
        base = f"{url}{SESSIONS_PATH}/{_session(url, KEYS[0], fingerprint)['id']}"

        def send(message: object) -> httpx.Response:
            return httpx.post(f"{base}/exchange", content=to_bytes(message), headers=headers)  # type: ignore[arg-type]

        assert send(Upload(batch=_batch(), bottom_fingerprint=fingerprint)).status_code == 200
        output = from_bytes(send(Forward(step=0, example_ids=torch.tensor([0, 1]), train=True,
                                         bottom_fingerprint=fingerprint)).content)
        assert isinstance(output, TopOutput) and output.values.shape == (2, 32)
        gradient = OutputGradient(step=0, gradient=torch.full((2, 32), 0.1))
        first, again = send(gradient), send(gradient)
        assert from_bytes(first.content) == from_bytes(again.content) == StepDone(step=0)
        assert again.headers["x-privlm-steps-done"] == "1"
        other = send(OutputGradient(step=0, gradient=torch.full((2, 32), 0.2)))
        assert other.status_code == 409 and "another gradient" in other.json()["error"]["message"]
        assert httpx.get(base, headers=headers).json()["steps_done"] == 1


def test_the_bottom_bundle_holds_none_of_the_top(vendor_model, tmp_path):
    with serving(_app(vendor_model, tmp_path / "store")) as url:
        headers = {"Authorization": f"Bearer {KEYS[0]}"}
        manifest = httpx.get(f"{url}/v1/sap/bottoms/1", headers=headers).json()
        names = {f["name"] for f in manifest["files"]}
        assert {"bottom.safetensors", "bottom.json"} <= names
        assert all(n in ("bottom.safetensors", "bottom.json") or n.startswith("tokenizer/") for n in names)
        weights = load_safetensors(httpx.get(f"{url}/v1/sap/bottoms/1/files/bottom.safetensors",
                                             headers=headers).content)
        layers = {name.split("layer.")[1].split(".")[0] for name in weights if "layer." in name}
        assert layers == {"0"}  # one block of three: the top's blocks never leave
        described = httpx.get(f"{url}/v1/sap/bottoms/1/files/bottom.json", headers=headers).text
        assert str(vendor_model) not in described and str(tmp_path) not in described
        assert json.loads(described)["fingerprint"] == manifest["fingerprint"]
        assert httpx.get(f"{url}/v1/sap/bottoms/2", headers=headers).status_code == 404  # not offered


def test_the_store_holds_safetensors_and_json_only(vendor_model, tmp_path):
    store = tmp_path / "store"
    with serving(_app(vendor_model, store, checkpoint_every=2)) as url, \
            Client(url, config=_config(epochs=1), n_classes=2, api_key=KEYS[0], cache_dir=tmp_path / "c") as client:
        client.fit(TEXTS, LABELS, VALIDATION, VALIDATION_LABELS, progress=False)
    files = [p for p in store.rglob("*") if p.is_file() and p.parent != store]  # the sessions' files
    assert {p.suffix for p in files} == {".json", ".safetensors"}
    owners = sorted(p.name for p in store.iterdir() if p.is_file())  # the owners' secret (raw bytes), its check (hex)
    assert owners == ["principals.check", "principals.secret"]
    assert not any(b"\x80\x04\x95" in p.read_bytes()[:16] for p in files)  # no pickle stream


@pytest.mark.slow
def test_killing_the_vendor_process_mid_epoch(vendor_model, tmp_path):
    """The vendor's process is killed (SIGKILL) mid-epoch and started again on the same store and port; the
    customer rides it out (retries with back-off), resumes, and ends with the adapter of an uninterrupted run."""
    def vendor(port: int) -> list[str]:
        return ["sap", "vendor", "--model", str(vendor_model), "--store", str(tmp_path / "store"), "--port", str(port),
                "--checkpoint-every", "3", "--device", "cpu", "--api-key", KEYS[0]]

    first, port = start_privlm_on_free_port(vendor)
    args, health = vendor(port), f"http://127.0.0.1:{port}/health"
    processes = [first]
    restarts: list[threading.Timer] = []
    config = _config(epochs=2)
    try:
        with Client(f"http://127.0.0.1:{port}", config=config, n_classes=2, api_key=KEYS[0],
                    cache_dir=tmp_path / "cache", options=ClientOptions(retry_for=120)) as client:
            sent, count = client.transport.exchange, 0

            def exchange(message):  # type: ignore[no-untyped-def]
                nonlocal count
                count += 1
                if count == 9:  # step 3's gradient: after the checkpoint at step 3, before the epoch's end
                    processes[0].kill()
                    processes[0].wait()
                    restarts.append(threading.Timer(0.5, lambda: processes.append(start_privlm(args, health))))
                    restarts[-1].start()
                return sent(message)

            client.transport.exchange = exchange  # type: ignore[method-assign]
            report = client.fit(TEXTS, LABELS, VALIDATION, VALIDATION_LABELS, progress=False)
            remote, _ = client.adapter()
    finally:
        for timer in restarts:  # a restart still under way is waited for, so that it is stopped too
            timer.join(timeout=150)
        stop(*processes)
    assert len(processes) == 2 and report.rewinds == 1 and client.retry.failed_attempts > 0
    parties = connect(split_pretrained(str(vendor_model), config=config, n_classes=2), config=config, n_classes=2)
    local = fine_tune(parties, TEXTS, LABELS, VALIDATION, VALIDATION_LABELS)
    adapted = parties.vendor.adapter_state()  # the chosen epoch's: fine_tune leaves the vendor there
    assert [vars(e) for e in report.epochs] == [vars(e) for e in local.epochs]
    assert all(torch.equal(remote[k], adapted[k]) for k in remote)


def _raw_message(kind: str, tensors: dict[str, torch.Tensor], fields: dict[str, object]) -> bytes:
    from safetensors.torch import save

    return save(tensors, metadata={"kind": kind, "fields": json.dumps(fields)})


def test_fields_in_the_wrong_form_are_a_4xx(vendor_model, tmp_path):
    """Hand-made messages whose fields come as the wrong kind of value: each a 4xx naming the field."""
    with serving(_app(vendor_model, tmp_path / "store")) as url:
        fingerprint = _fingerprint(url)
        headers = {"Authorization": f"Bearer {KEYS[0]}"}
        base = f"{url}{SESSIONS_PATH}/{_session(url, KEYS[0], fingerprint)['id']}"
        bad = [
            _raw_message("upload", {}, {"bottom_fingerprint": fingerprint}),  # no batch
            _raw_message("forward", {"example_ids": torch.arange(2), "train": torch.ones(3)},
                         {"step": 0, "bottom_fingerprint": fingerprint}),  # a tensor for a boolean
            _raw_message("output-gradient", {"gradient": torch.zeros(2, 32), "step": torch.arange(3)}, {}),
            _raw_message("forward", {"example_ids": torch.arange(2)},
                         {"step": [0], "train": True, "bottom_fingerprint": fingerprint}),  # a list for a step
            _raw_message("upload", {"batch.values": torch.zeros(1, 2, 32)}, {"bottom_fingerprint": fingerprint}),
            to_bytes(Upload(batch=_batch(attention_mask=torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])),
                            bottom_fingerprint=fingerprint)),  # not right-padded
        ]
        for body in bad:
            answer = httpx.post(f"{base}/exchange", content=body, headers=headers)
            assert 400 <= answer.status_code < 500, answer.text
            assert answer.json()["error"]["param"], answer.text
        request = {"n_classes": 2, "head": "customer", "bottom_fingerprint": fingerprint,
                   "lora": {"target_modules": ["nope"]}}
        answer = httpx.post(f"{url}{SESSIONS_PATH}", headers=headers, json=request)
        assert answer.status_code == 400 and answer.json()["error"]["param"] == "lora.target_modules"


def test_an_upload_resent_is_stored_once_and_a_changed_one_refused(vendor_model, tmp_path):
    with serving(_app(vendor_model, tmp_path / "store")) as url:
        fingerprint = _fingerprint(url)
        headers = {"Authorization": f"Bearer {KEYS[0]}"}
        session = _session(url, KEYS[0], fingerprint)
        base = f"{url}{SESSIONS_PATH}/{session['id']}"
        upload = to_bytes(Upload(batch=_batch(), bottom_fingerprint=fingerprint))
        assert [httpx.post(f"{base}/exchange", content=upload, headers=headers).status_code
                for _ in range(3)] == [200] * 3
        assert len(list((tmp_path / "store" / session["id"] / "uploads").iterdir())) == 1
        changed = to_bytes(Upload(batch=_batch(), bottom_fingerprint=fingerprint))  # new random values, same ids
        answer = httpx.post(f"{base}/exchange", content=changed, headers=headers)
        assert answer.status_code == 409 and answer.json()["error"]["param"] == "example_ids"


def test_idle_sessions_leave_memory_not_the_store_and_keys_have_a_quota(vendor_model, tmp_path):
    from privlm.sap.service.sessions import SessionLimits

    app = _app(vendor_model, tmp_path / "store", limits=SessionLimits(max_sessions=1, max_sessions_per_key=2))
    with serving(app) as url:
        fingerprint = _fingerprint(url)
        headers = {"Authorization": f"Bearer {KEYS[0]}"}
        first, second = _session(url, KEYS[0], fingerprint), _session(url, KEYS[0], fingerprint)
        assert app.state.sessions.session_count == 1  # the first was checkpointed and left memory
        upload = to_bytes(Upload(batch=_batch(), bottom_fingerprint=fingerprint))
        answer = httpx.post(f"{url}{SESSIONS_PATH}/{first['id']}/exchange", content=upload, headers=headers)
        assert answer.status_code == 200  # restored from the store when used
        third = httpx.post(f"{url}{SESSIONS_PATH}", headers=headers,
                           json={"n_classes": 2, "head": "customer", "bottom_fingerprint": fingerprint})
        assert third.status_code == 429 and third.json()["error"]["param"] == "max_sessions_per_key"
        assert httpx.get(f"{url}{SESSIONS_PATH}/{second['id']}", headers=headers).status_code == 200


@pytest.mark.slow
def test_early_stopping_selects_the_best_epoch_and_a_restart_keeps_it(vendor_model, tmp_path):
    """With patience 1 the run stops once validation has not improved; the vendor serves the chosen epoch's
    adapter, and still does after a restart (the selection is checkpointed)."""
    config = _config(epochs=6, learning_rate=0.05)
    app = _app(vendor_model, tmp_path / "store")
    with serving(app) as url, Client(url, config=config, n_classes=2, api_key=KEYS[0],
                                     cache_dir=tmp_path / "cache") as client:
        report = client.fit(TEXTS, LABELS, VALIDATION, VALIDATION_LABELS, patience=1, progress=False)
        chosen, _ = client.adapter()
        app.state.sessions.forget(client.session_id)  # a restart: the session comes back from the store
        again, _ = client.adapter()
    best = max(e.validation_accuracy for e in report.epochs)
    assert report.epochs[report.best_epoch - 1].validation_accuracy == best
    assert report.stopped_early == (len(report.epochs) < 6)
    assert len(report.epochs) - report.best_epoch <= 1  # patience 1: at most one epoch past the best
    assert all(torch.equal(chosen[k], again[k]) for k in chosen)
    ran = SapConfig(**{**vars(config), "epochs": len(report.epochs)})  # the same epochs, in one process
    parties = connect(split_pretrained(str(vendor_model), config=ran, n_classes=2), config=ran, n_classes=2)
    local = fine_tune(parties, TEXTS, LABELS, VALIDATION, VALIDATION_LABELS)
    adapted = parties.vendor.adapter_state()  # the chosen epoch's: fine_tune leaves the vendor there
    assert local.best_epoch == report.best_epoch
    assert all(torch.equal(chosen[k], adapted[k]) for k in chosen)  # the chosen epoch's adapter


def test_a_404_from_a_proxy_is_waited_out_and_the_vendors_own_is_final():
    from privlm.sap.service.client import vendor_answer

    request = httpx.Request("POST", "http://127.0.0.1:9/v1/sap/sessions/x/exchange")
    proxy = httpx.Response(404, text="Path '/v1/sap/sessions/x/exchange' not found.", request=request)
    assert vendor_answer(proxy).status_code == 503  # retried by the policy
    ours = httpx.Response(404, json={"error": {"message": "no such session", "type": "not_found_error"}},
                          request=request)
    assert vendor_answer(ours) is ours
