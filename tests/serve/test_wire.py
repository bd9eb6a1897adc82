import numpy as np
import pytest
import torch
from safetensors.torch import save

from privlm.serve.wire import (
    RAW,
    SAFETENSORS,
    Limits,
    WireError,
    decode_embeddings,
    decode_raw_request,
    decode_safetensors_request,
    encode_embeddings,
    encode_request,
)

LIMITS = Limits(dim=8, max_batch=4, max_tokens=6, max_request_bytes=10_000)


def _batch():
    embeddings = torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(0))
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]])
    return embeddings, mask


def _decode(body, headers):
    if headers["content-type"] == SAFETENSORS:
        return decode_safetensors_request(body, LIMITS)
    return decode_raw_request(body, dtype=headers["x-privlm-dtype"], shape=headers["x-privlm-shape"],
                              lengths=headers["x-privlm-lengths"], limits=LIMITS)


@pytest.mark.parametrize("fmt", [SAFETENSORS, RAW])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_round_trip_zeroes_padding_and_keeps_values(fmt, dtype):
    embeddings, mask = _batch()
    request = _decode(*encode_request(embeddings, mask, dtype=dtype, fmt=fmt))
    assert request.dtype == dtype and torch.equal(request.attention_mask, mask)
    expected = (embeddings * mask.unsqueeze(-1)).to(getattr(torch, dtype))
    assert torch.equal(request.embeddings, expected)
    body, headers = encode_embeddings(torch.randn(3, 8), dtype=dtype, fmt=fmt)
    assert decode_embeddings(body, headers).shape == (3, 8)


def test_limits_are_named():
    cases = [
        (torch.randn(5, 5, 8), torch.ones(5, 5, dtype=torch.long), "max_batch"),
        (torch.randn(2, 7, 8), torch.ones(2, 7, dtype=torch.long), "max_tokens"),
        (torch.randn(2, 5, 9), torch.ones(2, 5, dtype=torch.long), "dim"),
    ]
    for values, m, limit in cases:
        with pytest.raises(WireError) as error:
            decode_safetensors_request(save({"embeddings": values, "attention_mask": m.to(torch.uint8)}), LIMITS)
        assert error.value.limit == limit and limit in str(error.value)
    with pytest.raises(WireError, match="max_request_bytes"):
        decode_safetensors_request(b"x" * 10_001, LIMITS)


@pytest.mark.parametrize(("embeddings", "mask", "match"), [
    (torch.full((1, 2, 8), float("nan")), torch.ones(1, 2, dtype=torch.uint8), "NaN or inf"),
    (torch.ones(1, 2, 8, dtype=torch.float64), torch.ones(1, 2, dtype=torch.uint8), "float32 or float16"),
    (torch.ones(1, 2, 8), torch.tensor([[0, 1]], dtype=torch.uint8), "right-padded"),
    (torch.ones(1, 2, 8), torch.tensor([[2, 1]], dtype=torch.uint8), "only 0 and 1"),
    (torch.ones(1, 2, 8), torch.zeros(1, 2, dtype=torch.uint8), "at least one"),
    (torch.ones(2, 8), torch.ones(2, dtype=torch.uint8), r"must be \(B, n, d\)"),
])
def test_malformed_tensors_are_refused(embeddings, mask, match):
    with pytest.raises(WireError, match=match):
        decode_safetensors_request(save({"embeddings": embeddings, "attention_mask": mask}), LIMITS)


def test_garbage_and_wrong_names_are_refused():
    with pytest.raises(WireError, match="not valid safetensors"):
        decode_safetensors_request(b"\x00" * 64, LIMITS)
    with pytest.raises(WireError, match="expected tensors"):
        decode_safetensors_request(save({"input_ids": torch.ones(1, 2)}), LIMITS)


def test_raw_headers_are_checked():
    body = np.zeros((1, 2, 8), dtype="<f4").tobytes()
    for dtype, shape, lengths, match in [("int64", "1,2,8", "2", "Dtype"), ("float32", "1,2", "2", "B,n,d"),
                                         ("float32", "1,2,8", "2,2", "entries"), ("float32", "1,3,8", "2", "bytes"),
                                         ("float32", "1,2,8", "3", "lengths"), ("float32", "a,b,c", "2", "integers")]:
        with pytest.raises(WireError, match=match):
            decode_raw_request(body, dtype=dtype, shape=shape, lengths=lengths, limits=LIMITS)
