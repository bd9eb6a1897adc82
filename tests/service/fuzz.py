"""Fuzz a running service's OpenAPI schema with schemathesis (bounded examples): never a 5xx."""

from __future__ import annotations

import schemathesis
from hypothesis import HealthCheck, given, settings


def fuzz_openapi(url: str, *, headers: dict[str, str] | None = None, max_examples: int = 25
                 ) -> list[tuple[str, int]]:
    """Call every operation with generated cases; fail on any 5xx. Returns (path, status) of every call."""
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    seen: list[tuple[str, int]] = []
    for result in schema.get_all_operations():
        operation = result.ok()

        @given(case=operation.as_strategy())
        @settings(max_examples=max_examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        def no_server_error(case: schemathesis.Case) -> None:
            response = case.call(headers=headers)
            seen.append((case.path, response.status_code))
            assert response.status_code < 500, (case.method, case.path, response.status_code, response.text[:300])

        no_server_error()
    return seen
