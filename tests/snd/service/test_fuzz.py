"""Fuzz the SnD server's OpenAPI schema with schemathesis (bounded examples): never a 5xx."""

from privlm.models import SplitModel
from privlm.snd.service.server import create_app
from tests.models.tiny import tiny_bert_folder
from tests.service.fuzz import fuzz_openapi
from tests.service.localhost import serving


def test_no_operation_answers_5xx(tmp_path):
    model = SplitModel.from_pretrained(tiny_bert_folder(tmp_path), device="cpu")
    with serving(create_app(model, denoiser_dirs=[])) as url:
        seen = fuzz_openapi(url)
    assert {path for path, _ in seen} >= {"/v1/snd/encode", "/v1/snd/bundle", "/health", "/metrics"}
    encode_codes = {code for path, code in seen if path == "/v1/snd/encode"}
    assert encode_codes and encode_codes <= {413, 415, 422}  # fuzzed bodies are refused with 4xx JSON
