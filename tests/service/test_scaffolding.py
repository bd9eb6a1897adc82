"""The shared service scaffolding, on a toy app run by a real uvicorn server: keys, limits, errors, metrics."""

import asyncio
import hashlib
import json
import secrets

import httpx
import pytest
from fastapi import APIRouter, Request
from pydantic import BaseModel

from privlm.accounting import BudgetExhaustedError
from privlm.mechanisms import PrivacyUnit
from privlm.service import BearerKeys, Bundle, RetryPolicy, ServerError, ServiceError, create_service_app
from privlm.service.bundle import ERROR_BODY_LIMIT, check_file_name, download_bundle, get_capped
from privlm.wire import WireError
from tests.service.localhost import serving

LIMIT = 1 << 20


class Item(BaseModel):
    name: str


def _app(keys=()):
    router = APIRouter()

    @router.post("/echo")
    async def echo(request: Request) -> dict[str, int]:
        return {"bytes": len(await request.body())}

    @router.post("/json")
    async def parse(item: Item) -> dict[str, str]:
        return {"name": item.name}

    @router.get("/fail/{kind}")
    async def fail(kind: str) -> None:
        if kind == "service":
            raise ServiceError(418, "a teapot", param="kind", code="teapot")
        if kind == "wire":
            raise WireError("batch too big", status=413, limit="max_batch")
        if kind == "budget":
            raise BudgetExhaustedError(principal="key:ab", unit=PrivacyUnit.EPSILON, budget=10.0, spent=9.5,
                                       requested=1.0)
        raise RuntimeError("secret internal detail")

    return create_service_app(title="toy", routers=[router], auth=BearerKeys(keys), max_request_bytes=LIMIT,
                              health=lambda: {"answer": 42})


@pytest.fixture(scope="module")
def url():
    with serving(_app(keys=["k1", "k2"])) as base:
        yield base


def _auth(key="k2"):
    return {"authorization": f"Bearer {key}"}


def _error(response):
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


def test_finding_9_every_error_has_openai_shape(url):
    cases = [("/fail/service", 418, "invalid_request_error", "kind", "teapot"),
             ("/fail/wire", 413, "invalid_request_error", "max_batch", "limit_exceeded"),
             ("/fail/budget", 429, "insufficient_quota", "epsilon budget", "budget_exhausted"),
             ("/fail/other", 500, "server_error", None, None),
             ("/nowhere", 404, "not_found_error", None, None)]
    for path, status, kind, param, code in cases:
        response = httpx.get(url + path, headers=_auth())
        assert response.status_code == status, path
        error = _error(response)
        assert (error["type"], error["param"], error["code"]) == (kind, param, code), path
    assert "secret internal detail" not in httpx.get(url + "/fail/other", headers=_auth()).text
    budget = httpx.get(url + "/fail/budget", headers=_auth())
    assert budget.headers["x-privlm-budget-remaining"] == "0.5" and "0.5 left" in _error(budget)["message"]
    invalid = httpx.post(url + "/json", json={"name": ["not", "a", "string"]}, headers=_auth())
    assert invalid.status_code == 400 and _error(invalid)["param"] == "name"


def test_keys_guard_every_route_but_health(url):
    assert httpx.get(url + "/health").json() == {"status": "ok", "answer": 42}
    for headers in ({}, _auth("nope"), {"authorization": "Basic azE6"}):
        refused = httpx.post(url + "/echo", content=b"x", headers=headers)
        assert refused.status_code == 401 and refused.headers["www-authenticate"] == "Bearer"
        assert _error(refused)["code"] == "invalid_api_key"
    assert httpx.get(url + "/metrics").status_code == 401
    for key in ("k1", "k2"):
        assert httpx.post(url + "/echo", content=b"abc", headers=_auth(key)).json() == {"bytes": 3}


def test_finding_5_keys_are_compared_against_every_key_in_constant_time(monkeypatch):
    calls = []
    real = secrets.compare_digest
    monkeypatch.setattr(secrets, "compare_digest", lambda a, b: calls.append(len(a)) or real(a, b))
    from fastapi.security import HTTPAuthorizationCredentials

    keys = BearerKeys(["first", "second", "third"])
    for attempt in ("first", "third", "wrong"):
        calls.clear()
        try:
            principal = keys(HTTPAuthorizationCredentials(scheme="Bearer", credentials=attempt))
        except ServiceError:
            principal = None
        assert calls == [32, 32, 32]  # every accepted key, as fixed-length digests, whatever matched
        assert principal == (None if attempt == "wrong" else keys.principal(attempt))  # an HMAC of the key


@pytest.mark.parametrize("keys", [[""], ["ok", "  "]])
def test_finding_5_empty_keys_are_refused_at_start_up(keys):
    with pytest.raises(ValueError, match="empty key"):
        BearerKeys(keys)


def test_finding_3_body_limit_holds_whatever_content_length_says(url):
    assert httpx.post(url + "/echo", content=b"x" * LIMIT, headers=_auth()).json() == {"bytes": LIMIT}
    declared = httpx.post(url + "/echo", content=b"x" * (LIMIT + 1), headers=_auth())
    assert declared.status_code == 413 and _error(declared)["param"] == "max_request_bytes"

    def chunks():  # chunked transfer: no Content-Length at all
        for _ in range(16):
            yield b"x" * (LIMIT // 4)

    streamed = httpx.post(url + "/echo", content=chunks(), headers=_auth())
    assert streamed.status_code == 413 and "exceeds max_request_bytes" in _error(streamed)["message"]


def _resident_mib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096 / 2**20


class Upload:
    """256 chunks of 1 MiB, sent lazily (chunked transfer); ``sent`` counts the chunks the client produced."""

    def __init__(self) -> None:
        self.sent = 0

    def __iter__(self):
        for _ in range(256):
            self.sent += 1
            yield b"x" * (1 << 20)


def test_finding_3_an_oversized_chunked_upload_is_refused_at_the_limit_with_flat_memory(url):
    """256 MiB sent chunked to a 1 MiB limit: refused once the limit is crossed; the server (this process)
    grows by less than 16 MiB."""
    upload = Upload()
    before = _resident_mib()
    response = httpx.post(url + "/echo", content=iter(upload), headers=_auth(), timeout=60)
    assert response.status_code == 413
    assert _resident_mib() - before < 16
    assert upload.sent < 64  # the upload was cut off long before its end


def test_metrics_count_requests_by_route_and_status(url):
    httpx.post(url + "/echo", content=b"x", headers=_auth())
    text = httpx.get(url + "/metrics", headers=_auth()).text
    assert 'privlm_requests_total{endpoint="/echo",status="200"}' in text
    assert 'status="401"' in text and 'status="413"' in text


def _flaky(statuses):
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.path)
        status = statuses[min(len(seen) - 1, len(statuses) - 1)]
        if status == 0:
            raise httpx.ConnectError("refused")
        body = {"error": {"message": "bad input", "type": "invalid_request_error"}} if status == 400 else {}
        return httpx.Response(status, json=body)

    return handler, seen


@pytest.mark.parametrize("driver", ["sync", "async"])
def test_one_retry_policy_for_sync_and_async_clients(driver):
    def run(statuses, retries=5):
        handler, seen = _flaky(statuses)
        policy = RetryPolicy(retries=retries, backoff=0.0)
        if driver == "sync":
            with httpx.Client(transport=httpx.MockTransport(handler), base_url="http://x") as http:
                return policy.call(lambda: http.get("/a")), policy, seen

        async def main():
            async with httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://x") as http:
                return await policy.acall(lambda: http.get("/a"))
        return asyncio.run(main()), policy, seen

    response, policy, seen = run([0, 503, 429, 200])
    assert response.status_code == 200 and policy.failed_attempts == 3 and len(seen) == 4
    with pytest.raises(ValueError, match=r"\(400\): bad input"):
        run([400, 200])
    with pytest.raises(ServerError, match="500"):
        run([500])
    with pytest.raises(ServerError, match="no answer after 3 attempts"):
        run([503], retries=2)


@pytest.mark.parametrize("name", ["../x", "/etc/passwd", "a/../../b", "a//b", ".", "..", "a\\b", "x" * 200, "",
                                  "tokenizer/../../.bashrc", "a/b/c/d/e", "~/x", "a/./b", "...", 7])
def test_finding_1_unsafe_bundle_file_names_are_refused(name):
    with pytest.raises(ServerError):
        check_file_name(name)


def test_finding_1_bundles_download_by_name_verify_and_stay_in_their_folder(tmp_path):
    bundle = Bundle(format="toy/1")
    bundle.add("model.json", b"{}")
    bundle.add("tokenizer/vocab.txt", b"a\nb\n")
    manifest = bundle.manifest()
    assert all(set(entry) == {"name", "sha256", "size"} for entry in manifest["files"])  # names, never URLs
    fetched = []

    def fetch(name: str, size: int) -> bytes:
        fetched.append((name, size))
        return bundle.files[name].content

    def toy(name: str) -> bool:
        return name in {"model.json", "tokenizer/vocab.txt"}

    folder = download_bundle(manifest, fetch, tmp_path, namespace="toy", allowed=toy)
    assert (folder / "tokenizer" / "vocab.txt").read_bytes() == b"a\nb\n"
    assert fetched == [("model.json", 2), ("tokenizer/vocab.txt", 4)]  # each with the size it must not exceed
    download_bundle(manifest, fetch, tmp_path, namespace="toy", allowed=toy)
    assert len(fetched) == 2  # intact files are reused
    evil = json.loads(json.dumps(manifest))
    evil["files"].append({"name": "../../escaped.txt", "sha256": hashlib.sha256(b"x").hexdigest(), "size": 1})
    with pytest.raises(ServerError, match="plain relative name"):
        download_bundle(evil, lambda *_: b"x", tmp_path / "cache", namespace="toy", allowed=lambda _: True)
    assert not list(tmp_path.rglob("escaped.txt"))
    with pytest.raises(ServerError, match="sha256"):
        download_bundle(manifest, lambda *_: b"tampered", tmp_path / "other", namespace="toy", allowed=toy)


@pytest.mark.parametrize("size", [-1, True, 1.5, "1"])
def test_finding_1_a_manifest_entry_with_an_odd_size_is_refused(tmp_path, size):
    manifest = {"files": [{"name": "model.json", "sha256": "0" * 64, "size": size}]}
    with pytest.raises(ServerError, match="malformed"):
        download_bundle(manifest, lambda *_: b"", tmp_path, namespace="toy", allowed=lambda _: True)


def test_finding_1_a_name_outside_the_allowed_set_is_refused_before_anything_is_fetched(tmp_path):
    bundle = Bundle(format="toy/1")
    bundle.add("model.json", b"{}")
    bundle.add("startup/run.py", b"import os")  # well formed, but not a file this kind of bundle holds
    fetched: list[str] = []
    with pytest.raises(ServerError, match=r"'startup/run\.py', not a file this kind of bundle holds"):
        download_bundle(bundle.manifest(), lambda name, size: fetched.append(name) or b"", tmp_path,
                        namespace="toy", allowed=lambda name: name == "model.json")
    assert fetched == [] and not list(tmp_path.rglob("*"))


def _capped(handler, limit: int, **retry) -> tuple[httpx.Response, list[int]]:
    served: list[int] = []

    def counting(request: httpx.Request) -> httpx.Response:
        response = handler(request)
        served.append(response.status_code)
        return response

    with httpx.Client(base_url="http://toy", transport=httpx.MockTransport(counting)) as http:
        return get_capped(http, "/f", limit, RetryPolicy(backoff=0, **retry)), served


def test_finding_1_capped_reads_stop_at_the_limit_and_are_not_retried():
    def endless(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=iter(lambda: b"x" * 1000, None))  # never ends

    with pytest.raises(ServerError, match="limit of 4096 bytes"):
        _capped(endless, 4096)
    with pytest.raises(ServerError, match="declares 5000 bytes, over its limit of 4096"):  # by content-length
        _capped(lambda request: httpx.Response(200, content=b"x" * 5000), 4096)
    response, served = _capped(lambda request: httpx.Response(200, content=b"x" * 4096,
                                                              headers={"x-privlm-sha256": "s"}), 4096)
    assert response.content == b"x" * 4096 and response.headers["x-privlm-sha256"] == "s" and served == [200]
    busy = iter([httpx.Response(503, content=iter(lambda: b"x" * 1000, None)), httpx.Response(200, content=b"ok")])
    response, served = _capped(lambda request: next(busy), 10)  # an endless error body is cut, the 503 retried
    assert response.content == b"ok" and served == [503, 200]
    refused = httpx.Response(400, json={"error": {"message": "bad name", "code": "nope"}})
    with pytest.raises(ValueError, match="bad name"):  # an error body under the cap reads as before
        _capped(lambda request: refused, ERROR_BODY_LIMIT)


def test_finding_3_a_body_without_an_accepted_key_is_refused_before_it_is_read(url):
    """The 401 comes back while the client is still holding most of its declared body: nothing was buffered."""
    import socket

    port = int(url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 1000000\r\n\r\n" + b"x" * 100)
        answer = sock.recv(4096)
    assert answer.startswith(b"HTTP/1.1 401") and b"invalid_api_key" in answer
    upload = Upload()
    refused = httpx.post(url + "/echo", content=iter(upload), headers=_auth("wrong"), timeout=60)
    assert refused.status_code == 401 and upload.sent < 64  # cut off long before its 256 MiB


def test_an_exhausted_budget_is_final_for_clients(url):
    budget = httpx.get(url + "/fail/budget", headers=_auth())
    assert budget.headers["x-should-retry"] == "false"  # OpenAI's SDKs do not retry it either
    policy = RetryPolicy(retries=3, backoff=0.0)
    with httpx.Client(base_url=url, headers=_auth()) as http, pytest.raises(ValueError, match=r"\(429\)"):
        policy.call(lambda: http.get("/fail/budget"))
    assert policy.failed_attempts == 0


def test_the_fair_caller_is_the_key_s_principal_or_on_an_open_service_each_request() -> None:
    from privlm.service import BearerKeys

    keyed = BearerKeys(["k-one-two-three"])
    principal = keyed.principal("k-one-two-three")
    assert keyed.fair_caller(principal) == principal
    open_service = BearerKeys(())
    first, second = (open_service.fair_caller(open_service.principal("")) for _ in range(2))
    assert first != second and first.startswith("request-") and second.startswith("request-")
