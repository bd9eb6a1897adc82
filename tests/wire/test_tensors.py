import numpy as np
import pytest
import torch
from safetensors.torch import save

from privlm.wire import RAW, SAFETENSORS, Limits, WireError, read_rows, read_sequences, write_rows, write_sequences

LIMITS = Limits(dim=8, max_batch=4, max_tokens=6, max_request_bytes=10_000)


def _batch():
    embeddings = torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(0))
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]])
    return embeddings, mask


def _declaring(embeddings, mask):
    """The X-Privlm-* headers that truthfully declare a (B, n, d) batch and its right-padded mask."""
    return {"x-privlm-dtype": "float16" if embeddings.dtype == torch.float16 else "float32",
            "x-privlm-shape": ",".join(str(s) for s in embeddings.shape),
            "x-privlm-lengths": ",".join(str(int(n)) for n in mask.sum(dim=1))}


def _safetensors(body, declared=None, **headers):
    declared = declared or {"x-privlm-dtype": "float32", "x-privlm-shape": "1,2,8", "x-privlm-lengths": "2"}
    return read_sequences(body, {"content-type": SAFETENSORS, **declared, **headers}, LIMITS)


def _raw(body, dtype, shape, lengths):
    return read_sequences(body, {"content-type": RAW, "x-privlm-dtype": dtype, "x-privlm-shape": shape,
                                 "x-privlm-lengths": lengths}, LIMITS)


@pytest.mark.parametrize("fmt", [SAFETENSORS, RAW])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_round_trip_zeroes_padding_and_keeps_values(fmt, dtype):
    embeddings, mask = _batch()
    body, headers = write_sequences(embeddings, mask, dtype=dtype, fmt=fmt)
    request = read_sequences(body, headers, LIMITS)
    assert request.dtype == dtype and torch.equal(request.attention_mask, mask)
    expected = (embeddings * mask.unsqueeze(-1)).to(getattr(torch, dtype))
    assert torch.equal(request.embeddings, expected)
    body, headers = write_rows(torch.randn(3, 8), dtype=dtype, fmt=fmt)
    assert read_rows(body, headers).shape == (3, 8)


def test_limits_are_named():
    cases = [
        (torch.randn(5, 5, 8), torch.ones(5, 5, dtype=torch.long), "max_batch"),
        (torch.randn(2, 7, 8), torch.ones(2, 7, dtype=torch.long), "max_tokens"),
        (torch.randn(2, 5, 9), torch.ones(2, 5, dtype=torch.long), "dim"),
    ]
    for values, m, limit in cases:
        with pytest.raises(WireError) as error:
            _safetensors(save({"embeddings": values, "attention_mask": m.to(torch.uint8)}), _declaring(values, m))
        assert error.value.limit == limit and limit in str(error.value)
    with pytest.raises(WireError, match="max_request_bytes"):
        _safetensors(b"x" * 10_001)
    with pytest.raises(WireError, match="content-type") as wrong_type:
        read_sequences(b"{}", {"content-type": "application/json"}, LIMITS)
    assert wrong_type.value.status == 415


# Each body comes with well-formed headers declaring (1, 2, 8) float32 of length 2 (or 1, to match the
# mask where it can): the test is about the body.
@pytest.mark.parametrize(("embeddings", "mask", "lengths", "match"), [
    (torch.full((1, 2, 8), float("nan")), torch.ones(1, 2, dtype=torch.uint8), "2", "NaN or inf"),
    (torch.ones(1, 2, 8, dtype=torch.float64), torch.ones(1, 2, dtype=torch.uint8), "2", "float32 or float16"),
    (torch.ones(1, 2, 8), torch.tensor([[0, 1]], dtype=torch.uint8), "1", "right-padded"),
    (torch.ones(1, 2, 8), torch.tensor([[2, 1]], dtype=torch.uint8), "2", "only 0 and 1"),
    (torch.ones(1, 2, 8), torch.zeros(1, 2, dtype=torch.uint8), "1", "at least one"),
    (torch.ones(2, 8), torch.ones(2, dtype=torch.uint8), "2", r"must be \(B, n, d\)"),
])
def test_malformed_tensors_are_refused(embeddings, mask, lengths, match):
    with pytest.raises(WireError, match=match):
        _safetensors(save({"embeddings": embeddings, "attention_mask": mask}), **{"x-privlm-lengths": lengths})


def test_garbage_and_wrong_names_are_refused():
    with pytest.raises(WireError, match="not valid safetensors"):
        _safetensors(b"\x00" * 64)
    with pytest.raises(WireError, match="expected exactly the tensors"):
        _safetensors(save({"input_ids": torch.ones(1, 2)}))


def test_raw_headers_are_checked():
    body = np.zeros((1, 2, 8), dtype="<f4").tobytes()
    for dtype, shape, lengths, match in [("int64", "1,2,8", "2", "Dtype"), ("float32", "1,2", "2", "B,n,d"),
                                         ("float32", "1,2,8", "2,2", "entries"), ("float32", "1,3,8", "2", "bytes"),
                                         ("float32", "1,2,8", "3", "lengths"), ("float32", "a,b,c", "2", "integers"),
                                         ("float32", "+1,2,8", "2", "integers"), ("float32", "1,2,8", "x", "Lengths"),
                                         ("float32", "1,2,8", "0", "Lengths")]:
        with pytest.raises(WireError, match=match):
            _raw(body, dtype, shape, lengths)


@pytest.mark.parametrize("fmt", [SAFETENSORS, RAW])
@pytest.mark.parametrize(("header", "limit"), [("x-privlm-dtype", "dtype"), ("x-privlm-shape", "shape"),
                                               ("x-privlm-lengths", "lengths")])
def test_both_formats_need_their_headers(fmt, header, limit):
    embeddings, mask = _batch()
    body, headers = write_sequences(embeddings, mask, fmt=fmt)
    assert set(headers) == {"content-type", "x-privlm-dtype", "x-privlm-shape", "x-privlm-lengths"}
    del headers[header]
    with pytest.raises(WireError, match=f"{header.title()} header is required") as error:
        read_sequences(body, headers, LIMITS)
    assert error.value.status == 422 and error.value.limit == limit


@pytest.mark.parametrize(("change", "limit", "match"), [
    ({"x-privlm-dtype": "float16"}, "dtype", "declares float16"),
    ({"x-privlm-shape": "3,4,8", "x-privlm-lengths": "4,3,1"}, "shape", r"declares \(3, 4, 8\)"),
    ({"x-privlm-shape": "2,5,8", "x-privlm-lengths": "5,3"}, "shape", r"declares \(2, 5, 8\)"),
    ({"x-privlm-lengths": "5,3,2"}, "lengths", r"lengths \[5, 3, 1\] but X-Privlm-Lengths declares \[5, 3, 2\]"),
    ({"x-privlm-lengths": "5,5,5"}, "lengths", "declares"),
])
def test_a_safetensors_body_must_match_its_headers(change, limit, match):
    embeddings, mask = _batch()
    body, headers = write_sequences(embeddings, mask, fmt=SAFETENSORS)
    with pytest.raises(WireError, match=match) as error:
        read_sequences(body, headers | change, LIMITS)
    assert error.value.status == 422 and error.value.limit == limit


@pytest.mark.parametrize("fmt", [SAFETENSORS, RAW])
@pytest.mark.parametrize(("shape", "lengths", "status", "limit"), [
    ("5,2,8", "2,2,2,2,2", 413, "max_batch"), ("1,7,8", "7", 413, "max_tokens"), ("1,2,9", "2", 422, "dim"),
])
def test_the_declared_shape_is_checked_before_the_body_is_parsed(fmt, shape, lengths, status, limit):
    garbage = b"\xff" * 64  # neither safetensors nor the declared number of bytes
    headers = {"content-type": fmt, "x-privlm-dtype": "float32", "x-privlm-shape": shape, "x-privlm-lengths": lengths}
    with pytest.raises(WireError, match=limit) as error:
        read_sequences(garbage, headers, LIMITS)
    assert error.value.status == status and error.value.limit == limit
    assert "safetensors" not in str(error.value) and "bytes" not in str(error.value)


def test_malformed_answers_are_502_wire_errors():
    for body, headers in [(b"\x00" * 10, {"content-type": SAFETENSORS}),
                          (b"\x00" * 10, {"content-type": RAW, "x-privlm-dtype": "float32", "x-privlm-shape": "2,8"}),
                          (b"\x00" * 8, {"content-type": RAW, "x-privlm-dtype": "int8", "x-privlm-shape": "1,8"})]:
        with pytest.raises(WireError) as error:
            read_rows(body, headers)
        assert error.value.status == 502
