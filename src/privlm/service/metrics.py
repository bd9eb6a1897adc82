"""Prometheus metrics of one service: requests by route and status, and latency by route."""

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


class RequestMetricsMiddleware:
    def __init__(self, app: ASGIApp, *, metrics: ServiceMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started, status = time.perf_counter(), 500

        async def send_and_record(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_record)
        finally:
            route = scope.get("route")  # set by the router once a route matched
            endpoint = getattr(route, "path", "unmatched")
            self.metrics.requests.labels(endpoint, str(status)).inc()
            self.metrics.latency.labels(endpoint).observe(time.perf_counter() - started)
