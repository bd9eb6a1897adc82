"""The one app factory every privlm service is built on.

It gives a FastAPI app:
  - Bearer keys (:class:`BearerKeys`) on every route of the system's routers, and on ``/metrics``;
  - the request-body limit, enforced while the body is read (:mod:`privlm.service.limits`);
  - one error model in OpenAI's shape for every error: the service's own (:class:`ServiceError`),
    malformed tensors (``WireError``), exhausted privacy budgets (429), invalid JSON (400), unknown
    routes, and anything unexpected (a 500 that names no internals);
  - ``GET /health`` (open, for load balancers) and ``GET /metrics`` (Prometheus text);
  - on a service without keys, answers only for loopback ``Host`` names, against DNS rebinding
    (:mod:`privlm.service.hosts`; ``allowed_hosts`` adds others);
  - ``GET /openapi.json``; the Swagger UI (``/docs``) and ReDoc (``/redoc``) pages, which load their
    scripts from a CDN, only with ``docs=True``.

``body_timeout`` and ``max_in_flight`` bound slow and concurrent bodies (:mod:`privlm.service.limits`);
:func:`privlm.service.run_service` adds the transport's limits (header timeout, open connections).
A system's factory takes the same options as ``**options: Unpack[ServiceOptions]`` and passes them on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Unpack

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from privlm.accounting import BudgetExhaustedError, DatabaseUnavailableError
from privlm.service.auth import BearerKeys
from privlm.service.errors import ERROR_RESPONSES, ServiceError, error_response, ledger_unavailable
from privlm.service.hosts import ANY_HOST, HostCheckMiddleware
from privlm.service.limits import BODY_TIMEOUT, MAX_IN_FLIGHT, BodyLimitMiddleware, Lane, RefusalAnswer
from privlm.service.metrics import RequestMetricsMiddleware, ServiceMetrics
from privlm.settings.service import ServiceOptions
from privlm.validation import check_positive_finite, check_positive_int
from privlm.wire import WireError

logger = logging.getLogger("privlm.service")

Lifespan = Callable[[FastAPI], Any]


class AppOptions(ServiceOptions, total=False):
    """What :func:`create_service_app` takes besides the system's parts: the :class:`ServiceOptions` a system's
    factory passes on, and what the system sets for its own paths: ``refusal_answers`` (a path's own answer to the
    limits' refusals) and ``lanes`` (a path's own in-flight places), see :mod:`privlm.service.limits`."""

    refusal_answers: Mapping[str, RefusalAnswer] | None
    lanes: Mapping[str, Lane] | None


def create_service_app(*, title: str, routers: Sequence[APIRouter], auth: BearerKeys, max_request_bytes: int,
                       health: Callable[[], Mapping[str, object]] = dict, lifespan: Lifespan | None = None,
                       version: str = "1", **options: Unpack[AppOptions]) -> FastAPI:
    """A service with the system's ``routers`` behind ``auth``; ``health`` adds facts to ``/health``.

    ``options`` (:class:`AppOptions`): ``docs`` serves ``/docs`` and ``/redoc``. ``allowed_hosts``: ``Host`` names
    answered besides loopback ones (``"*"``: any); by default none on an open service, any on one with keys.
    ``max_in_flight``, ``max_in_flight_per_caller``, ``body_timeout``, ``refusal_answers`` and ``lanes``: see
    :mod:`privlm.service.limits`.
    """
    if unknown := set(options) - AppOptions.__optional_keys__:  # as a misspelt keyword always was
        raise TypeError(f"create_service_app() got unexpected keyword arguments {sorted(unknown)}")
    max_in_flight = check_positive_int("max_in_flight", options.get("max_in_flight", MAX_IN_FLIGHT))
    body_timeout = check_positive_finite("body_timeout", options.get("body_timeout", BODY_TIMEOUT))
    docs, refusal_answers = options.get("docs", False), options.get("refusal_answers")
    app = FastAPI(title=title, version=version, lifespan=lifespan, responses=ERROR_RESPONSES,
                  docs_url="/docs" if docs else None, redoc_url="/redoc" if docs else None)
    metrics = ServiceMetrics()
    app.state.metrics = metrics
    app.state.refusal_answers = dict(refusal_answers or {})  # the connection cap reads them too (serving.py)
    _install_error_handlers(app)
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_request_bytes, auth=auth, body_timeout=body_timeout,
                       max_in_flight=max_in_flight, max_in_flight_per_caller=options.get("max_in_flight_per_caller"),
                       refusal_answers=refusal_answers, lanes=options.get("lanes"))
    allowed_hosts = options.get("allowed_hosts")
    hosts = list(allowed_hosts) if allowed_hosts is not None else [] if auth.open else [ANY_HOST]
    app.add_middleware(HostCheckMiddleware, allowed_hosts=hosts)  # before any body is read or key checked
    app.add_middleware(RequestMetricsMiddleware, metrics=metrics)  # outermost: it also counts refusals

    @app.get("/health", tags=["service"])
    async def health_check() -> dict[str, object]:
        return {"status": "ok", **health()}

    @app.get("/metrics", tags=["service"], dependencies=[Depends(auth.dependency)], response_class=Response)
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    for router in routers:
        app.include_router(router, dependencies=[Depends(auth.dependency)])
    return app


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def field_path(loc: Sequence[object]) -> str:
    """``input.1`` from pydantic's location: names and indices, without the tags of union branches it tried
    (``constrained-str``, ``list[str]``)."""
    return ".".join(str(part) for part in loc if isinstance(part, int)
                    or (str(part).isidentifier() and str(part) not in _TYPE_TAGS))


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ServiceError)
    async def service_error(_: Request, error: ServiceError) -> JSONResponse:
        return error.response()

    @app.exception_handler(WireError)
    async def wire_error(_: Request, error: WireError) -> JSONResponse:
        default = "limit_exceeded" if error.status == 413 else "invalid_payload"
        return error_response(error.status, str(error), param=error.limit, code=error.code or default)

    @app.exception_handler(BudgetExhaustedError)
    async def budget_exhausted(_: Request, error: BudgetExhaustedError) -> JSONResponse:
        # x-should-retry: false tells OpenAI's SDKs (and privlm's RetryPolicy) that waiting will not help.
        headers = {"x-privlm-budget-remaining": f"{error.remaining:.6g}", "x-should-retry": "false"}
        return error_response(429, str(error), type="insufficient_quota", param=f"{error.unit} budget",
                              code="budget_exhausted", headers=headers)

    @app.exception_handler(DatabaseUnavailableError)
    async def database_unavailable(_: Request, error: DatabaseUnavailableError) -> JSONResponse:
        # The database stays unnamed to callers; the log says which. Nothing was sent: a retry may succeed.
        logger.warning("%s", error)
        return ledger_unavailable().response()

    @app.exception_handler(RequestValidationError)
    async def invalid_json(_: Request, error: RequestValidationError) -> JSONResponse:
        problems = error.errors()
        # The field at fault, by name and index (a JSON syntax error has only a character offset: no field).
        fields = field_path(problems[0].get("loc", ())[1:]) if problems else ""
        param = fields if problems and problems[0].get("type") != "json_invalid" else None
        summary = "; ".join(f"{field_path(e.get('loc', ()))}: {e.get('msg', '')}" for e in problems[:3])
        return error_response(400, f"invalid request: {summary}", param=param or None, code="invalid_request")

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, error: HTTPException) -> JSONResponse:
        return error_response(error.status_code, str(error.detail),  # headers: a 405's Allow, say
                              type="not_found_error" if error.status_code == 404 else "invalid_request_error",
                              headers=dict(error.headers) if error.headers else None)

    @app.exception_handler(Exception)
    async def unexpected(_: Request, error: Exception) -> JSONResponse:
        return error_response(500, f"internal error ({type(error).__name__})", type="server_error")
