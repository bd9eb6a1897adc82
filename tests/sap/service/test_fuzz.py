"""Fuzz the SAP vendor's OpenAPI schema with schemathesis (bounded examples) under the conformance checks: never a
5xx, every answer documented, schema-invalid requests refused; on a session that exists, so the routes behind it
are reached."""

import httpx
import pytest
import schemathesis

from privlm.sap.model import VendorModel
from privlm.sap.service.server import create_vendor_app
from privlm.sap.service.wire import SAP_MESSAGE, SESSIONS_PATH
from tests.sap.service.conftest import KEYS
from tests.service.fuzz import fuzz_openapi
from tests.service.localhost import serving

schemathesis.serializer.alias(SAP_MESSAGE, "application/octet-stream")  # SAP messages travel as their bytes


@pytest.mark.slow
def test_no_operation_answers_5xx(vendor_model, tmp_path):
    app = create_vendor_app(VendorModel.load(str(vendor_model)), store=tmp_path / "store", api_keys=KEYS)
    headers = {"Authorization": f"Bearer {KEYS[0]}"}
    with serving(app) as url:
        fingerprint = httpx.get(f"{url}/v1/sap/bottoms/0", headers=headers).json()["fingerprint"]
        session = httpx.post(f"{url}{SESSIONS_PATH}", headers=headers,
                             json={"n_classes": 2, "head": "customer", "bottom_fingerprint": fingerprint})
        session.raise_for_status()
        seen = fuzz_openapi(url, headers=headers, max_examples=40, path_parameters={"session_id": session.json()["id"]})
    paths = {path for path, _ in seen}
    assert {SESSIONS_PATH, SESSIONS_PATH + "/{session_id}/exchange", "/health", "/metrics"} <= paths
    assert all(code < 500 for _, code in seen)
    exchange = {code for path, code in seen if path.endswith("/exchange")}
    assert exchange and exchange <= {400, 401, 404, 405, 409, 413, 415, 422}
    assert exchange - {401, 404, 405}  # the generated bodies reached the session, and were refused as bodies
    info = {code for path, code in seen if path == SESSIONS_PATH + "/{session_id}"}
    assert 200 in info  # the session route answered for the pinned session
