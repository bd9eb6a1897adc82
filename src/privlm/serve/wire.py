"""Tensors on the wire: safetensors bytes, or raw little-endian arrays with a declared dtype and shape.

Nothing is ever unpickled. Every decoded tensor is checked for dtype, rank, shape limits and
finiteness before it reaches a model; a violation is a ``WireError`` naming the limit, which the
services turn into a 4xx JSON answer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

SAFETENSORS = "application/x-safetensors"
RAW = "application/octet-stream"
FLOAT_DTYPES = {"float32": torch.float32, "float16": torch.float16}
NUMPY_DTYPES = {"float32": np.dtype("<f4"), "float16": np.dtype("<f2")}


class WireError(ValueError):
    """A malformed or over-limit payload. ``status`` is the HTTP status to answer with."""

    def __init__(self, message: str, *, status: int = 422, limit: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.limit = limit


@dataclass(frozen=True, kw_only=True)
class Limits:
    """Per-request bounds. ``dim`` is the model's hidden size: anything else is refused."""

    dim: int
    max_request_bytes: int = 16 * 2**20
    max_batch: int = 64
    max_tokens: int = 512


@dataclass
class EncodeRequest:
    embeddings: torch.Tensor  # (B, n, d) float, padding rows zero
    attention_mask: torch.Tensor  # (B, n) int64 of 0/1, right padding
    dtype: str  # the dtype the client sent; the answer uses it too


def _check_shape(batch: int, tokens: int, dim: int, limits: Limits) -> None:
    if batch < 1 or tokens < 1:
        raise WireError(f"empty batch: shape ({batch}, {tokens}, {dim})", limit="shape")
    if batch > limits.max_batch:
        raise WireError(f"batch of {batch} exceeds max_batch={limits.max_batch}", status=413, limit="max_batch")
    if tokens > limits.max_tokens:
        raise WireError(f"sequence of {tokens} tokens exceeds max_tokens={limits.max_tokens}", status=413,
                        limit="max_tokens")
    if dim != limits.dim:
        raise WireError(f"embedding dimension {dim} does not match the model's {limits.dim}", limit="dim")


def _mask_from_lengths(lengths: list[int], tokens: int) -> torch.Tensor:
    if any(n < 1 or n > tokens for n in lengths):
        raise WireError(f"lengths must lie in [1, {tokens}], got {lengths}", limit="lengths")
    return (torch.arange(tokens).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)).long()


def _check_values(embeddings: torch.Tensor, mask: torch.Tensor) -> None:
    if not torch.isfinite(embeddings).all():
        raise WireError("embeddings contain NaN or inf", limit="finite")
    if not ((mask == 0) | (mask == 1)).all():
        raise WireError("attention_mask must hold only 0 and 1", limit="attention_mask")
    lengths = mask.sum(dim=1)
    if (lengths < 1).any():
        raise WireError("every row needs at least one unmasked token", limit="attention_mask")
    right_padded = mask == (torch.arange(mask.shape[1]).unsqueeze(0) < lengths.unsqueeze(1)).long()
    if not right_padded.all():
        raise WireError("attention_mask must be right-padded (ones, then zeros)", limit="attention_mask")


def decode_safetensors_request(body: bytes, limits: Limits) -> EncodeRequest:
    """Body: safetensors with ``embeddings`` (B, n, d) float32/float16 and ``attention_mask`` (B, n) u8/bool/i64."""
    if len(body) > limits.max_request_bytes:
        raise WireError(f"request of {len(body)} bytes exceeds max_request_bytes={limits.max_request_bytes}",
                        status=413, limit="max_request_bytes")
    try:
        tensors = load_safetensors(body)
    except (SafetensorError, ValueError, RuntimeError) as error:
        raise WireError(f"body is not valid safetensors: {error}", limit="format") from error
    if set(tensors) != {"embeddings", "attention_mask"}:
        raise WireError(f"expected tensors 'embeddings' and 'attention_mask', got {sorted(tensors)}", limit="format")
    embeddings, mask = tensors["embeddings"], tensors["attention_mask"]
    dtype = next((name for name, t in FLOAT_DTYPES.items() if embeddings.dtype == t), None)
    if dtype is None:
        raise WireError(f"embeddings must be float32 or float16, got {embeddings.dtype}", limit="dtype")
    if embeddings.ndim != 3 or mask.ndim != 2 or tuple(mask.shape) != tuple(embeddings.shape[:2]):
        raise WireError(f"embeddings must be (B, n, d) and attention_mask (B, n); got {tuple(embeddings.shape)} "
                        f"and {tuple(mask.shape)}", limit="shape")
    if mask.dtype not in (torch.uint8, torch.bool, torch.int64, torch.int32):
        raise WireError(f"attention_mask must be an integer or bool tensor, got {mask.dtype}", limit="dtype")
    _check_shape(*embeddings.shape, limits=limits)
    mask = mask.long()
    _check_values(embeddings, mask)
    return EncodeRequest(embeddings=embeddings, attention_mask=mask, dtype=dtype)


def decode_raw_request(body: bytes, *, dtype: str | None, shape: str | None, lengths: str | None,
                       limits: Limits) -> EncodeRequest:
    """Body: raw little-endian (B, n, d) array; headers give dtype, shape "B,n,d" and lengths "l1,...,lB"."""
    if len(body) > limits.max_request_bytes:
        raise WireError(f"request of {len(body)} bytes exceeds max_request_bytes={limits.max_request_bytes}",
                        status=413, limit="max_request_bytes")
    if dtype not in FLOAT_DTYPES:
        raise WireError(f"X-Privlm-Dtype must be one of {sorted(FLOAT_DTYPES)}, got {dtype!r}", limit="dtype")
    try:
        dims = [int(x) for x in (shape or "").split(",")]
        row_lengths = [int(x) for x in (lengths or "").split(",")]
    except ValueError as error:
        raise WireError("X-Privlm-Shape and X-Privlm-Lengths must be comma-separated integers",
                        limit="shape") from error
    if len(dims) != 3:
        raise WireError(f"X-Privlm-Shape must be 'B,n,d', got {shape!r}", limit="shape")
    _check_shape(*dims, limits=limits)
    if len(row_lengths) != dims[0]:
        raise WireError(f"X-Privlm-Lengths has {len(row_lengths)} entries for a batch of {dims[0]}", limit="lengths")
    expected = dims[0] * dims[1] * dims[2] * NUMPY_DTYPES[dtype].itemsize
    if len(body) != expected:
        raise WireError(f"body has {len(body)} bytes; shape {dims} of {dtype} needs {expected}", limit="shape")
    array = np.frombuffer(body, dtype=NUMPY_DTYPES[dtype]).reshape(dims)
    embeddings = torch.from_numpy(array.astype(array.dtype.newbyteorder("="), copy=True))
    mask = _mask_from_lengths(row_lengths, dims[1])
    _check_values(embeddings, mask)
    return EncodeRequest(embeddings=embeddings, attention_mask=mask, dtype=dtype)


def encode_embeddings(pooled: torch.Tensor, *, dtype: str, fmt: str) -> tuple[bytes, dict[str, str]]:
    """The answer: (B, d) in the client's dtype, as safetensors or raw little-endian bytes."""
    tensor = pooled.detach().to("cpu", FLOAT_DTYPES[dtype]).contiguous()
    if fmt == SAFETENSORS:
        return save_safetensors({"embeddings": tensor}), {"content-type": SAFETENSORS}
    array = tensor.numpy().astype(NUMPY_DTYPES[dtype], copy=False)
    return array.tobytes(), {"content-type": RAW, "x-privlm-dtype": dtype,
                             "x-privlm-shape": ",".join(str(s) for s in array.shape)}


def encode_request(embeddings: torch.Tensor, attention_mask: torch.Tensor, *, dtype: str = "float32",
                   fmt: str = SAFETENSORS) -> tuple[bytes, dict[str, str]]:
    """Client side: zero the padding rows (they carry nothing) and serialise."""
    keep = attention_mask.unsqueeze(-1).to(embeddings.dtype)
    values = (embeddings * keep).detach().to("cpu", FLOAT_DTYPES[dtype]).contiguous()
    if fmt == SAFETENSORS:
        body = save_safetensors({"embeddings": values, "attention_mask": attention_mask.detach().cpu().to(torch.uint8)})
        return body, {"content-type": SAFETENSORS}
    lengths = attention_mask.sum(dim=1).tolist()
    return values.numpy().astype(NUMPY_DTYPES[dtype], copy=False).tobytes(), {
        "content-type": RAW, "x-privlm-dtype": dtype, "x-privlm-shape": ",".join(str(s) for s in values.shape),
        "x-privlm-lengths": ",".join(str(int(n)) for n in lengths)}


def decode_embeddings(body: bytes, headers: dict[str, str]) -> torch.Tensor:
    """Client side: the server's answer back to a float32 (B, d) tensor, checked."""
    content_type = headers.get("content-type", "")
    if content_type.startswith(SAFETENSORS):
        try:
            tensors = load_safetensors(body)
        except (SafetensorError, ValueError, RuntimeError) as error:
            raise WireError(f"answer is not valid safetensors: {error}", status=502) from error
        out = tensors.get("embeddings")
    else:
        dtype = headers.get("x-privlm-dtype")
        if dtype not in NUMPY_DTYPES:
            raise WireError(f"answer has unknown dtype {dtype!r}", status=502)
        dims = [int(x) for x in headers.get("x-privlm-shape", "").split(",")]
        out = torch.from_numpy(np.frombuffer(body, dtype=NUMPY_DTYPES[dtype]).reshape(dims).astype(np.float32))
    if out is None or out.ndim != 2 or not torch.isfinite(out).all():
        raise WireError("answer must be a finite (B, d) 'embeddings' tensor", status=502)
    return out.float()
