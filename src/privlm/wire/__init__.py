"""Tensor payloads on the wire and their limits: safetensors or checked raw arrays, never pickle."""

from privlm.wire.tensors import (
    MODEL_FINGERPRINT_HEADER,
    RAW,
    SAFETENSORS,
    WIRE_DTYPES,
    Limits,
    SequenceBatch,
    WireDType,
    WireError,
    WireFormat,
    read_rows,
    read_sequences,
    write_rows,
    write_sequences,
)

__all__ = [
    "MODEL_FINGERPRINT_HEADER",
    "RAW",
    "SAFETENSORS",
    "WIRE_DTYPES",
    "Limits",
    "SequenceBatch",
    "WireDType",
    "WireError",
    "WireFormat",
    "read_rows",
    "read_sequences",
    "write_rows",
    "write_sequences",
]
