"""`VendorSessions` without HTTP: two replicas over one shared store."""

from __future__ import annotations

import torch

from privlm.models.loading import load_pretrained
from privlm.models.partition import split_model
from privlm.sap import Forward, OutputGradient, PrivatizedBatch, StepDone, TopOutput, Upload, from_bytes, to_bytes
from privlm.sap.service.sessions import VendorSessions
from privlm.sap.service.store import SessionStore
from privlm.sap.service.wire import SessionRequest


def _replicas(vendor_model, store_dir):  # type: ignore[no-untyped-def]
    loaded = load_pretrained(str(vendor_model), device=torch.device("cpu"), causal_lm_head=False)
    bottom, _ = split_model(loaded.model, 0, pooling="mean")
    return [VendorSessions(loaded.model, bottoms={0: bottom}, pooling="mean", store=SessionStore(store_dir),
                           shared=True) for _ in range(2)], bottom.config.fingerprint


def test_a_replica_reloads_a_session_another_moved_on(vendor_model, tmp_path):
    (a, b), fingerprint = _replicas(vendor_model, tmp_path / "store")
    owner = "acme"
    info = a.create(SessionRequest(n_classes=2, head="customer", bottom_fingerprint=fingerprint), owner)
    sid = info.id
    batch = PrivatizedBatch(torch.arange(4), torch.randn(4, 5, 32), torch.ones(4, 5, dtype=torch.int64))

    def step(replica: VendorSessions, number: int) -> object:
        forward = Forward(step=number, example_ids=torch.tensor([0, 1]), train=True, bottom_fingerprint=fingerprint)
        output = from_bytes(replica.exchange(sid, owner, to_bytes(forward))[0])
        assert isinstance(output, TopOutput)
        gradient = OutputGradient(step=number, gradient=torch.full_like(output.values, 0.1))
        return from_bytes(replica.exchange(sid, owner, to_bytes(gradient))[0])

    a.exchange(sid, owner, to_bytes(Upload(batch=batch, bottom_fingerprint=fingerprint)))
    assert step(a, 0) == StepDone(step=0)
    assert step(b, 1) == StepDone(step=1)  # b loads the session, with a's upload and step, from the store
    assert step(a, 2) == StepDone(step=2)  # a's copy was at step 1: stale, so it reloads b's before stepping
    assert a.info(sid, owner).steps_done == b.info(sid, owner).steps_done == 3
    adapter_a, _ = a.adapter(sid, owner)
    adapter_b, _ = b.adapter(sid, owner)
    assert all(torch.equal(adapter_a[k], adapter_b[k]) for k in adapter_a)
