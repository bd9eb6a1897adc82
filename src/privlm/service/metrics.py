"""Prometheus metrics of one service: requests by route and status, and latency by route.

A request whose client went away before any answer is counted with status 499 (nginx's "client
closed request"), not as a server error.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram
from starlette.types import ASGIApp, Message, Receive, Scope, Send


class ServiceMetrics:
    """One registry per app, so that several apps in one process (tests, Ray replicas) keep apart."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("privlm_requests", "Requests by endpoint and status", ["endpoint", "status"],
                                registry=self.registry)
        self.latency = Histogram("privlm_request_seconds", "Request latency", ["endpoint"], registry=self.registry)


CLIENT_CLOSED = 499


class RequestMetricsMiddleware:
    def __init__(self, app: ASGIApp, *, metrics: ServiceMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started, status, answered = time.perf_counter(), 500, False

        async def send_and_record(message: Message) -> None:
            nonlocal status, answered
            if message["type"] == "http.response.start":
                status, answered = message["status"], True
            await send(message)

        try:
            await self.app(scope, receive, send_and_record)
            if not answered:  # the app gave up on the request: its client went away
                status = CLIENT_CLOSED
        finally:
            route = scope.get("route")  # set by the router once a route matched
            endpoint = getattr(route, "path", "unmatched")
            self.metrics.requests.labels(endpoint, str(status)).inc()
            self.metrics.latency.labels(endpoint).observe(time.perf_counter() - started)
