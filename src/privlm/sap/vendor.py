"""The vendor: keeps the top model, trains LoRA on it from privatized representations (SAP, Algorithm 1).

One training step is two messages. ``Forward(step, train=True)`` runs the top and keeps the graph;
``OutputGradient(step)`` backpropagates the customer's dL/d(output) into LoRA (and the head when it sits here),
takes one AdamW step, and answers ``CutGradient`` (dL/d(cut), a trainable bottom) or ``StepDone``. A step number
must be the next one; a repeated ``Forward`` for the step in flight replaces it (a retry). Every message is
checked in full before anything changes, so a bad one leaves the vendor as it was: that includes entries beyond
``max_abs_value`` in magnitude, and a step that would leave a parameter or an optimiser moment non-finite (it is
undone, and the step stays in flight for a gradient that works).
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from peft import get_peft_model_state_dict

from privlm.models.partition import TopModel
from privlm.sap.config import LoraSettings
from privlm.sap.messages import (
    MAX_ABS_VALUE,
    CustomerMessage,
    CutGradient,
    Forward,
    OutputGradient,
    ProtocolError,
    StepDone,
    TopOutput,
    Upload,
    Uploaded,
    VendorMessage,
    check_step,
    check_tensor,
)
from privlm.sap.model import add_lora, dropout_seed, lora_dropout
from privlm.validation import check_positive_finite


@dataclass(frozen=True)
class _LastStep:
    """The last step taken: its gradient's digest and the answer, replayed if the gradient comes again."""

    step: int
    gradient_digest: str
    reply: CutGradient | StepDone


def _finite(output: torch.Tensor) -> torch.Tensor:
    """Finite values so large that the top overflows (1e38, say) are refused like non-finite ones."""
    if not bool(torch.isfinite(output).all()):
        raise ProtocolError("the top's output is not finite for these values: they are too large", limit="finite")
    return output


def _digest(tensor: torch.Tensor) -> str:
    data = tensor.detach().cpu().contiguous()
    return hashlib.sha256(f"{data.dtype}{tuple(data.shape)}".encode() + data.numpy().tobytes()).hexdigest()


@dataclass(frozen=True)
class _Snapshot:
    """The trainable parameters and the optimiser's state before a step, to undo a step that went non-finite."""

    parameters: list[torch.Tensor]
    optimizer_state: dict[torch.Tensor, dict[str, Any]]


@dataclass
class _Pending:
    step: int
    output: torch.Tensor
    cut: torch.Tensor | None  # a leaf with requires_grad when the customer wants the cut gradient
    inputs: tuple[torch.Tensor, torch.Tensor]  # values and mask, to run the forward pass again after an undone step


class Vendor:
    """The vendor's party. ``top`` carries the head when it sits at the vendor."""

    def __init__(self, top: TopModel, *, lora: LoraSettings | None = None, learning_rate: float = 1e-3,
                 send_cut_gradient: bool = False, seed: int = 0, max_abs_value: float = MAX_ABS_VALUE) -> None:
        if hasattr(top, "peft_config"):
            raise ValueError("this top already carries LoRA adapters (a top serves one vendor); split the model again")
        self.top = top
        self.lora = lora or LoraSettings()
        self.model = add_lora(top, self.lora, seed=seed)
        self.model.eval()  # the frozen layers' own dropout stays off; LoRA's is switched on per training step
        self.seed = seed
        self.max_abs_value = check_positive_finite("max_abs_value", max_abs_value)
        self.send_cut_gradient = send_cut_gradient
        self.optimizer = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=learning_rate)
        self.device = next(top.parameters()).device
        self.uploaded: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # example id -> (values, mask), unpadded
        self.steps_done = 0
        self.seconds = 0.0
        self._pending: _Pending | None = None
        self._last: _LastStep | None = None

    @property
    def output_kind(self) -> str:
        return "logits" if self.top.head is not None else "representation"

    def handle(self, message: CustomerMessage) -> VendorMessage:
        """Answer one customer message (the transport-agnostic entry point)."""
        start = time.perf_counter()
        try:
            if isinstance(message, Upload):
                return self.upload(message)
            if isinstance(message, Forward):
                return self.forward(message)
            if isinstance(message, OutputGradient):
                return self.backward(message)
            raise ProtocolError(f"the vendor does not take {type(message).__name__} messages")
        finally:
            self.seconds += time.perf_counter() - start

    def _check_fingerprint(self, fingerprint: object) -> None:
        if fingerprint != self.top.bottom_fingerprint:
            raise ProtocolError(f"the batch comes from bottom {str(fingerprint)[:12]}…, this top was split with "
                                f"bottom {self.top.bottom_fingerprint[:12]}…", status=409, limit="bottom_fingerprint")

    def upload(self, message: Upload) -> Uploaded:
        self._check_fingerprint(message.bottom_fingerprint)
        batch = message.batch.check(hidden_size=self.top.hidden_size, max_abs=self.max_abs_value)
        rows = {}
        for example_id, values, mask in zip(batch.example_ids.tolist(), batch.values, batch.attention_mask,
                                            strict=True):
            length = int(mask.sum())
            rows[example_id] = (values[:length].clone(), mask[:length].clone())
        self.uploaded.update(rows)
        return Uploaded(stored=len(self.uploaded))

    def _stored_batch(self, example_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if len(set(example_ids.tolist())) != example_ids.numel():
            raise ProtocolError("example_ids must be distinct", limit="example_ids")
        missing = [i for i in example_ids.tolist() if i not in self.uploaded]
        if missing:
            raise ProtocolError(f"example_ids {missing[:5]} were never uploaded", status=404, limit="example_ids")
        rows = [self.uploaded[i] for i in example_ids.tolist()]
        length = max(values.shape[0] for values, _ in rows)
        values = torch.zeros(len(rows), length, self.top.hidden_size)
        mask = torch.zeros(len(rows), length, dtype=torch.int64)
        for i, (row, row_mask) in enumerate(rows):
            values[i, :row.shape[0]], mask[i, :row.shape[0]] = row, row_mask
        return values, mask

    def _inputs(self, message: Forward) -> tuple[torch.Tensor, torch.Tensor]:
        self._check_fingerprint(message.bottom_fingerprint)
        if message.batch is None:
            ids = check_tensor("example_ids", message.example_ids, shape=(None,), dtype=torch.int64)
            if ids.numel() == 0:
                raise ProtocolError("example_ids must not be empty")
            return self._stored_batch(ids)
        batch = message.batch.check(hidden_size=self.top.hidden_size, max_abs=self.max_abs_value)
        if not torch.equal(check_tensor("example_ids", message.example_ids, shape=(None,), dtype=torch.int64),
                           batch.example_ids):
            raise ProtocolError("example_ids must be the batch's example ids", limit="example_ids")
        return batch.values, batch.attention_mask

    def forward(self, message: Forward) -> TopOutput:
        step = check_step(message.step)
        if not isinstance(message.train, bool):
            raise ProtocolError("train must be a boolean", limit="train")
        if message.train and step != self.steps_done:
            raise ProtocolError(f"training step {step} is out of order: the next step is {self.steps_done}",
                                status=409, limit="step")
        values, mask = self._inputs(message)
        values, mask = values.to(self.device), mask.to(self.device)
        if not message.train:
            with torch.no_grad():
                output = _finite(self.model(values, mask))
            return TopOutput(step=step, output=self.output_kind, values=output.detach().cpu())  # type: ignore[arg-type]
        self._pending = self._training_forward(step, values, mask)
        return TopOutput(step=step, output=self.output_kind,  # type: ignore[arg-type]
                         values=self._pending.output.detach().cpu())

    def _training_forward(self, step: int, values: torch.Tensor, mask: torch.Tensor) -> _Pending:
        """The top on ``values``, its graph kept for the step (LoRA's dropout seeded by the step: run again, it
        gives the same output)."""
        cut = values.clone().requires_grad_(self.send_cut_gradient)
        if self.lora.dropout > 0:
            with lora_dropout(self.model, seed=dropout_seed(self.seed, step), device=self.device):
                output = self.model(cut, mask)
        else:
            output = self.model(cut, mask)
        _finite(output)
        return _Pending(step=step, output=output, cut=cut if self.send_cut_gradient else None, inputs=(values, mask))

    def backward(self, message: OutputGradient) -> CutGradient | StepDone:
        step = check_step(message.step)
        pending = self._pending
        replayed = self._replay(message)
        if replayed is not None:
            return replayed
        if pending is None or step != pending.step:
            raise ProtocolError(f"no forward pass is waiting for step {step}", status=409, limit="step")
        gradient = check_tensor("gradient", message.gradient, shape=tuple(pending.output.shape), dtype=torch.float32,
                                max_abs=self.max_abs_value)
        self._take_step(pending, gradient)
        self._pending = None
        self.steps_done += 1
        reply: CutGradient | StepDone = StepDone(step=pending.step)
        if pending.cut is not None and pending.cut.grad is not None:
            reply = CutGradient(step=pending.step, gradient=pending.cut.grad.detach().cpu())
        self._last = _LastStep(step=pending.step, gradient_digest=_digest(gradient), reply=reply)
        return reply

    def _take_step(self, pending: _Pending, gradient: torch.Tensor) -> None:
        """Backpropagate and take one AdamW step. A step that leaves anything non-finite is undone and refused; its
        forward pass is run again (the first one's graph is spent), so the step stays in flight, as it was."""
        before = self._snapshot()
        self.optimizer.zero_grad(set_to_none=True)
        pending.output.backward(gradient.to(pending.output))
        self.optimizer.step()
        if not self._all_finite(pending.cut):
            self._restore(before)
            self._pending = self._training_forward(pending.step, *pending.inputs)
            raise ProtocolError(f"this gradient makes step {pending.step} leave the adapter, its optimiser's moments "
                                "or the cut gradient non-finite: the step is undone and still waits for a gradient",
                                limit="gradient", code="step_not_finite")

    def _trainable(self) -> list[torch.Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def _snapshot(self) -> _Snapshot:
        state = {p: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in moments.items()}
                 for p, moments in self.optimizer.state.items()}
        return _Snapshot(parameters=[p.detach().clone() for p in self._trainable()], optimizer_state=state)

    def _restore(self, snapshot: _Snapshot) -> None:
        with torch.no_grad():
            for parameter, saved in zip(self._trainable(), snapshot.parameters, strict=True):
                parameter.copy_(saved)
        self.optimizer.state.clear()
        self.optimizer.state.update(snapshot.optimizer_state)
        self.optimizer.zero_grad(set_to_none=True)

    def _all_finite(self, cut: torch.Tensor | None) -> bool:
        tensors = [*self._trainable(), *(v for moments in self.optimizer.state.values() for v in moments.values()
                                         if isinstance(v, torch.Tensor))]
        if cut is not None and cut.grad is not None:
            tensors.append(cut.grad)
        return all(bool(torch.isfinite(t).all()) for t in tensors)

    def _replay(self, message: OutputGradient) -> CutGradient | StepDone | None:
        """The answer already given, when the last step's gradient arrives again (its answer was lost): the
        step is not applied twice. The same step with a different gradient is refused."""
        last = self._last
        if last is None or message.step != last.step or self._pending is not None:
            return None
        if not isinstance(message.gradient, torch.Tensor) or _digest(message.gradient) != last.gradient_digest:
            raise ProtocolError(f"step {last.step} was already taken with another gradient", status=409,
                                limit="step")
        return last.reply

    def training_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """What a checkpoint holds, as safetensors-ready tensors and JSON facts: the adapter, the optimiser's
        moments and settings, the steps taken and the last step's answer (so a lost answer can be replayed after
        a restart). A step in flight is not saved: the customer sends it again. Uploads are stored apart."""
        tensors = {f"adapter.{name}": value for name, value in self.adapter_state().items()}
        optimizer = self.optimizer.state_dict()
        for index, moments in optimizer["state"].items():
            for key, value in moments.items():
                tensors[f"optimizer.{index}.{key}"] = torch.as_tensor(value).detach().cpu().clone()
        facts: dict[str, Any] = {"steps_done": self.steps_done, "param_groups": optimizer["param_groups"],
                                 "last": None}
        if self._last is not None:
            facts["last"] = {"step": self._last.step, "gradient_digest": self._last.gradient_digest,
                             "kind": self._last.reply.kind}
            if isinstance(self._last.reply, CutGradient):
                tensors["last.gradient"] = self._last.reply.gradient.detach().cpu().clone()
        return tensors, facts

    def load_training_state(self, tensors: dict[str, torch.Tensor], facts: dict[str, Any]) -> None:
        """Resume from :meth:`training_state`'s output (checked: a state from another top or settings is refused
        and leaves this vendor as it was)."""
        adapter = {name.removeprefix("adapter."): v for name, v in tensors.items() if name.startswith("adapter.")}
        if adapter.keys() != self.adapter_state().keys():
            raise ValueError("the checkpoint's adapter does not match this vendor's LoRA settings and head")
        moments: dict[int, dict[str, torch.Tensor]] = {}
        for name, value in tensors.items():
            if name.startswith("optimizer."):
                _, position, key = name.split(".", 2)
                moments.setdefault(int(position), {})[key] = value
        steps_done, last = facts.get("steps_done"), facts.get("last")
        if isinstance(steps_done, bool) or not isinstance(steps_done, int) or steps_done < 0:
            raise ValueError(f"the checkpoint's steps_done must be a non-negative integer, got {steps_done!r}")
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        for slot, values in moments.items():
            if not 0 <= slot < len(params) or any(
                    key != "step" and tuple(v.shape) != tuple(params[slot].shape) for key, v in values.items()):
                raise ValueError(f"the checkpoint's optimiser state {slot} does not match this vendor's parameters")
        last_step = None
        if last is not None:
            reply: CutGradient | StepDone = CutGradient(step=last["step"], gradient=tensors["last.gradient"]) \
                if last["kind"] == CutGradient.kind else StepDone(step=last["step"])
            last_step = _LastStep(step=reply.step, gradient_digest=last["gradient_digest"], reply=reply)
        self.load_adapter_state(adapter)
        self.optimizer.load_state_dict({"state": moments, "param_groups": facts["param_groups"]})
        self.steps_done, self._pending, self._last = steps_done, None, last_step

    def adapter_state(self) -> dict[str, torch.Tensor]:
        """What training changed: the LoRA matrices and, with the head here, the head (peft's adapter state)."""
        return {name: tensor.detach().cpu().clone() for name, tensor in get_peft_model_state_dict(self.model).items()}

    def save_adapter(self, directory: str | Path) -> Path:
        """The adapter as peft writes it (adapter_model.safetensors + adapter_config.json)."""
        directory = Path(directory)
        self.model.save_pretrained(str(directory))
        return directory

    def load_adapter_state(self, state: dict[str, torch.Tensor]) -> None:
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(self.model, state)
