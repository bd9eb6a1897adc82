"""The SAP protocol between Customer and Vendor, in-process: what trains, what crosses, and bad messages."""

from __future__ import annotations

import math
import pickle
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from privlm.accounting import BudgetExhaustedError, Ledger
from privlm.mechanisms import PrivacyUnit
from privlm.models.batching import pad_ids
from privlm.sap import (
    CutGradient,
    FitOptions,
    Forward,
    LoraSettings,
    OutputGradient,
    PrivatizedBatch,
    ProtocolError,
    SapConfig,
    StepDone,
    TopOutput,
    Upload,
    connect,
    fine_tune,
    from_bytes,
    to_bytes,
)
from privlm.sap.messages import CustomerMessage
from tests.sap.conftest import LABELS, TEXTS


def _labels() -> torch.Tensor:
    return torch.tensor(LABELS)


def _frozen_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _changed(before: dict[str, torch.Tensor], model: torch.nn.Module) -> set[str]:
    return {name for name, p in model.named_parameters() if not torch.equal(before[name], p.detach())}


def _train_steps(parties, steps: int = 2) -> None:  # type: ignore[no-untyped-def]
    customer = parties.customer
    train = customer.tokenize(TEXTS)
    if not customer.config.trainable_bottom:
        customer.upload(train)
    for step in range(steps):
        customer.train_step(train, _labels(), [(2 * step + i) % len(TEXTS) for i in range(4)])


@pytest.mark.parametrize("head", ["vendor", "customer"])
def test_only_lora_and_the_head_change(make_parts, head: str) -> None:  # type: ignore[no-untyped-def]
    config = SapConfig(blocks=1, eta=None, head=head)  # type: ignore[arg-type]
    parties = connect(make_parts(config), config=config, n_classes=2)
    vendor_before = _frozen_params(parties.vendor.model)
    bottom_before = _frozen_params(parties.customer.bottom)
    head_before = None if parties.customer.head is None else _frozen_params(parties.customer.head)
    _train_steps(parties)
    changed = _changed(vendor_before, parties.vendor.model)
    assert changed, "training changed nothing"
    assert all("lora_" in name or ".head." in name for name in changed), sorted(changed)
    assert any("lora_B" in name for name in changed)
    assert any(".head." in name for name in changed) == (head == "vendor")
    if head_before is not None:  # the customer's head trained at the customer
        assert _changed(head_before, parties.customer.head)
    # a frozen bottom gets no gradient and does not move
    assert not _changed(bottom_before, parties.customer.bottom)
    assert all(p.grad is None and not p.requires_grad for p in parties.customer.bottom.parameters())


def test_trainable_bottom_gets_the_cut_gradient(make_parts) -> None:  # type: ignore[no-untyped-def]
    config = SapConfig(blocks=1, eta=5.0, trainable_bottom=True)
    replies: list[object] = []
    parties = connect(make_parts(config), config=config, n_classes=2)
    exchange = parties.transport.exchange

    def spy(message: CustomerMessage):  # type: ignore[no-untyped-def]
        reply = exchange(message)
        replies.append(reply)
        return reply

    parties.customer.transport = type("Spy", (), {"exchange": staticmethod(spy)})()
    before = _frozen_params(parties.customer.bottom)
    _train_steps(parties)
    cut = [r for r in replies if isinstance(r, CutGradient)]
    assert len(cut) == 2 and all(c.gradient.shape[-1] == 32 and c.gradient.abs().sum() > 0 for c in cut)
    assert _changed(before, parties.customer.bottom)
    assert parties.customer.account.releases == 8  # two batches of 4, each privatized when used


def test_cut_gradient_is_the_true_gradient_without_noise(make_parts, vendor_bert) -> None:  # type: ignore[no-untyped-def]
    """eta=None: the protocol's cut gradient equals autograd through the unsplit bottom+top."""
    config = SapConfig(blocks=1, eta=None, trainable_bottom=True)
    parts = make_parts(config)
    parties = connect(parts, config=config, n_classes=2)
    customer = parties.customer
    train = customer.tokenize(TEXTS[:4])
    ids, mask = pad_ids(train.ids, customer.tokenizer.pad_token_id, customer.device)
    reference_top = parties.vendor.model  # LoRA B is zero at init: same function as the plain top
    cut = parts.bottom(ids, mask).detach().requires_grad_(True)
    loss = torch.nn.functional.cross_entropy(reference_top(cut, mask), _labels()[:4])
    (expected,) = torch.autograd.grad(loss, cut)
    batch, _, _ = customer.release(train.ids, [0, 1, 2, 3], note="test", keep_graph=False)
    output = parties.vendor.handle(Forward(step=0, example_ids=batch.example_ids, train=True,
                                           bottom_fingerprint=parts.bottom.config.fingerprint, batch=batch))
    assert isinstance(output, TopOutput)
    _, gradient = customer._loss_gradient(output.values, _labels()[:4])
    reply = parties.vendor.handle(OutputGradient(step=0, gradient=gradient))
    assert isinstance(reply, CutGradient)
    torch.testing.assert_close(reply.gradient, expected, atol=1e-6, rtol=1e-4)


def test_saved_adapter_holds_only_what_trained(make_parts, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    config = SapConfig(blocks=0, eta=None)
    parties = connect(make_parts(config), config=config, n_classes=2)
    _train_steps(parties, steps=1)
    parties.vendor.save_adapter(tmp_path)
    with safe_open(str(tmp_path / "adapter_model.safetensors"), "pt") as handle:
        names = set(handle.keys())
    trained = {n for n, p in parties.vendor.model.named_parameters() if p.requires_grad}
    assert names and all("lora_" in n or ".head." in n for n in names), sorted(names)
    assert len(names) == len(trained)  # every trained tensor, nothing else
    assert (tmp_path / "adapter_config.json").exists()


def test_head_at_the_vendor_reveals_labels_and_at_the_customer_returns_h(make_parts) -> None:  # type: ignore[no-untyped-def]
    seen: dict[str, list[torch.Tensor]] = {"gradients": [], "ids": []}

    def observe(message: CustomerMessage) -> None:
        if isinstance(message, OutputGradient):
            seen["gradients"].append(message.gradient)
        if isinstance(message, Forward) and message.train:
            seen["ids"].append(message.example_ids)

    config = SapConfig(blocks=0, eta=None, head="vendor")
    _train_steps(connect(make_parts(config), config=config, n_classes=2, observer=observe))
    gradients, ids = torch.cat(seen["gradients"]), torch.cat(seen["ids"])
    assert gradients.shape[-1] == 2
    assert torch.equal(gradients.argmin(dim=-1), _labels()[ids])  # Algorithm 1 leaks every label exactly

    seen = {"gradients": [], "ids": []}
    config = SapConfig(blocks=0, eta=None, head="customer")
    parties = connect(make_parts(config), config=config, n_classes=2, observer=observe)
    assert parties.vendor.top.head is None and parties.vendor.output_kind == "representation"
    _train_steps(parties)
    assert torch.cat(seen["gradients"]).shape[-1] == 32  # dL/dh, not dL/dlogits


def _pending_vendor(make_parts):  # type: ignore[no-untyped-def]
    config = SapConfig(blocks=0, eta=None)
    parts = make_parts(config)
    parties = connect(parts, config=config, n_classes=2)
    train = parties.customer.tokenize(TEXTS)
    parties.customer.upload(train)
    forward = Forward(step=0, example_ids=torch.tensor([0, 1, 2]), train=True,
                      bottom_fingerprint=parts.bottom.config.fingerprint)
    output = parties.vendor.handle(forward)
    assert isinstance(output, TopOutput)
    return parties, output


@pytest.mark.parametrize(("gradient", "step", "match"), [
    (torch.zeros(3, 5), 0, "shape"),
    (torch.zeros(2, 2), 0, "shape"),
    (torch.zeros(3, 2, dtype=torch.float64), 0, "dtype"),
    (torch.tensor([[math.nan, 0.0]] * 3), 0, "NaN"),
    (torch.tensor([[math.inf, 0.0]] * 3), 0, "NaN or inf"),
    (torch.zeros(3, 2), 1, "no forward pass"),
    (torch.zeros(3, 2, dtype=torch.int64), 0, "dtype"),
])
def test_a_bad_gradient_leaves_the_vendor_unchanged(make_parts, gradient: torch.Tensor, step: int,  # type: ignore[no-untyped-def]
                                                    match: str) -> None:
    parties, output = _pending_vendor(make_parts)
    vendor = parties.vendor
    before = vendor.adapter_state()
    with pytest.raises(ProtocolError, match=match):
        vendor.handle(OutputGradient(step=step, gradient=gradient))
    assert vendor.steps_done == 0
    assert all(torch.equal(before[k], v) for k, v in vendor.adapter_state().items())
    # the step in flight survived: a good gradient still completes it
    assert isinstance(vendor.handle(OutputGradient(step=0, gradient=torch.full_like(output.values, 0.1))), StepDone)
    assert vendor.steps_done == 1
    assert any(not torch.equal(before[k], v) for k, v in vendor.adapter_state().items())


def test_bad_forwards_and_uploads_are_refused_without_a_trace(make_parts) -> None:  # type: ignore[no-untyped-def]
    parties, _ = _pending_vendor(make_parts)
    vendor = parties.vendor
    fingerprint = vendor.top.bottom_fingerprint
    stored = dict(vendor.uploaded)
    with pytest.raises(ProtocolError, match="out of order"):
        vendor.handle(Forward(step=3, example_ids=torch.tensor([0]), train=True, bottom_fingerprint=fingerprint))
    with pytest.raises(ProtocolError, match="bottom") as error:
        vendor.handle(Forward(step=0, example_ids=torch.tensor([0]), train=True, bottom_fingerprint="0" * 64))
    assert error.value.status == 409
    with pytest.raises(ProtocolError, match="never uploaded"):
        vendor.handle(Forward(step=0, example_ids=torch.tensor([99]), train=False, bottom_fingerprint=fingerprint))
    bad_batches = [
        PrivatizedBatch(torch.tensor([50]), torch.full((1, 3, 32), math.nan), torch.ones(1, 3, dtype=torch.int64)),
        PrivatizedBatch(torch.tensor([50]), torch.zeros(1, 3, 16), torch.ones(1, 3, dtype=torch.int64)),
        PrivatizedBatch(torch.tensor([50]), torch.zeros(1, 3, 32), torch.ones(1, 4, dtype=torch.int64)),
        PrivatizedBatch(torch.tensor([50]), torch.zeros(1, 3, 32), torch.full((1, 3), 2, dtype=torch.int64)),
        PrivatizedBatch(torch.tensor([50]), torch.zeros(1, 3, 32), torch.zeros(1, 3, dtype=torch.int64)),
        PrivatizedBatch(torch.tensor([50, 50]), torch.zeros(2, 3, 32), torch.ones(2, 3, dtype=torch.int64)),
        PrivatizedBatch(torch.tensor([-1]), torch.zeros(1, 3, 32), torch.ones(1, 3, dtype=torch.int64)),
        PrivatizedBatch(torch.tensor([50]), torch.zeros(1, 3, 32, dtype=torch.float16),
                        torch.ones(1, 3, dtype=torch.int64)),
    ]
    for batch in bad_batches:
        with pytest.raises(ProtocolError):
            vendor.handle(Upload(batch=batch, bottom_fingerprint=fingerprint))
    assert vendor.uploaded.keys() == stored.keys() and vendor.steps_done == 0


def test_forward_ids_must_match_the_batch_and_be_distinct(make_parts) -> None:  # type: ignore[no-untyped-def]
    parties, _ = _pending_vendor(make_parts)
    vendor = parties.vendor
    fingerprint = vendor.top.bottom_fingerprint
    batch = PrivatizedBatch(torch.tensor([0, 1]), torch.zeros(2, 3, 32), torch.ones(2, 3, dtype=torch.int64))
    with pytest.raises(ProtocolError, match="the batch's example ids"):
        vendor.handle(Forward(step=0, example_ids=torch.tensor([0, 2]), train=False, bottom_fingerprint=fingerprint,
                              batch=batch))
    with pytest.raises(ProtocolError, match="distinct"):
        vendor.handle(Forward(step=0, example_ids=torch.tensor([0, 0]), train=False, bottom_fingerprint=fingerprint))
    with pytest.raises(ProtocolError, match="non-negative"):
        vendor.handle(Forward(step=-1, example_ids=torch.tensor([0]), train=False, bottom_fingerprint=fingerprint))
    assert vendor.steps_done == 0


class _Tampering:
    """A transport that hands the customer a doctored reply to one kind of message."""

    def __init__(self, inner, kind: type, doctor) -> None:  # type: ignore[no-untyped-def]
        self.inner, self.kind, self.doctor = inner, kind, doctor

    def exchange(self, message: CustomerMessage) -> object:
        reply = self.inner.exchange(message)
        return self.doctor(reply) if isinstance(message, self.kind) else reply


def _bad_output(values: torch.Tensor | None = None, **change: object):  # type: ignore[no-untyped-def]
    def doctor(reply: TopOutput) -> TopOutput:
        fields = {"step": reply.step, "output": reply.output, "values": reply.values if values is None else values}
        return TopOutput(**(fields | change))  # type: ignore[arg-type]
    return doctor


@pytest.mark.parametrize(("trainable", "kind", "doctor", "match"), [
    (False, Forward, _bad_output(torch.zeros(4, 3)), "shape"),
    (False, Forward, _bad_output(torch.full((4, 2), math.nan)), "NaN"),
    (False, Forward, _bad_output(torch.zeros(4, 2, dtype=torch.float64)), "dtype"),
    (False, Forward, _bad_output(step=7), "for step 7"),
    (False, Forward, _bad_output(output="representation"), "expected logits"),
    (False, Forward, lambda reply: StepDone(step=reply.step), "expected TopOutput"),
    (False, OutputGradient, lambda reply: StepDone(step=reply.step + 1), "for step 1"),
    (False, OutputGradient, lambda reply: CutGradient(step=reply.step, gradient=torch.zeros(1)), "expected StepDone"),
    (True, OutputGradient, lambda reply: CutGradient(step=reply.step, gradient=reply.gradient[:, :1]), "shape"),
    (True, OutputGradient, lambda reply: CutGradient(step=reply.step, gradient=reply.gradient * math.inf), "NaN"),
])
def test_a_bad_reply_leaves_the_customer_unchanged(make_parts, trainable: bool, kind: type, doctor,  # type: ignore[no-untyped-def]
                                                   match: str) -> None:
    config = SapConfig(blocks=1, eta=5.0, trainable_bottom=trainable, noise_seed=0)
    parties = connect(make_parts(config), config=config, n_classes=2)
    customer = parties.customer
    customer.transport = _Tampering(customer.transport, kind, doctor)
    train = customer.tokenize(TEXTS)
    if not trainable:
        customer.upload(train)
    bottom_before = _frozen_params(customer.bottom)
    state = customer.state()
    with pytest.raises(ProtocolError, match=match):
        customer.train_step(train, _labels(), [0, 1, 2, 3])
    # nothing applied from a reply that failed its checks: models, optimisers and step as they were
    assert not _changed(bottom_before, customer.bottom) and customer.step == state.step == 0
    after = customer.state()
    assert after.bottom_optimizer == state.bottom_optimizer and after.head_optimizer == state.head_optimizer


def test_predictions_check_the_vendors_answer(make_parts) -> None:  # type: ignore[no-untyped-def]
    config = SapConfig(blocks=0, eta=None, head="customer")
    parties = connect(make_parts(config), config=config, n_classes=2)
    customer = parties.customer
    customer.transport = _Tampering(customer.transport, Forward, _bad_output(torch.zeros(8, 5)))
    with pytest.raises(ProtocolError, match="shape"):
        customer.predict(customer.tokenize(TEXTS))
    customer.transport = _Tampering(customer.transport.inner, Forward, _bad_output(output="logits"))
    with pytest.raises(ProtocolError, match="expected representation"):
        customer.predict(customer.tokenize(TEXTS))


def test_lora_dropout_is_seeded_and_leaves_the_global_rng_alone(make_parts) -> None:  # type: ignore[no-untyped-def]
    def adapter_after_training(dropout: float, seed: int) -> dict[str, torch.Tensor]:
        config = SapConfig(blocks=1, eta=None, seed=seed, lora=LoraSettings(dropout=dropout))
        parties = connect(make_parts(config), config=config, n_classes=2)
        _train_steps(parties, steps=3)
        assert not parties.vendor.model.training  # eval mode outside a training step
        return parties.vendor.adapter_state()

    global_state = torch.random.get_rng_state()
    with_dropout = adapter_after_training(0.5, 0)
    assert torch.equal(torch.random.get_rng_state(), global_state)
    assert all(torch.equal(v, adapter_after_training(0.5, 0)[k]) for k, v in with_dropout.items())  # reproducible
    without = adapter_after_training(0.0, 0)
    assert any(not torch.equal(v, without[k]) for k, v in with_dropout.items())  # the dropout did act


def test_messages_round_trip_through_bytes_and_nothing_else_parses() -> None:
    batch = PrivatizedBatch(torch.tensor([3, 4]), torch.randn(2, 3, 8), torch.ones(2, 3, dtype=torch.int64))
    for message in (Upload(batch=batch, bottom_fingerprint="ab"), StepDone(step=2),
                    Forward(step=1, example_ids=torch.tensor([3]), train=True, bottom_fingerprint="ab", batch=batch),
                    Forward(step=1, example_ids=torch.tensor([3]), train=False, bottom_fingerprint="ab"),
                    OutputGradient(step=5, gradient=torch.randn(2, 3)),
                    CutGradient(step=5, gradient=torch.randn(2, 3, 8))):
        back = from_bytes(to_bytes(message))
        assert type(back) is type(message)
        for name in vars(message):
            mine, theirs = getattr(message, name), getattr(back, name)
            if isinstance(mine, PrivatizedBatch):
                assert all(torch.equal(getattr(mine, f), getattr(theirs, f)) for f in ("example_ids", "values",
                                                                                      "attention_mask"))
            elif isinstance(mine, torch.Tensor):
                assert torch.equal(mine, theirs)
            else:
                assert mine == theirs
    for garbage in (b"", b"\x00" * 16, pickle.dumps(StepDone(step=1)), b"{}" * 10):
        with pytest.raises(ProtocolError):
            from_bytes(garbage)
    raw = to_bytes(StepDone(step=1)).replace(b"step-done", b"step-gone")
    with pytest.raises(ProtocolError):
        from_bytes(raw)
    with pytest.raises(ProtocolError, match="exceeds"):
        from_bytes(to_bytes(OutputGradient(step=0, gradient=torch.zeros(64, 64))), max_bytes=1000)


def test_every_release_is_charged_before_it_leaves(make_parts, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    config = SapConfig(blocks=0, eta=10.0)
    ledger = Ledger(tmp_path / "ledger.sqlite", budgets={PrivacyUnit.ETA_TOKEN: 50.0})
    parties = connect(make_parts(config), config=config, n_classes=2, ledger=ledger, principal="acme")
    with pytest.raises(BudgetExhaustedError):
        parties.customer.upload(parties.customer.tokenize(TEXTS))
    assert parties.transport.traffic.messages == 0 and not parties.vendor.uploaded
    assert ledger.spent("acme", PrivacyUnit.ETA_TOKEN) == 0


def test_fine_tune_chooses_the_epoch_on_validation_and_counts_what_crossed(make_parts) -> None:  # type: ignore[no-untyped-def]
    config = SapConfig(blocks=0, eta=50.0, epochs=3, batch_size=4)
    parties = connect(make_parts(config), config=config, n_classes=2)
    result = fine_tune(parties, TEXTS, LABELS, TEXTS[:4], LABELS[:4],
                       options=FitOptions(test_texts=TEXTS[4:], test_labels=LABELS[4:]))
    assert len(result.epochs) == 3 and result.steps == 6
    best = max(e.validation_accuracy for e in result.epochs)
    assert result.best.validation_accuracy == best
    assert result.best_epoch == min(e.epoch for e in result.epochs if e.validation_accuracy == best)
    # frozen bottom: train, validation and test are each released once, however many epochs
    assert result.account.releases == len(TEXTS) + 4 + 4
    tokens = parties.customer.tokenize(TEXTS + TEXTS[:4] + TEXTS[4:])
    specials = set(parties.customer.tokenizer.all_special_ids)
    noised = sum(1 for ids in tokens.ids for t in ids if t not in specials)
    assert result.account.noised_positions == noised
    assert result.account.eta_tokens == pytest.approx(50.0 * noised)
    by_purpose = result.traffic.by_purpose
    assert set(by_purpose) == {"upload", "training", "inference"}
    assert by_purpose["upload"]["messages"] == 1 and by_purpose["training"]["messages"] == 2 * result.steps
    assert sum(t["bytes_to_vendor"] + t["bytes_to_customer"] for t in by_purpose.values()) == \
        result.traffic.bytes_to_vendor + result.traffic.bytes_to_customer
    assert result.bytes_per_step() == result.traffic.bytes_for("training") / result.steps  # uploads apart
    assert by_purpose["upload"]["bytes_to_vendor"] > result.bytes_per_step()  # the upload is the whole train set
    assert 0 <= result.vendor_seconds <= result.wall_seconds


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"eta": 0.0}, "eta"), ({"eta": -1.0}, "eta"), ({"eta": math.nan}, "eta"), ({"eta": math.inf}, "eta"),
    ({"eta": True}, "eta"), ({"blocks": -1}, "blocks"), ({"head": "middle"}, "head"),
    ({"eta": 5.0, "cti": True, "cti_share": 0.0}, "cti_share"),
    ({"eta": 5.0, "cti": True, "cti_share": 1.0}, "cti_share"),
    ({"eta": 5.0, "cti_share": math.nan}, "cti_share"), ({"cti": True}, "needs an eta"),
    ({"eta": 5.0, "cti": True, "blocks": 2}, "embedding bottom"), ({"eta": 5.0, "exempt_eta": 1.0}, "exempt_eta"),
    ({"epochs": 0}, "epochs"), ({"learning_rate": -1.0}, "learning_rate"), ({"seed": -2}, "seed"),
    ({"eta": 5.0, "exempt_eta": 9.0}, "needs cti=True"), ({"blocks": 1, "clip_norm": 0.0}, "clip_norm"),
    ({"blocks": 1, "clip_norm": math.inf}, "clip_norm"), ({"blocks": 0, "clip_norm": 5.0}, "blocks >= 1"),
])
def test_bad_config_is_refused(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SapConfig(**kwargs)  # type: ignore[arg-type]


def test_mismatched_parts_labels_and_data_are_refused(make_parts) -> None:  # type: ignore[no-untyped-def]
    config = SapConfig(blocks=0, eta=None)
    parts, other = make_parts(config), make_parts(SapConfig(blocks=1, eta=None))
    with pytest.raises(ValueError, match="not the one the vendor"):
        connect(parts.__class__(bottom=other.bottom, top=parts.top, tokenizer=parts.tokenizer), config=config,
                n_classes=2)
    with pytest.raises(ValueError, match="blocks"):
        connect(other, config=config, n_classes=2)
    parties = connect(parts, config=config, n_classes=2)
    with pytest.raises(ValueError, match=r"\[0, 2\)"):
        fine_tune(parties, TEXTS, [0, 1, 2, 0, 1, 0, 1, 0], TEXTS[:2], [0, 1])
    with pytest.raises(ValueError, match="one id per text"):
        fine_tune(parties, TEXTS, LABELS[:3], TEXTS[:2], [0, 1])
    with pytest.raises(ValueError, match="empty"):
        fine_tune(parties, [], [], TEXTS[:2], [0, 1])
    with pytest.raises(ValueError, match="already carries LoRA"):
        connect(parts, config=config, n_classes=2)
    with pytest.raises(ValueError, match="n_classes"):
        connect(make_parts(config), config=config, n_classes=1)
    cti = SapConfig(blocks=0, eta=5.0, cti=True)
    with pytest.raises(ValueError, match="class 1 has no training examples"):
        fine_tune(connect(make_parts(cti), config=cti, n_classes=2), TEXTS, [0] * 8, TEXTS[:2], [0, 1])
