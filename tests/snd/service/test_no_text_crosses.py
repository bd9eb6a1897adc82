"""Capture the real bytes of an SnD round trip and prove that no text and no token id crosses."""

import re

import httpx
import numpy as np
import pytest
from transformers import PreTrainedTokenizerBase

from privlm.snd import Client, ClientOptions
from privlm.snd.service.server import create_app
from privlm.wire import RAW, SAFETENSORS
from tests.service.leaks import id_patterns
from tests.service.localhost import RecordingProxy, serving

SECRETS = ["Patient Johanna Kowalczyk was diagnosed with pneumonia in Rotterdam.",
           "My account number is 88412 and my password is hunter2."]


def _leaks(traffic: bytes, tokenizer: PreTrainedTokenizerBase) -> tuple[list[str], list[bytes]]:
    words = {w.lower() for text in SECRETS for w in re.findall(r"[A-Za-z0-9]{4,}", text)}
    leaked_words = [w for w in words if w.encode() in traffic.lower()]
    leaked_ids = [p for text in SECRETS for p in id_patterns(tokenizer(text, add_special_tokens=False)["input_ids"])
                  if p in traffic]
    return leaked_words, leaked_ids


@pytest.mark.slow
def test_the_detector_sees_a_leaky_request(minilm):
    """Negative control: text and ids sent through the same proxy are found."""
    with serving(create_app(minilm)) as served:
        proxy = RecordingProxy(httpx.URL(served).port)
        ids = minilm.tokenizer(SECRETS[0], add_special_tokens=False)["input_ids"]
        httpx.post(f"http://127.0.0.1:{proxy.port}/v1/snd/encode", json={"text": SECRETS[0]})
        httpx.post(f"http://127.0.0.1:{proxy.port}/v1/snd/encode", content=np.array(ids, dtype="<i8").tobytes(),
                   headers={"content-type": RAW})
        proxy.close()
    words, id_patterns = _leaks(bytes(proxy.upstream), minilm.tokenizer)
    assert "kowalczyk" in words and id_patterns


@pytest.mark.slow
@pytest.mark.parametrize("wire_format", [SAFETENSORS, RAW])
def test_a_round_trip_carries_no_text_and_no_token_ids(minilm, tmp_path, wire_format):
    with serving(create_app(minilm)) as served:
        proxy = RecordingProxy(httpx.URL(served).port)
        client = Client(f"http://127.0.0.1:{proxy.port}", eta=50.0, device="cpu", cache_dir=tmp_path,
                        options=ClientOptions(wire_format=wire_format))
        proxy.clear()  # the bundle (vocabulary, weights) went server -> client before any user text existed
        client.encode(SECRETS)
        client.close()
        proxy.close()
    traffic = bytes(proxy.upstream) + bytes(proxy.downstream)
    assert b"/v1/snd/encode" in proxy.upstream and len(proxy.upstream) > 10_000  # the capture is real
    assert _leaks(traffic, minilm.tokenizer) == ([], [])
    assert b"input_ids" not in traffic
