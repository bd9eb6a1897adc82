"""Fuzz the SnD server's OpenAPI schema with schemathesis (bounded examples) under the conformance checks:
never a 5xx, every answer documented, schema-invalid requests (a body without its X-Privlm-* headers,
malformed header values) refused."""

import pytest

from privlm.models import SplitModel
from privlm.snd.service.server import create_app
from tests.models.tiny import tiny_bert_folder
from tests.service.fuzz import fuzz_openapi
from tests.service.localhost import serving


@pytest.mark.slow
def test_no_operation_answers_5xx(tmp_path):
    model = SplitModel.from_pretrained(tiny_bert_folder(tmp_path), device="cpu")
    with serving(create_app(model, denoiser_dirs=[])) as url:
        seen = fuzz_openapi(url, max_examples=100)  # about 6 s
    assert {path for path, _ in seen} >= {"/v1/snd/encode", "/v1/snd/bundle", "/health", "/metrics"}
    encode_codes = {code for path, code in seen if path == "/v1/snd/encode"}
    assert encode_codes and encode_codes <= {405, 413, 415, 422}  # fuzzed bodies refused; 405: undocumented methods
