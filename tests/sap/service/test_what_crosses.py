"""Capture the real TCP traffic of a SAP fine-tuning run and an inference call, and prove what crosses.

No text and no token-id sequence crosses, in either placement of the head. With ``head="customer"`` no label
crosses: every message is parsed and holds only privatized rows, masks, example ids and d-wide gradients. With
``head="vendor"`` the returned gradients name every label: the label-inference attack reads them all from the
captured bytes. A negative control proves the detector fires on a leaky client.
"""

from __future__ import annotations

import json
import re

import httpx
import numpy as np
import pytest
import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from privlm.attacks import label_inference_from_logit_gradients
from privlm.sap import Forward, OutputGradient, SapConfig, Upload, from_bytes
from privlm.sap.model import VendorModel
from privlm.sap.service.client import Client
from privlm.sap.service.server import create_vendor_app
from privlm.sap.service.wire import SESSIONS_PATH
from privlm.sap.training import Schedule
from tests.sap.service.conftest import KEYS
from tests.service.leaks import id_patterns
from tests.service.localhost import RecordingProxy, serving

SECRETS = [
    "Johanna Kowalczyk flew to Rotterdam and her luggage vanished", "Marek Nowicki adored the Lisbon crew",
    "my passport number 88412 was exposed by the kiosk", "the steward Svetlana rebooked me kindly",
    "Brunhilde waited nine hours in Stuttgart with twins", "the Valparaiso suite was wonderful",
    "lost insulin pens on the Reykjavik leg", "Thaddeus loved the quiet cabin to Oaxaca",
]
LABELS = [0, 0, 1, 0, 1, 1, 1, 0]  # not alternating: int64 masks read as int32 alternate 1s and 0s


def _text_leaks(traffic: bytes, tokenizer: PreTrainedTokenizerBase) -> tuple[list[str], list[bytes]]:
    words = {w.lower() for text in SECRETS for w in re.findall(r"[A-Za-z0-9]{5,}", text)}
    leaked_words = [w for w in words if w.encode() in traffic.lower()]
    leaked_ids = [p for text in SECRETS for p in id_patterns(tokenizer(text, add_special_tokens=False)["input_ids"])
                  if p in traffic]
    return leaked_words, leaked_ids


def _label_patterns(labels: list[int]) -> list[bytes]:
    array = np.array(labels)
    return [array.astype(dtype).tobytes() for dtype in ("<i8", "<i4", "<i2", "u1")] + [
        json.dumps(labels).encode(), ",".join(map(str, labels)).encode()]


def _requests(stream: bytes) -> list[tuple[str, bytes]]:
    """(request line, body) of every HTTP/1.1 request in a captured client -> server stream."""
    found, at = [], 0
    while (end := stream.find(b"\r\n\r\n", at)) != -1:
        head = stream[at:end].decode("latin-1")
        length = int(re.search(r"(?im)^content-length:\s*(\d+)", head).group(1)) if "content-length" in \
            head.lower() else 0
        found.append((head.split("\r\n", 1)[0], stream[end + 4:end + 4 + length]))
        at = end + 4 + length
    return found


def _run(vendor_model, tmp_path, head: str) -> tuple[RecordingProxy, Client]:  # type: ignore[no-untyped-def]
    config = SapConfig(blocks=0, eta=50.0, head=head, epochs=1, batch_size=4)  # type: ignore[arg-type]
    app = create_vendor_app(VendorModel.load(str(vendor_model)), store=tmp_path / "store", api_keys=KEYS)
    with serving(app) as served:
        proxy = RecordingProxy(httpx.URL(served).port)
        client = Client(f"http://127.0.0.1:{proxy.port}", config=config, n_classes=2, api_key=KEYS[0],
                        cache_dir=tmp_path / "cache")
        proxy.clear()  # the bundle (the tokenizer's vocabulary) went vendor -> customer before any user text existed
        client.fit(SECRETS, LABELS, SECRETS[:4], LABELS[:4], progress=False)
        client.predict(SECRETS[4:])
        client.close()
        proxy.close()
    return proxy, client


@pytest.mark.parametrize("head", ["customer", "vendor"])
def test_no_text_and_no_token_ids_cross(vendor_model, tmp_path, head):
    proxy, client = _run(vendor_model, tmp_path, head)
    upstream, traffic = bytes(proxy.upstream), bytes(proxy.upstream) + bytes(proxy.downstream)
    assert upstream.count(b"/exchange") >= 4 and len(upstream) > 10_000  # the capture is real
    assert _text_leaks(traffic, client.customer.tokenizer) == ([], [])
    assert b"input_ids" not in traffic and b"label" not in upstream


def test_with_the_head_at_the_customer_no_label_crosses(vendor_model, tmp_path):
    proxy, _ = _run(vendor_model, tmp_path, "customer")
    upstream = bytes(proxy.upstream)
    messages = [from_bytes(body) for line, body in _requests(upstream) if line.endswith("/exchange HTTP/1.1")]
    kinds = {type(m).__name__ for m in messages}
    assert kinds == {"Upload", "Forward", "OutputGradient"}
    schedule = Schedule(len(SECRETS), batch_size=4, epochs=1, seed=0)
    for message in messages:  # what each carries: privatized rows, masks, example ids, d-wide gradients
        if isinstance(message, OutputGradient):
            assert message.gradient.shape[1] == 32  # dL/dh, the representation's width, not the label count
        batch = message.batch if isinstance(message, Upload | Forward) else None
        if batch is not None:
            assert batch.values.dtype == torch.float32 and batch.values.shape[-1] == 32
        if isinstance(message, Forward) and message.train:  # training batches name examples, as scheduled
            assert message.example_ids.tolist() == schedule.batch(message.step)
        masks = [batch.attention_mask] if batch is not None else []
        for mask in masks:  # 0/1 masks, right-padded: they carry the token counts and nothing else
            lengths = mask.sum(dim=1, keepdim=True)
            assert torch.equal(mask, (torch.arange(mask.shape[1]) < lengths).long())
    # the labels in the order of the data set, in any integer width or as text (a batch's few 0/1 labels are
    # not sought as bytes: int64 masks hold such runs; the structure above excludes them)
    assert not [p for p in _label_patterns(LABELS) if p in upstream]


def test_with_the_head_at_the_vendor_the_captured_gradients_name_every_label(vendor_model, tmp_path):
    proxy, _ = _run(vendor_model, tmp_path, "vendor")
    messages = [from_bytes(body) for line, body in _requests(bytes(proxy.upstream))
                if line.endswith("/exchange HTTP/1.1")]
    examples: dict[int, list[int]] = {}
    gradients, truth = [], []
    for message in messages:
        if isinstance(message, Forward) and message.train:
            examples[message.step] = message.example_ids.tolist()
        elif isinstance(message, OutputGradient):
            gradients.append(message.gradient)
            truth += [LABELS[i] for i in examples[message.step]]
    result = label_inference_from_logit_gradients(torch.cat(gradients), torch.tensor(truth))
    assert result.trials == len(SECRETS) and result.rate == 1.0


def test_the_detector_fires_on_a_leaky_client(vendor_model, tmp_path):
    """Negative control: a client that sends the text, its token ids and the labels is caught by every check."""
    app = create_vendor_app(VendorModel.load(str(vendor_model)), store=tmp_path / "store", api_keys=KEYS)
    with serving(app) as served:
        proxy = RecordingProxy(httpx.URL(served).port)
        url = f"http://127.0.0.1:{proxy.port}{SESSIONS_PATH}"
        tokenizer = AutoTokenizer.from_pretrained(vendor_model)
        ids = tokenizer(SECRETS[0], add_special_tokens=False)["input_ids"]
        headers = {"Authorization": f"Bearer {KEYS[0]}"}
        httpx.post(url, json={"text": SECRETS[0], "label": LABELS}, headers=headers)
        httpx.post(url, content=np.array(ids, dtype="<i8").tobytes() + np.array(LABELS).astype("<i8").tobytes(),
                   headers=headers)
        proxy.close()
    upstream = bytes(proxy.upstream)
    words, id_patterns = _text_leaks(upstream, tokenizer)
    assert "kowalczyk" in words and id_patterns
    assert [p for p in _label_patterns(LABELS) if p in upstream]

