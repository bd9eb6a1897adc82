"""The vendor: keeps the top model, trains LoRA on it from privatized representations (SAP, Algorithm 1).

One training step is two messages. ``Forward(step, train=True)`` runs the top and keeps the graph;
``OutputGradient(step)`` backpropagates the customer's dL/d(output) into LoRA (and the head when it sits here),
takes one AdamW step, and answers ``CutGradient`` (dL/d(cut), a trainable bottom) or ``StepDone``. A step number
must be the next one; a repeated ``Forward`` for the step in flight replaces it (a retry). Every message is
checked in full before anything changes, so a bad one leaves the vendor as it was.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
from peft import get_peft_model_state_dict
from safetensors.torch import save_file

from privlm.models.partition import TopModel
from privlm.sap.config import LoraSettings
from privlm.sap.messages import (
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


@dataclass
class _Pending:
    step: int
    output: torch.Tensor
    cut: torch.Tensor | None  # a leaf with requires_grad when the customer wants the cut gradient


class Vendor:
    """The vendor's party. ``top`` carries the head when it sits at the vendor."""

    def __init__(self, top: TopModel, *, lora: LoraSettings | None = None, learning_rate: float = 1e-3,
                 send_cut_gradient: bool = False, seed: int = 0) -> None:
        if hasattr(top, "peft_config"):
            raise ValueError("this top already carries LoRA adapters (a top serves one vendor); split the model again")
        self.top = top
        self.lora = lora or LoraSettings()
        self.model = add_lora(top, self.lora, seed=seed)
        self.model.eval()  # the frozen layers' own dropout stays off; LoRA's is switched on per training step
        self.seed = seed
        self.send_cut_gradient = send_cut_gradient
        self.optimizer = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=learning_rate)
        self.device = next(top.parameters()).device
        self.uploaded: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # example id -> (values, mask), unpadded
        self.steps_done = 0
        self.seconds = 0.0
        self._pending: _Pending | None = None

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
        batch = message.batch.check(hidden_size=self.top.hidden_size)
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
        if not isinstance(message.train, bool):
            raise ProtocolError("train must be a boolean")
        if message.batch is None:
            ids = check_tensor("example_ids", message.example_ids, shape=(None,), dtype=torch.int64)
            if ids.numel() == 0:
                raise ProtocolError("example_ids must not be empty")
            return self._stored_batch(ids)
        batch = message.batch.check(hidden_size=self.top.hidden_size)
        if not torch.equal(check_tensor("example_ids", message.example_ids, shape=(None,), dtype=torch.int64),
                           batch.example_ids):
            raise ProtocolError("example_ids must be the batch's example ids", limit="example_ids")
        return batch.values, batch.attention_mask

    def forward(self, message: Forward) -> TopOutput:
        step = check_step(message.step)
        if message.train and step != self.steps_done:
            raise ProtocolError(f"training step {step} is out of order: the next step is {self.steps_done}",
                                status=409, limit="step")
        values, mask = self._inputs(message)
        values, mask = values.to(self.device), mask.to(self.device)
        if not message.train:
            with torch.no_grad():
                output = self.model(values, mask)
            return TopOutput(step=step, output=self.output_kind, values=output.detach().cpu())  # type: ignore[arg-type]
        cut = values.clone().requires_grad_(self.send_cut_gradient)
        if self.lora.dropout > 0:
            with lora_dropout(self.model, seed=dropout_seed(self.seed, step), device=self.device):
                output = self.model(cut, mask)
        else:
            output = self.model(cut, mask)
        self._pending = _Pending(step=step, output=output, cut=cut if self.send_cut_gradient else None)
        return TopOutput(step=step, output=self.output_kind, values=output.detach().cpu())  # type: ignore[arg-type]

    def backward(self, message: OutputGradient) -> CutGradient | StepDone:
        pending = self._pending
        if pending is None or message.step != pending.step:
            raise ProtocolError(f"no forward pass is waiting for step {message.step!r}", status=409, limit="step")
        gradient = check_tensor("gradient", message.gradient, shape=tuple(pending.output.shape), dtype=torch.float32)
        self.optimizer.zero_grad(set_to_none=True)
        pending.output.backward(gradient.to(pending.output))
        self.optimizer.step()
        self._pending = None
        self.steps_done += 1
        if pending.cut is not None and pending.cut.grad is not None:
            return CutGradient(step=pending.step, gradient=pending.cut.grad.detach().cpu())
        return StepDone(step=pending.step)

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

    def save_adapter_state(self, path: str | Path) -> Path:
        path = Path(path)
        save_file(self.adapter_state(), str(path))
        return path
