"""Fuzz the server's OpenAPI schema with schemathesis (bounded examples): never a 5xx."""

import schemathesis
from hypothesis import HealthCheck, given, settings

from privlm.models import SplitModel
from privlm.snd.service.server import create_app
from tests.models.tiny import tiny_bert_folder
from tests.service.localhost import serving


def test_no_operation_answers_5xx(tmp_path):
    model = SplitModel.from_pretrained(tiny_bert_folder(tmp_path), device="cpu")
    with serving(create_app(model, denoiser_dirs=[])) as url:
        schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
        operations = [result.ok() for result in schema.get_all_operations()]
        seen: list[tuple[str, int]] = []
        assert {op.path for op in operations} >= {"/v1/snd/encode", "/v1/snd/bundle", "/health"}
        for operation in operations:

            @given(case=operation.as_strategy())
            @settings(max_examples=25, deadline=None, database=None, suppress_health_check=list(HealthCheck))
            def no_server_error(case: schemathesis.Case) -> None:
                response = case.call()
                seen.append((case.path, response.status_code))
                assert response.status_code < 500, (case.method, case.path, response.status_code, response.text[:300])

            no_server_error()
    encode_codes = {code for path, code in seen if path == "/v1/snd/encode"}
    assert encode_codes and encode_codes <= {413, 415, 422}  # fuzzed bodies are refused with 4xx JSON
