"""Tensors on the wire: safetensors bytes, or raw little-endian arrays, both with a declared dtype and shape.

Two payloads: a batch of token sequences (B, n, d) with its attention mask (what a client sends), and
a batch of rows (B, d) (what a server answers). Nothing is ever unpickled. A sequence batch travels with
three headers in both formats: X-Privlm-Dtype, X-Privlm-Shape 'B,n,d' and X-Privlm-Lengths 'l1,...,lB'.
They are checked against the limits before the body is parsed, and a safetensors body must hold exactly
what they declare. Every tensor read is checked for dtype, rank, shape limits and finiteness before it
reaches a model; a violation is a ``WireError`` naming the limit, which the services turn into a 4xx JSON
answer.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

WireDType = Literal["float32", "float16"]
WireFormat = Literal["application/x-safetensors", "application/octet-stream"]
SAFETENSORS: WireFormat = "application/x-safetensors"
RAW: WireFormat = "application/octet-stream"
WIRE_DTYPES: tuple[WireDType, ...] = ("float32", "float16")
# Every answer names the weights it came from, so that a client never mixes two models in one result.
MODEL_FINGERPRINT_HEADER = "x-privlm-model-fingerprint"
FLOAT_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "float16": torch.float16}
NUMPY_DTYPES: dict[str, np.dtype] = {"float32": np.dtype("<f4"), "float16": np.dtype("<f2")}
# The headers that declare a sequence batch (both formats), with the patterns their values must match in
# full; the OpenAPI schema of the encode route uses the same patterns.
DTYPE_HEADER, SHAPE_HEADER, LENGTHS_HEADER = "X-Privlm-Dtype", "X-Privlm-Shape", "X-Privlm-Lengths"
_POSITIVE = "[1-9][0-9]{0,8}"  # a positive integer of at most 9 digits: int() of any length is costly
SEQUENCE_HEADER_PATTERNS: dict[str, str] = {
    DTYPE_HEADER: "^(float32|float16)$",
    SHAPE_HEADER: f"^{_POSITIVE},{_POSITIVE},{_POSITIVE}$",
    LENGTHS_HEADER: f"^{_POSITIVE}(,{_POSITIVE})*$",
}


class WireError(ValueError):
    """A malformed or over-limit payload. ``status`` is the HTTP status to answer with; ``limit`` names
    the limit or field at fault; ``code``, when given, is the error's machine-readable reason (the services
    otherwise answer ``limit_exceeded`` for a 413 and ``invalid_payload`` for the rest)."""

    def __init__(self, message: str, *, status: int = 422, limit: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.limit = limit
        self.code = code


@dataclass(frozen=True, kw_only=True)
class Limits:
    """Per-request bounds. ``dim`` is the model's hidden size: anything else is refused."""

    dim: int
    max_request_bytes: int = 16 * 2**20
    max_batch: int = 64
    max_tokens: int = 512


@dataclass
class SequenceBatch:
    """Token vectors of B right-padded sequences, as read from a request."""

    embeddings: torch.Tensor  # (B, n, d) float, padding rows zero
    attention_mask: torch.Tensor  # (B, n) int64 of 0/1, right padding
    dtype: WireDType  # the dtype the client sent; the answer uses it too
    format: WireFormat  # and its format


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


def _wire_dtype(name: object, field: str) -> WireDType:
    for known in WIRE_DTYPES:
        if name == known:
            return known
    raise WireError(f"{field} must be float32 or float16", limit="dtype")


@dataclass(frozen=True)
class _Declared:
    """What a request's X-Privlm-* headers declare, already checked against the limits."""

    dtype: WireDType
    shape: tuple[int, int, int]
    lengths: list[int]
    mask: torch.Tensor  # (B, n) int64, from the lengths


def _header_value(headers: Mapping[str, str], name: str, what: str, limit: str) -> str:
    value = headers.get(name.lower())
    if value is None:
        raise WireError(f"the {name} header is required with both body formats: {what}", limit=limit)
    if re.fullmatch(SEQUENCE_HEADER_PATTERNS[name].strip("^$"), value) is None:
        raise WireError(f"{name} must be {what}", limit=limit)  # the value is not quoted: it is the caller's
    return value


def _read_declaration(headers: Mapping[str, str], limits: Limits) -> _Declared:
    """The three headers, well formed and within ``limits``, before any byte of the body is parsed."""
    dtype = _wire_dtype(_header_value(headers, DTYPE_HEADER, "float32 or float16", "dtype"), DTYPE_HEADER)
    shape = _header_value(headers, SHAPE_HEADER, "'B,n,d': three comma-separated positive integers", "shape")
    lengths = _header_value(headers, LENGTHS_HEADER, "'l1,...,lB': comma-separated positive integers", "lengths")
    batch, tokens, dim = (int(x) for x in shape.split(","))
    _check_shape(batch, tokens, dim, limits)
    row_lengths = [int(x) for x in lengths.split(",")]
    if len(row_lengths) != batch:
        raise WireError(f"{LENGTHS_HEADER} has {len(row_lengths)} entries for a batch of {batch}", limit="lengths")
    return _Declared(dtype=dtype, shape=(batch, tokens, dim), lengths=row_lengths,
                     mask=_mask_from_lengths(row_lengths, tokens))


def _read_safetensors_sequences(body: bytes, declared: _Declared) -> SequenceBatch:
    """Body: safetensors with ``embeddings`` (B, n, d) float32/float16 and ``attention_mask`` (B, n) u8/bool/i64,
    exactly as the headers declare them."""
    try:
        tensors = load_safetensors(body)
    except (SafetensorError, ValueError, RuntimeError) as error:
        # The parser's message may quote the caller's header: name only its kind.
        raise WireError(f"body is not valid safetensors ({type(error).__name__})", limit="format") from error
    if set(tensors) != {"embeddings", "attention_mask"}:
        raise WireError(f"expected exactly the tensors 'embeddings' and 'attention_mask', got {len(tensors)} "
                        "tensors", limit="format")
    embeddings, mask = tensors["embeddings"], tensors["attention_mask"]
    dtype = _wire_dtype(next((name for name, t in FLOAT_DTYPES.items() if embeddings.dtype == t), embeddings.dtype),
                        "embeddings dtype")
    if embeddings.ndim != 3 or mask.ndim != 2 or tuple(mask.shape) != tuple(embeddings.shape[:2]):
        raise WireError(f"embeddings must be (B, n, d) and attention_mask (B, n); got {tuple(embeddings.shape)} "
                        f"and {tuple(mask.shape)}", limit="shape")
    if mask.dtype not in (torch.uint8, torch.bool, torch.int64, torch.int32):
        raise WireError(f"attention_mask must be an integer or bool tensor, got {mask.dtype}", limit="dtype")
    if dtype != declared.dtype:
        raise WireError(f"embeddings are {dtype} but {DTYPE_HEADER} declares {declared.dtype}", limit="dtype")
    if tuple(embeddings.shape) != declared.shape:  # so the limits checked on the declaration hold for the body
        raise WireError(f"embeddings have shape {tuple(embeddings.shape)} but {SHAPE_HEADER} declares "
                        f"{declared.shape}", limit="shape")
    mask = mask.long()
    _check_values(embeddings, mask)
    if not torch.equal(mask, declared.mask):
        raise WireError(f"attention_mask holds lengths {mask.sum(dim=1).tolist()} but {LENGTHS_HEADER} declares "
                        f"{declared.lengths}", limit="lengths")
    return SequenceBatch(embeddings=embeddings, attention_mask=mask, dtype=dtype, format=SAFETENSORS)


def _read_raw_sequences(body: bytes, declared: _Declared) -> SequenceBatch:
    """Body: raw little-endian (B, n, d) array of the declared dtype and shape; the lengths give the mask."""
    dtype, dims = declared.dtype, declared.shape
    expected = dims[0] * dims[1] * dims[2] * NUMPY_DTYPES[dtype].itemsize
    if len(body) != expected:
        raise WireError(f"body has {len(body)} bytes; shape {list(dims)} of {dtype} needs {expected}", limit="shape")
    array = np.frombuffer(body, dtype=NUMPY_DTYPES[dtype]).reshape(dims)
    embeddings = torch.from_numpy(array.astype(array.dtype.newbyteorder("="), copy=True))
    _check_values(embeddings, declared.mask)
    return SequenceBatch(embeddings=embeddings, attention_mask=declared.mask, dtype=dtype, format=RAW)


def read_sequences(body: bytes, headers: Mapping[str, str], limits: Limits) -> SequenceBatch:
    """A request's sequence batch, as safetensors or raw (by its content type), with the X-Privlm-* headers
    that declare it (both formats), checked against ``limits``: the declaration before the body is parsed."""
    if len(body) > limits.max_request_bytes:
        raise WireError(f"request of {len(body)} bytes exceeds max_request_bytes={limits.max_request_bytes}",
                        status=413, limit="max_request_bytes")
    content_type = headers.get("content-type", "").split(";")[0].strip()
    if content_type not in (SAFETENSORS, RAW):
        raise WireError(f"content-type must be {SAFETENSORS} or {RAW}", status=415,
                        limit="content-type")
    declared = _read_declaration(headers, limits)
    if content_type == SAFETENSORS:
        return _read_safetensors_sequences(body, declared)
    return _read_raw_sequences(body, declared)


def write_sequences(embeddings: torch.Tensor, attention_mask: torch.Tensor, *, dtype: WireDType = "float32",
                    fmt: WireFormat = SAFETENSORS) -> tuple[bytes, dict[str, str]]:
    """Client side: zero the padding rows (they carry nothing) and serialise with the headers to send."""
    keep = attention_mask.unsqueeze(-1).to(embeddings.dtype)
    values = (embeddings * keep).detach().to("cpu", FLOAT_DTYPES[dtype]).contiguous()
    declared = {"x-privlm-dtype": dtype, "x-privlm-shape": ",".join(str(s) for s in values.shape),
                "x-privlm-lengths": ",".join(str(int(n)) for n in attention_mask.sum(dim=1).tolist())}
    if fmt == SAFETENSORS:
        body = save_safetensors({"embeddings": values, "attention_mask": attention_mask.detach().cpu().to(torch.uint8)})
        return body, {"content-type": SAFETENSORS} | declared
    return values.numpy().astype(NUMPY_DTYPES[dtype], copy=False).tobytes(), {"content-type": RAW} | declared


def write_rows(rows: torch.Tensor, *, dtype: WireDType, fmt: WireFormat) -> tuple[bytes, dict[str, str]]:
    """A (B, d) answer in the client's dtype, as safetensors or raw little-endian bytes, with its headers."""
    tensor = rows.detach().to("cpu", FLOAT_DTYPES[dtype]).contiguous()
    if fmt == SAFETENSORS:
        return save_safetensors({"embeddings": tensor}), {"content-type": SAFETENSORS}
    array = tensor.numpy().astype(NUMPY_DTYPES[dtype], copy=False)
    return array.tobytes(), {"content-type": RAW, "x-privlm-dtype": dtype,
                             "x-privlm-shape": ",".join(str(s) for s in array.shape)}


def read_rows(body: bytes, headers: Mapping[str, str], *, rows: int | None = None, dim: int | None = None
              ) -> torch.Tensor:
    """Client side: a server's (B, d) answer as a checked float32 tensor, with ``rows`` rows of width ``dim``
    when given; a malformed one is a 502 WireError."""
    content_type = headers.get("content-type", "")
    if content_type.startswith(SAFETENSORS):
        try:
            out = load_safetensors(body).get("embeddings")
        except (SafetensorError, ValueError, RuntimeError) as error:
            raise WireError(f"answer is not valid safetensors: {error}", status=502) from error
    else:
        dtype = headers.get("x-privlm-dtype", "")
        if dtype not in NUMPY_DTYPES:
            raise WireError(f"answer has unknown dtype {dtype!r}", status=502)
        try:
            dims = [int(x) for x in headers.get("x-privlm-shape", "").split(",")]
            out = torch.from_numpy(np.frombuffer(body, dtype=NUMPY_DTYPES[dtype]).reshape(dims).astype(np.float32))
        except ValueError as error:
            raise WireError(f"answer does not match its declared shape: {error}", status=502) from error
    if out is None or out.ndim != 2 or not torch.isfinite(out).all():
        raise WireError("answer must be a finite (B, d) 'embeddings' tensor", status=502)
    if (rows is not None and out.shape[0] != rows) or (dim is not None and out.shape[1] != dim):
        raise WireError(f"answer has shape {tuple(out.shape)}, expected ({rows}, {dim})", status=502, limit="shape")
    return out.float()


def read_safetensors_metadata(source: bytes | str | Path) -> dict[str, str]:
    """The string metadata (``__metadata__``) of safetensors bytes or of a file, without reading a tensor.

    A file's header is read by the safetensors library (which bounds it); bytes are parsed here, the header's
    declared size checked against the bytes before it is sliced. Anything malformed is a ``ValueError``.
    """
    if not isinstance(source, bytes):
        try:
            with safe_open(str(source), framework="pt") as handle:
                return dict(handle.metadata() or {})
        except SafetensorError as error:
            raise ValueError(f"{source} is not a safetensors file: {error}") from error
    size = int.from_bytes(source[:8], "little")
    if len(source) < 8 or size > len(source) - 8:
        raise ValueError(f"not safetensors: a header of {size} bytes declared in {len(source)} bytes")
    header = json.loads(source[8:8 + size])  # a JSONDecodeError is a ValueError
    metadata = header.get("__metadata__", {}) if isinstance(header, dict) else None
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise ValueError("not safetensors: its __metadata__ is not a table of strings")
    return metadata
