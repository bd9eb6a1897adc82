"""Check a running service against its own OpenAPI schema with schemathesis.

``fuzz_openapi`` calls every operation with generated cases, schema-valid and schema-invalid, and runs
the conformance checks on every answer: no 5xx, every status code, content type and response header
documented, bodies that match their schemas, schema-invalid requests refused. ``conforming`` does the
same for one hand-made request (a valid payload, which fuzzing never finds).
"""

from __future__ import annotations

from typing import Any

import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    missing_required_header,
    negative_data_rejection,
    not_a_server_error,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
    unsupported_method,
)
from schemathesis.core.parameters import ParameterLocation

# Not ignored_auth: it re-sends with the session's headers; auth is tested on its own. Not
# positive_data_acceptance: a tensor payload's validity (bytes that match the declared dtype and shape, a
# shape within the server's limits and of the model's dimension) cannot be expressed in OpenAPI, so
# schema-valid random bytes are rightly refused. missing_required_header and unsupported_method judge the
# cases of schemathesis's coverage phase (each required header left out, undocumented methods), which
# `fuzz_openapi` runs too.
CONFORMANCE = [not_a_server_error, status_code_conformance, content_type_conformance, response_headers_conformance,
               response_schema_conformance, negative_data_rejection, missing_required_header, unsupported_method]


# Binary tensor payloads travel as the bytes they are.
schemathesis.serializer.alias("application/x-safetensors", "application/octet-stream")


def fuzz_openapi(url: str, *, headers: dict[str, str] | None = None, max_examples: int = 25,
                 path_parameters: dict[str, str] | None = None) -> list[tuple[str, int]]:
    """Every operation with generated cases under the conformance checks. Returns (path, status) of every call.
    ``path_parameters`` pin path parameters of that name to a value (an existing session's id, say), so that the
    generated bodies reach what lies behind it (a DELETE keeps its generated value: the resource must survive)."""
    pinned = path_parameters or {}

    def pin(case: schemathesis.Case) -> schemathesis.Case:
        negative = case.meta is not None and case.meta.is_negative_at(ParameterLocation.PATH)
        if case.path_parameters and case.method.upper() != "DELETE" and not negative:  # DELETE: it must survive
            case.path_parameters = {k: pinned.get(k, v) for k, v in case.path_parameters.items()}
        return case

    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    seen: list[tuple[str, int]] = []
    for result in schema.get_all_operations():
        operation = result.ok()
        cases = operation.as_strategy() | operation.as_strategy(generation_mode=GenerationMode.NEGATIVE)

        @given(case=cases)
        @settings(max_examples=max_examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        def conforms(case: schemathesis.Case) -> None:
            response = pin(case).call_and_validate(headers=headers, checks=CONFORMANCE)
            seen.append((case.path, response.status_code))

        conforms()
        modes = [GenerationMode.POSITIVE, GenerationMode.NEGATIVE]
        for case in schema.iter_coverage_cases(operation, generation_modes=modes,
                                               generation_config=schema.config.generation_for(operation=operation)):
            response = pin(case).call_and_validate(headers=headers, checks=CONFORMANCE)
            seen.append((case.path, response.status_code))
    return seen


def conforming(url: str, method: str, path: str, **case: Any) -> Any:
    """One hand-made request (``body``, ``headers``, ``media_type``, ``path_parameters``), answered as the
    schema says (a 5xx too, if documented: a gateway's 502); returns the response."""
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    operation = schema[path][method]
    return operation.Case(**case).call_and_validate(checks=[c for c in CONFORMANCE if c is not not_a_server_error])
