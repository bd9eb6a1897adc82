"""The gateway as a Ray Serve deployment: the same app, replicated, every replica charging one shared ledger.

Each replica builds its own gateway from the same :class:`~privlm.settings.gateway.GatewaySettings` (plain
values, pickled by Ray): its own device model (loaded once, when the replica starts), upstream client and
ledger connection. The budget holds across replicas because the check-and-spend is one transaction in the
ledger they share: a SQLite file serialises the writers of one machine; a multi-node cluster needs a
database server every node reaches (``--chat-ledger postgresql://...``). Three ways in:

    privlm gateway --ray --replicas 2 --chat-upstream ... --epsilon 6 --chat-budget 100
    serve run deploy/gateway-ray.yaml                       # Ray's own CLI: app_builder below
    serve.run(gateway_application(for_replicas(settings)))

Every answer carries ``x-privlm-replica``: Ray's id of the replica that served it (which process charged the
ledger, for operators; no key, no text, no address).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

try:
    from ray import serve
    from ray.serve.exceptions import RayServeException
except ImportError as error:  # pragma: no cover - exercised only without the extra
    raise ImportError("the Ray Serve deployment needs Ray: pip install 'privlm[ray]'") from error

from fastapi import FastAPI
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from privlm.gateway.setup import build, build_setups, for_replicas
from privlm.service.ray import keep_replica_ports_on_loopback, replica_resources, run_blocking
from privlm.settings.gateway import GatewaySettings
from privlm.settings.options import from_mapping, read_config

__all__ = ["REPLICA_HEADER", "GatewayDeployment", "GatewayServer", "app_builder", "gateway_application",
           "run_blocking"]

# Concurrent requests one replica accepts: each waits on the device model's queue or on the upstream.
MAX_ONGOING_REQUESTS = 256
REPLICA_HEADER = "x-privlm-replica"


class GatewayServer:
    """One replica of ``privlm gateway``, built from ``settings`` here, on the replica's node (keys, key files
    and the upstream's key variable are read here too)."""

    def __init__(self, settings: GatewaySettings) -> None:
        keep_replica_ports_on_loopback()
        self._app = build(settings, build_setups(settings))
        self._app.add_middleware(_NameTheReplica, replica=_replica_id())

    def __serve_build_asgi_app__(self) -> FastAPI:
        return self._app


class _NameTheReplica:
    """Adds :data:`REPLICA_HEADER` to every answer (plain ASGI: a stream passes through untouched)."""

    def __init__(self, app: ASGIApp, *, replica: str) -> None:
        self.app, self.header = app, (REPLICA_HEADER.encode(), replica.encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_named(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        await self.app(scope, receive, send_named)


def _replica_id() -> str:
    try:
        return str(serve.get_replica_context().replica_id.unique_id)
    except RayServeException:  # outside a replica (one built in process, as a test does): no replica context
        return "local"


# Applied as calls, not decorators, so that type checkers see what Ray returns (a Deployment).
GatewayDeployment = serve.deployment(max_ongoing_requests=MAX_ONGOING_REQUESTS, health_check_period_s=10)(
    serve.ingress()(GatewayServer))


def gateway_application(settings: GatewaySettings) -> serve.Application:
    """A Ray Serve application of ``settings.replicas`` gateway replicas, ready for ``serve.run``. ``settings``
    should be :func:`~privlm.gateway.setup.for_replicas`' (resolved once, here, for all); they are made so if not.
    The device is resolved here (:func:`privlm.service.ray.replica_resources`): every replica gets the same one."""
    resources, resolved = replica_resources(settings.replica_cpus, settings.device)
    shared = replace(settings if settings.replicated else for_replicas(settings), device=str(resolved))
    return GatewayDeployment.options(num_replicas=settings.replicas, ray_actor_options=resources).bind(shared)


def app_builder(args: Mapping[str, Any]) -> serve.Application:
    """Entry point for Ray's CLI and config files: ``serve run privlm.gateway.ray:app_builder`` with ``args``: the
    fields of :class:`~privlm.settings.gateway.GatewaySettings` (``chat`` and ``embeddings``: mappings of
    :class:`~privlm.settings.chat.ChatSettings`' and ``EmbeddingsSettings``' fields), as in ``privlm gateway
    --config``. Keys need not sit there (Ray stores the config): ``api_key_file`` and ``api_keys_env`` are read by
    each replica. ``config``: a ``privlm gateway --config`` file (read here) whose settings the other args
    override, so that one file serves both."""
    rest = dict(args)
    values = read_config(rest.pop("config")) if "config" in rest else {}
    for name, value in rest.items():
        values[name] = {**(values.get(name) or {}), **value} if isinstance(value, Mapping) else value
    return gateway_application(for_replicas(from_mapping(GatewaySettings, values)))
