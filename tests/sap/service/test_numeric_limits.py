"""Issue 22, finding 6: the SAP vendor's numeric limits, on a real vendor on localhost.

Finite but absurd values (1e38) are refused with a 422 where they arrive: an upload at upload, a gradient before
its step. A step that would still leave the adapter or its optimiser's moments non-finite is undone and refused, and
the step stays in flight: a sane gradient sent next takes it, to the bit as if the bad one had never come.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load as load_safetensors

from privlm.sap import Forward, OutputGradient, PrivatizedBatch, StepDone, Upload, from_bytes, to_bytes
from privlm.sap.model import VendorModel
from privlm.sap.service.server import VendorOptions, create_vendor_app
from privlm.sap.service.sessions import SessionLimits
from privlm.sap.service.wire import SESSIONS_PATH
from tests.sap.service.conftest import KEYS
from tests.service.localhost import serving

HEADERS = {"Authorization": f"Bearer {KEYS[0]}"}
ABSURD = 1e38  # finite in float32
MAX_ABS_VALUE = 1e4  # the bound docs/sap.md states, per entry of a representation or a gradient


class _Session:
    """One fine-tuning session on the vendor at ``url``, spoken to in raw SAP messages."""

    def __init__(self, url: str, *, head: str = "customer") -> None:
        self.url = url
        self.fingerprint = httpx.get(f"{url}/v1/sap/bottoms/0", headers=HEADERS).json()["fingerprint"]
        request = {"blocks": 0, "n_classes": 2, "head": head, "bottom_fingerprint": self.fingerprint}
        created = httpx.post(f"{url}{SESSIONS_PATH}", json=request, headers=HEADERS)
        assert created.status_code == 201, created.text
        self.id = created.json()["id"]
        self.base = f"{url}{SESSIONS_PATH}/{self.id}"

    def send(self, message: object) -> httpx.Response:
        return httpx.post(f"{self.base}/exchange", content=to_bytes(message), headers=HEADERS)  # type: ignore[arg-type]

    def upload(self, values: torch.Tensor) -> httpx.Response:
        batch = PrivatizedBatch(example_ids=torch.arange(values.shape[0]), values=values,
                                attention_mask=torch.ones(values.shape[:2], dtype=torch.int64))
        return self.send(Upload(batch=batch, bottom_fingerprint=self.fingerprint))

    def forward(self, step: int = 0) -> torch.Tensor:
        answer = self.send(Forward(step=step, example_ids=torch.arange(2), train=True,
                                   bottom_fingerprint=self.fingerprint))
        assert answer.status_code == 200, answer.text
        return from_bytes(answer.content).values  # type: ignore[union-attr]

    def info(self) -> dict:
        return httpx.get(self.base, headers=HEADERS).json()

    def adapter(self) -> dict[str, torch.Tensor]:
        return load_safetensors(httpx.get(f"{self.base}/adapter", headers=HEADERS).content)


def _values(seed: int = 0) -> torch.Tensor:
    return torch.randn(2, 4, 32, generator=torch.Generator().manual_seed(seed))


def _app(model: Path, store: Path, *, checkpoint_every: int = 50, **limits: object):  # type: ignore[no-untyped-def]
    options = VendorOptions(checkpoint_every=checkpoint_every, limits=SessionLimits(**limits))  # type: ignore[arg-type]
    return create_vendor_app(VendorModel.load(str(model)), store=store, api_keys=KEYS, options=options)


def _refused(answer: httpx.Response, *, param: str, code: str) -> None:
    assert answer.status_code == 422, answer.text
    error = answer.json()["error"]
    assert (error["param"], error["code"], error["type"]) == (param, code, "invalid_request_error"), error


def _a_clean_step(url: str, head: str, gradient: float) -> dict[str, torch.Tensor]:
    """The adapter after one step that only ever saw the sane gradient (same seed, same upload)."""
    session = _Session(url, head=head)
    assert session.upload(_values()).status_code == 200
    output = session.forward()
    assert session.send(OutputGradient(step=0, gradient=torch.full(tuple(output.shape), gradient))).status_code == 200
    return session.adapter()


def _all_finite(adapter: dict[str, torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(tensor).all()) for tensor in adapter.values())


def test_finding_6_absurd_values_are_refused_at_upload_not_at_first_use(vendor_model, tmp_path):
    with serving(_app(vendor_model, tmp_path / "store")) as url:
        session = _Session(url)
        _refused(session.upload(torch.full((2, 4, 32), ABSURD)), param="values", code="value_out_of_range")
        beyond = _values()
        beyond[1, 2, 3] = 1.5 * MAX_ABS_VALUE
        _refused(session.upload(beyond), param="values", code="value_out_of_range")
        assert session.info()["uploaded_examples"] == 0
        assert not list((tmp_path / "store" / session.id / "uploads").glob("*"))  # nothing was stored either
        fresh = PrivatizedBatch(example_ids=torch.arange(2), values=torch.full((2, 4, 32), -ABSURD),
                                attention_mask=torch.ones(2, 4, dtype=torch.int64))
        _refused(session.send(Forward(step=0, example_ids=torch.arange(2), train=True,
                                      bottom_fingerprint=session.fingerprint, batch=fresh)),
                 param="values", code="value_out_of_range")
        at_the_bound = _values()
        at_the_bound[0, 0, 0] = MAX_ABS_VALUE  # the bound itself is allowed, and the top runs on it
        assert session.upload(at_the_bound).status_code == 200
        assert torch.isfinite(session.forward()).all()


@pytest.mark.parametrize("head", ["customer", "vendor"])
def test_finding_6_an_absurd_gradient_is_a_422_and_a_sane_one_then_takes_the_step(vendor_model, tmp_path, head):
    with serving(_app(vendor_model, tmp_path / "store")) as url:
        session = _Session(url, head=head)
        assert session.upload(_values()).status_code == 200
        output = session.forward()
        before = session.adapter()
        _refused(session.send(OutputGradient(step=0, gradient=torch.full(tuple(output.shape), ABSURD))),
                 param="gradient", code="value_out_of_range")
        assert session.info()["steps_done"] == 0
        assert all(torch.equal(before[k], v) for k, v in session.adapter().items())
        taken = session.send(OutputGradient(step=0, gradient=torch.full(tuple(output.shape), 0.1)))
        assert taken.status_code == 200 and from_bytes(taken.content) == StepDone(step=0)
        adapter, clean = session.adapter(), _a_clean_step(url, head, 0.1)
        assert _all_finite(adapter) and all(torch.equal(adapter[k], clean[k]) for k in clean)


@pytest.mark.parametrize("head", ["customer", "vendor"])
def test_finding_6_a_step_that_would_go_non_finite_is_undone_and_refused(vendor_model, tmp_path, head):
    """With the bound raised out of the way, 1e38 reaches the step: LoRA goes NaN (head at the customer) or AdamW's
    moments go inf (head at the vendor, the parameters stay finite and would never move again). Either way the
    vendor undoes the step, answers 422, checkpoints nothing, and the step in flight takes a sane gradient next."""
    with serving(_app(vendor_model, tmp_path / "store", max_abs_value=3e38, checkpoint_every=1)) as url:
        session = _Session(url, head=head)
        assert session.upload(_values()).status_code == 200
        output = session.forward()
        before = session.adapter()
        _refused(session.send(OutputGradient(step=0, gradient=torch.full(tuple(output.shape), ABSURD))),
                 param="gradient", code="step_not_finite")
        info = session.info()
        assert (info["steps_done"], info["checkpoint_step"]) == (0, 0)
        assert all(torch.equal(before[k], v) for k, v in session.adapter().items())
        taken = session.send(OutputGradient(step=0, gradient=torch.full(tuple(output.shape), 0.1)))
        assert taken.status_code == 200 and from_bytes(taken.content) == StepDone(step=0)
        again = session.forward(step=1)  # the next step runs on a finite adapter and finite moments
        assert torch.isfinite(again).all()
        assert session.send(OutputGradient(step=1, gradient=torch.full(tuple(again.shape), 0.1))).status_code == 200
        reference = _Session(url, head=head)
        assert reference.upload(_values()).status_code == 200
        for step in range(2):
            out = reference.forward(step=step)
            assert reference.send(OutputGradient(step=step, gradient=torch.full(tuple(out.shape), 0.1))
                                  ).status_code == 200
        adapter, clean = session.adapter(), reference.adapter()
        assert _all_finite(adapter) and all(torch.equal(adapter[k], clean[k]) for k in clean)
