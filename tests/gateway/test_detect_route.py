"""The gateway's ``POST /v1/detect``: each text's spans, behind the gateway's keys, nothing sent upstream or charged,
within its limits (400s in OpenAI's shape), the detector loaded once on first use and run off the event loop, and
its OpenAPI fuzzed. A fake layer stands in for the packaged detector (no model loads here)."""

from __future__ import annotations

import asyncio
import re
import threading
from collections.abc import Sequence

import httpx
import pytest
from fastapi import FastAPI

from privlm.accounting import Ledger
from privlm.chat.service.audit import AuditLog
from privlm.chat.service.upstream import ChatUpstream
from privlm.detect import Detector, Kind, Span
from privlm.detect.service import DETECT_PATH, DetectorSource, detect_router
from privlm.gateway import ChatSetup, create_privacy_gateway
from privlm.mechanisms import PrivacyUnit
from privlm.service import BearerKeys, create_service_app
from tests.service.fuzz import conforming, fuzz_openapi
from tests.service.localhost import serving
from tests.support.chat import fake_privacy

KEY = "detect-key-0001"
AUTH = {"authorization": f"Bearer {KEY}"}
PROMPT = "I am Maria Gonzalez, 34, from Seattle. My asthma is getting worse."
FOUND = {"Maria Gonzalez": Kind.PERSON, "34": Kind.AGE, "Seattle": Kind.LOCATION, "asthma": Kind.HEALTH}
TIMEOUT = 60.0


class FakeLayer:
    """Finds the details of FOUND wherever they occur; records each batch; ``gate``, when set, holds every batch
    until it opens (set)."""

    name = "fake"

    def __init__(self, gate: threading.Event | None = None) -> None:
        self.batches: list[list[str]] = []
        self.gate = gate
        self.started = threading.Event()

    def detect(self, texts: Sequence[str]) -> list[list[Span]]:
        self.batches.append(list(texts))
        self.started.set()
        if self.gate is not None:
            assert self.gate.wait(TIMEOUT)
        return [[Span(m.start(), m.end(), kind, 0.9, "fake")
                 for detail, kind in FOUND.items() for m in re.finditer(rf"\b{re.escape(detail)}\b", text)]
                for text in texts]


def _gateway(stub_url: str, detector: DetectorSource, *, ledger: Ledger | None = None,
             keys: Sequence[str] = (KEY,), audit: AuditLog | None = None) -> FastAPI:
    setup = ChatSetup(privacy=fake_privacy(ledger=ledger), upstream=ChatUpstream(stub_url), models=["stub-model"],
                      audit=audit)
    return create_privacy_gateway(chat=setup, detector=detector, api_keys=keys)


def _detect_only(detector: DetectorSource, **limits: int) -> FastAPI:
    """The route alone on the service scaffolding (the gateway's error handlers and limits), open."""
    auth = BearerKeys(())
    router = detect_router(detector, auth=auth, **limits)
    return create_service_app(title="detect", routers=[router], auth=auth, max_request_bytes=8 * 2**20)


def test_each_text_gets_its_spans_with_exact_offsets_and_nothing_goes_upstream_or_is_charged(stub, tmp_path):
    ledger = Ledger(tmp_path / "ledger.sqlite", budgets={PrivacyUnit.EPSILON: 100.0})
    audit = tmp_path / "audit.jsonl"
    layer = FakeLayer()
    texts = [PROMPT, "   ", "Nothing personal here."]
    sent_before = len(stub.bodies)  # the stub is shared by every test of this worker
    with serving(_gateway(stub.url, Detector([layer]), ledger=ledger, audit=AuditLog(audit))) as url:
        answer = httpx.post(f"{url}{DETECT_PATH}", json={"input": texts}, headers=AUTH, timeout=TIMEOUT)
        single = httpx.post(f"{url}{DETECT_PATH}", json={"input": PROMPT}, headers=AUTH, timeout=TIMEOUT)
        audited_by_detect = audit.read_text()
        spent_by_detect = ledger.spent(ledger.principal_of_key(KEY), PrivacyUnit.EPSILON)
        sent_by_detect = len(stub.bodies) - sent_before
        chat = httpx.post(f"{url}/v1/chat/completions", headers=AUTH, timeout=TIMEOUT,
                          json={"model": "stub-model", "messages": [{"role": "user", "content": "hello"}]})
    assert audited_by_detect == ""  # detection releases nothing, so the audit log has nothing to keep
    assert chat.status_code == 200 and '"event": "released"' in audit.read_text()  # while a chat release is kept
    assert answer.status_code == single.status_code == 200, answer.text + single.text
    body = answer.json()
    assert body["object"] == "list" and body["model"] == "privlm-detect"
    assert [item["index"] for item in body["data"]] == [0, 1, 2]
    spans = body["data"][0]["spans"]
    assert [(s["text"], s["kind"]) for s in spans] == [("Maria Gonzalez", "person"), ("34", "age"),
                                                         ("Seattle", "location"), ("asthma", "health")]
    assert all(PROMPT[s["start"]:s["end"]] == s["text"] and s["source"] == "fake" for s in spans)
    assert body["data"][1]["spans"] == body["data"][2]["spans"] == []
    assert single.json()["data"] == body["data"][:1]
    assert [text for batch in layer.batches for text in batch].count("   ") == 0  # a blank text is never detected
    assert sent_by_detect == 0 and len(stub.bodies) == sent_before + 1  # nothing left the machine before the chat
    assert spent_by_detect == 0  # nothing was charged


def test_the_same_keys_as_the_other_routes(stub):
    with serving(_gateway(stub.url, Detector([FakeLayer()]))) as url:
        anonymous = httpx.post(f"{url}{DETECT_PATH}", json={"input": "hi"}, timeout=TIMEOUT)
        wrong = httpx.post(f"{url}{DETECT_PATH}", json={"input": "hi"}, headers={"authorization": "Bearer nope"},
                           timeout=TIMEOUT)
        x_api_key = httpx.post(f"{url}{DETECT_PATH}", json={"input": "hi"}, headers={"x-api-key": KEY},
                               timeout=TIMEOUT)
        models = httpx.get(f"{url}/v1/models", headers=AUTH, timeout=TIMEOUT)
    assert anonymous.status_code == wrong.status_code == 401
    assert anonymous.json()["error"]["type"] == "authentication_error"
    assert x_api_key.status_code == 200
    assert "privlm-detect" not in {entry["id"] for entry in models.json()["data"]}  # not a chat model to pick


@pytest.mark.parametrize(("body", "code", "named"), [
    ({"input": ["a"] * 257}, "max_inputs_per_request", "1 to 256 texts, got 257"),
    ({"input": []}, "max_inputs_per_request", "1 to 256 texts, got 0"),
    ({"input": ["x" * 150_000, "y" * 50_001]}, "max_chars_per_request", "200,001 characters"),
    ({"input": 3}, "invalid_request", "input"),
    ({"text": "hello"}, "invalid_request", "input"),
])
def test_a_request_over_the_limits_is_a_400_in_openais_shape(body, code, named):
    layer = FakeLayer()
    with serving(_detect_only(Detector([layer]))) as url:
        answer = httpx.post(f"{url}{DETECT_PATH}", json=body, timeout=TIMEOUT)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == code and error["param"] == "input"
    assert named in error["message"] and layer.batches == []


def test_a_lone_surrogate_is_refused_by_index_never_by_text():
    with serving(_detect_only(Detector([FakeLayer()]))) as url:
        answer = httpx.post(f"{url}{DETECT_PATH}", content=b'{"input": ["fine", "secret \\ud800 detail"]}',
                            headers={"content-type": "application/json"}, timeout=TIMEOUT)
    assert answer.status_code == 400
    assert "input[1] is not valid Unicode" in answer.json()["error"]["message"] and "secret" not in answer.text


def test_the_body_limit_of_the_gateway_holds():
    with serving(_detect_only(Detector([FakeLayer()]))) as url:
        answer = httpx.post(f"{url}{DETECT_PATH}", json={"input": "x" * (8 * 2**20)}, timeout=TIMEOUT)
    assert answer.status_code == 413


def test_the_detector_is_made_once_on_first_use_and_a_failed_load_is_a_503_tried_again():
    layer = FakeLayer()
    calls: list[int] = []

    def factory() -> Detector:
        calls.append(1)
        if len(calls) == 1:
            raise FileNotFoundError("/secret/path/tagger.safetensors")
        return Detector([layer])

    app = _detect_only(factory)
    with serving(app) as url:
        assert calls == []  # nothing loads at start
        failed = httpx.post(f"{url}{DETECT_PATH}", json={"input": PROMPT}, timeout=TIMEOUT)
        answers = [httpx.post(f"{url}{DETECT_PATH}", json={"input": PROMPT}, timeout=TIMEOUT) for _ in range(3)]
    assert failed.status_code == 503
    error = failed.json()["error"]
    assert error["code"] == "detector_unavailable" and "FileNotFoundError" in error["message"]
    assert "/secret/path" not in failed.text  # the log says why; the caller is told the type only
    assert [answer.status_code for answer in answers] == [200, 200, 200] and len(calls) == 2


def test_detection_runs_off_the_event_loop_in_batches_of_bounded_size():
    gate = threading.Event()
    layer = FakeLayer(gate)
    with serving(_detect_only(Detector([layer]), batch_units=2)) as url:

        async def scenario() -> tuple[httpx.Response, httpx.Response]:
            async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as http:
                detecting = asyncio.ensure_future(http.post(DETECT_PATH, json={"input": [PROMPT] * 5}))
                assert await asyncio.to_thread(layer.started.wait, TIMEOUT)
                health = await http.get("/health")  # answered while the detector holds its batch
                gate.set()
                return await detecting, health

        answer, health = asyncio.run(scenario())
    assert health.status_code == 200 and answer.status_code == 200
    assert len(answer.json()["data"]) == 5 and all(item["spans"] for item in answer.json()["data"])
    assert sum(len(batch) for batch in layer.batches) == 5 and max(len(batch) for batch in layer.batches) <= 2


def test_a_good_request_conforms_to_the_documented_schema(stub):
    with serving(_gateway(stub.url, Detector([FakeLayer()]), keys=())) as url:
        answer = conforming(url, "POST", DETECT_PATH, body={"input": [PROMPT, "no detail"]},
                            media_type="application/json")
    assert answer.status_code == 200 and answer.json()["data"][0]["spans"]


def test_the_routes_openapi_never_answers_5xx():
    """schemathesis over the route on the gateway's scaffolding (its error handlers and limits): schema-valid and
    schema-invalid cases under the conformance checks of tests/service/fuzz.py. (The whole gateway's fuzzing, in
    tests/gateway/test_chat_fuzz.py, loads SmolLM2; the schema there is checked by the test above.)"""
    with serving(_detect_only(Detector([FakeLayer()]))) as url:
        seen = fuzz_openapi(url, max_examples=30)
    codes = {code for path, code in seen if path == DETECT_PATH}
    assert 200 in codes and 400 in codes and all(code < 500 for code in codes), codes


def test_the_gateway_settings_mount_the_route_with_the_packaged_detector_on_their_device(stub, monkeypatch):
    """``build`` (what ``privlm gateway`` and each Ray replica run) mounts /v1/detect with ``Detector.default`` on the
    gateway's --device, made on the first request."""
    from privlm.gateway.setup import GatewaySetups, build
    from privlm.settings.chat import ChatSettings
    from privlm.settings.gateway import GatewaySettings

    devices: list[str] = []
    layer = FakeLayer()

    def default(cls: type[Detector], *, device: str = "auto") -> Detector:
        devices.append(device)
        return Detector([layer])

    monkeypatch.setattr(Detector, "default", classmethod(default))
    settings = GatewaySettings(chat=ChatSettings(upstream=stub.url, epsilon=6.0, mechanism="santext"), device="cpu")
    setup = ChatSetup(privacy=fake_privacy(), upstream=ChatUpstream(stub.url), models=["stub-model"])
    app = build(settings, GatewaySetups(embeddings=None, chat=setup, api_keys=()))
    assert devices == []
    with serving(app) as url:
        answer = httpx.post(f"{url}{DETECT_PATH}", json={"input": PROMPT}, timeout=TIMEOUT)
    assert answer.status_code == 200 and devices == ["cpu"] and layer.batches == [[PROMPT]]
