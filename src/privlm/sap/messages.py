"""The typed messages of the SAP protocol (Algorithm 1), and their bytes: safetensors with a JSON header.

Customer -> vendor: :class:`Upload` (a frozen bottom's privatized training set, once), :class:`Forward` (run the
top on a batch: stored rows, or a fresh privatized batch), :class:`OutputGradient` (dL/dlogits, or dL/dh when the
head sits at the customer). Vendor -> customer: :class:`TopOutput` (logits or representation),
:class:`CutGradient` (trainable bottom) or :class:`StepDone`, and :class:`Uploaded`.

Every tensor is checked (dtype, rank, shape, finiteness) by :func:`check_tensor` before a party touches its state;
a bad message raises :class:`ProtocolError` and leaves the receiver as it was. ``to_bytes``/``from_bytes`` never
unpickle: tensors travel as safetensors, scalars in its string metadata.
"""

from __future__ import annotations

import json
from dataclasses import MISSING, dataclass, fields
from typing import Any, ClassVar, Literal

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from privlm.settings.sap import MAX_ABS_VALUE
from privlm.wire import WireError, read_safetensors_metadata

OutputKind = Literal["logits", "representation"]


class ProtocolError(WireError):
    """A malformed or out-of-order message; the receiving party's state is unchanged."""


def check_tensor(name: str, value: object, *, shape: tuple[int | None, ...],
                 dtype: torch.dtype | tuple[torch.dtype, ...], finite: bool = True,
                 max_abs: float | None = None) -> torch.Tensor:
    """``value`` as a tensor of rank len(shape) whose sides match ``shape`` (None: any), of ``dtype``, finite, and
    with no entry larger than ``max_abs`` in magnitude (when given)."""
    if not isinstance(value, torch.Tensor):
        raise ProtocolError(f"{name} must be a tensor, got {type(value).__name__}", limit=name)
    dtypes = dtype if isinstance(dtype, tuple) else (dtype,)
    if value.dtype not in dtypes:
        raise ProtocolError(f"{name} must have dtype {' or '.join(str(d) for d in dtypes)}, got {value.dtype}",
                            limit=name)
    if value.ndim != len(shape) or any(want not in (None, got) for got, want in zip(value.shape, shape, strict=True)):
        expected = "(" + ", ".join("*" if s is None else str(s) for s in shape) + ")"
        raise ProtocolError(f"{name} has shape {tuple(value.shape)}, expected {expected}", limit=name)
    if finite and value.is_floating_point() and not bool(torch.isfinite(value).all()):
        raise ProtocolError(f"{name} contains NaN or inf", limit=name)
    if max_abs is not None and value.is_floating_point():
        _check_magnitude(name, value, max_abs)
    return value


def _check_magnitude(name: str, value: torch.Tensor, max_abs: float) -> None:
    largest = float(value.abs().max()) if value.numel() else 0.0
    if largest > max_abs:
        raise ProtocolError(f"{name} holds an entry of magnitude {largest:.3g}, beyond the vendor's bound "
                            f"max_abs_value={max_abs:g} (a vendor raises it with SessionLimits.max_abs_value, "
                            "`privlm sap vendor --max-abs-value` or Vendor(max_abs_value=))",
                            limit=name, code="value_out_of_range")


def check_step(step: object) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ProtocolError(f"step must be a non-negative integer, got {step!r}")
    return step


@dataclass(frozen=True)
class PrivatizedBatch:
    """Released representations (B, L, d) float32, their attention mask (B, L) int64, the customer's example ids."""

    example_ids: torch.Tensor
    values: torch.Tensor
    attention_mask: torch.Tensor

    def check(self, *, hidden_size: int, max_abs: float = MAX_ABS_VALUE) -> PrivatizedBatch:
        values = check_tensor("values", self.values, shape=(None, None, hidden_size), dtype=torch.float32,
                              max_abs=max_abs)
        batch, length = values.shape[:2]
        if batch < 1 or length < 1:
            raise ProtocolError(f"values must hold at least one sequence of one token, got shape {tuple(values.shape)}")
        mask = check_tensor("attention_mask", self.attention_mask, shape=(batch, length), dtype=torch.int64)
        if bool(((mask != 0) & (mask != 1)).any()):
            raise ProtocolError("attention_mask must hold only 0 and 1", limit="attention_mask")
        if bool((mask.sum(dim=1) == 0).any()):
            raise ProtocolError("attention_mask leaves a sequence with no token", limit="attention_mask")
        if not torch.equal(mask, (torch.arange(length) < mask.sum(dim=1, keepdim=True)).long()):
            raise ProtocolError("attention_mask must be right-padded: ones, then zeros", limit="attention_mask")
        ids = check_tensor("example_ids", self.example_ids, shape=(batch,), dtype=torch.int64)
        if bool((ids < 0).any()) or ids.unique().numel() != batch:
            raise ProtocolError("example_ids must be distinct non-negative integers", limit="example_ids")
        return self


@dataclass(frozen=True)
class Upload:
    """A frozen bottom's whole privatized training set (or a part of it), sent once before training."""

    kind: ClassVar[str] = "upload"
    batch: PrivatizedBatch
    bottom_fingerprint: str


@dataclass(frozen=True)
class Uploaded:
    kind: ClassVar[str] = "uploaded"
    stored: int


@dataclass(frozen=True)
class Forward:
    """Run the top: on uploaded rows (``batch`` None) or on a fresh privatized batch; ``train`` keeps the graph."""

    kind: ClassVar[str] = "forward"
    step: int
    example_ids: torch.Tensor
    train: bool
    bottom_fingerprint: str
    batch: PrivatizedBatch | None = None


@dataclass(frozen=True)
class _OfStep:
    """A message about one training step (or, for a prediction, the step the vendor is at)."""

    step: int


@dataclass(frozen=True)
class TopOutput(_OfStep):
    kind: ClassVar[str] = "top-output"
    output: OutputKind
    values: torch.Tensor


@dataclass(frozen=True)
class _Gradient(_OfStep):
    gradient: torch.Tensor


@dataclass(frozen=True)
class OutputGradient(_Gradient):
    """dL/d(top output), averaged over the batch as the loss is."""

    kind: ClassVar[str] = "output-gradient"


@dataclass(frozen=True)
class CutGradient(_Gradient):
    kind: ClassVar[str] = "cut-gradient"


@dataclass(frozen=True)
class StepDone(_OfStep):
    kind: ClassVar[str] = "step-done"


CustomerMessage = Upload | Forward | OutputGradient
VendorMessage = Uploaded | TopOutput | CutGradient | StepDone
MESSAGE_TYPES: dict[str, type[Any]] = {cls.kind: cls for cls in (Upload, Uploaded, Forward, TopOutput, OutputGradient,
                                                                   CutGradient, StepDone)}
_BATCH_FIELDS = ("example_ids", "values", "attention_mask")


def to_bytes(message: CustomerMessage | VendorMessage) -> bytes:
    """safetensors bytes: every tensor field by name, every other field in the JSON metadata ``fields``."""
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, Any] = {}
    for item in fields(message):
        value = getattr(message, item.name)
        if isinstance(value, PrivatizedBatch):
            tensors.update({f"batch.{name}": getattr(value, name).detach().cpu().clone() for name in _BATCH_FIELDS})
        elif isinstance(value, torch.Tensor):
            tensors[item.name] = value.detach().cpu().clone()
        else:
            scalars[item.name] = value
    return save_safetensors(tensors, metadata={"kind": message.kind, "fields": json.dumps(scalars)})


def from_bytes(data: bytes, *, max_bytes: int = 1 << 30) -> CustomerMessage | VendorMessage:
    """Parse :func:`to_bytes` output; anything else is a :class:`ProtocolError` (the receiver checks the tensors)."""
    if len(data) > max_bytes:
        raise ProtocolError(f"message of {len(data)} bytes exceeds the limit of {max_bytes}", status=413,
                            limit="max_bytes")
    try:
        tensors = load_safetensors(data)
        metadata = read_safetensors_metadata(data)
        scalars = json.loads(metadata["fields"])
        cls = MESSAGE_TYPES[metadata["kind"]]
    except (SafetensorError, KeyError, ValueError, TypeError) as error:
        raise ProtocolError(f"not a SAP message: {error}") from error
    if not isinstance(scalars, dict):
        raise ProtocolError("a SAP message's fields must be a JSON object")
    return cls(**_field_values(cls, tensors, scalars))


def _field_values(cls: type[Any], tensors: dict[str, torch.Tensor], scalars: dict[str, Any]) -> dict[str, Any]:
    """The constructor's arguments: each tensor field from a tensor, each other field from JSON, every required one
    present, nothing else; a field given in the wrong form is refused (a tensor for ``step``, say)."""
    kinds = {item.name: "batch" if item.name == "batch" else "tensor" if "Tensor" in str(item.type) else "json"
             for item in fields(cls)}
    required = {item.name for item in fields(cls) if item.default is MISSING}
    values: dict[str, Any] = {}
    for name, value in scalars.items():
        if kinds.get(name) == "batch" and value is None:
            continue  # no batch: the default
        if kinds.get(name) != "json" or isinstance(value, dict | list):
            raise ProtocolError(f"a {cls.kind} message has no JSON field {name!r}", limit=name)
        values[name] = value
    batch_parts = {k.split(".", 1)[1]: v for k, v in tensors.items() if k.startswith("batch.")}
    for name, value in tensors.items():
        if name.startswith("batch."):
            continue
        if kinds.get(name) != "tensor":
            raise ProtocolError(f"a {cls.kind} message has no tensor field {name!r}", limit=name)
        values[name] = value
    if batch_parts:
        if "batch" not in kinds or set(batch_parts) != set(_BATCH_FIELDS):
            raise ProtocolError(f"a batch holds exactly {list(_BATCH_FIELDS)}; got {sorted(batch_parts)}",
                                limit="batch")
        values["batch"] = PrivatizedBatch(**batch_parts)
    missing = required - set(values)
    if missing:
        raise ProtocolError(f"a {cls.kind} message needs {sorted(missing)}", limit=sorted(missing)[0])
    return values
