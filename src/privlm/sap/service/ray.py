"""The SAP vendor as a Ray Serve deployment: the same app on several replicas over one shared session store.

Each replica runs :func:`privlm.sap.service.server.create_vendor_app` with ``shared_store=True``: every step is
checkpointed to the store (a folder every replica can read: a shared volume across machines), and a replica
serves a session only while the store's latest checkpoint is the one it wrote or read, else it reloads it. So
a replica that restarts, or a request that lands on another replica, loses no session: at worst the step in
flight is replayed (the client rewinds, see :mod:`privlm.sap.service.client`). The client names its session in
the ``serve_multiplexed_model_id`` header, and Ray's model multiplexing keeps a session's requests on the
replica that holds it, so replays stay rare.

    privlm sap vendor --ray --replicas 2 --store /shared/sap-sessions
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

try:
    from ray import serve
except ImportError as error:  # pragma: no cover - exercised only without the extra
    raise ImportError("the Ray Serve deployment needs Ray: pip install 'privlm[ray]'") from error

import torch
from fastapi import FastAPI

from privlm._validation import check_positive_finite, check_positive_int
from privlm.sap.messages import MAX_ABS_VALUE
from privlm.service import ServiceOptions
from privlm.service.auth import load_keys
from privlm.service.ray import keep_replica_ports_on_loopback, replica_resources

MAX_ONGOING_REQUESTS = 64


class SapVendorServer:
    """One replica of ``privlm sap vendor``, over the shared ``store``."""

    def __init__(self, model: str = "minilm", *, store: str, splits: Sequence[int] = (0,),
                 api_keys: Sequence[str] = (), api_key_file: str | None = None, api_keys_env: str | None = None,
                 max_sessions: int = 16, max_abs_value: float = MAX_ABS_VALUE, device: str | torch.device = "auto",
                 service: ServiceOptions | None = None) -> None:
        """``device``: :func:`sap_vendor_application` passes the one it resolved."""
        from privlm.sap.service.server import create_vendor_app
        from privlm.sap.service.sessions import SessionLimits

        keys = load_keys(api_keys, key_file=api_key_file, env_var=api_keys_env, option="api_keys")
        keep_replica_ports_on_loopback()
        self._app = create_vendor_app(model, store=store, splits=tuple(splits), api_keys=keys, shared_store=True,
                                      limits=SessionLimits(max_sessions=max_sessions, max_abs_value=max_abs_value),
                                      device=device, on_session=self.hold_session, **(service or {}))

    @serve.multiplexed(max_num_models_per_replica=64)
    async def hold_session(self, session_id: str) -> str:
        """Tells Ray this replica holds ``session_id`` (the session itself is loaded, and checked fresh, per
        request)."""
        return session_id

    def __serve_build_asgi_app__(self) -> FastAPI:
        return self._app


SapVendorDeployment = serve.deployment(max_ongoing_requests=MAX_ONGOING_REQUESTS, health_check_period_s=10)(
    serve.ingress()(SapVendorServer))


def sap_vendor_application(model: str = "minilm", *, store: str, replicas: int = 1, replica_cpus: float = 1.0,
                           splits: Sequence[int] = (0,), api_keys: Sequence[str] = (),
                           api_key_file: str | None = None, api_keys_env: str | None = None, max_sessions: int = 16,
                           max_abs_value: float = MAX_ABS_VALUE, device: str | torch.device = "auto",
                           service: ServiceOptions | None = None) -> Any:
    """A Ray Serve application of ``replicas`` vendor replicas over the shared ``store``, ready for ``serve.run``.
    ``device`` is resolved here ("auto": CUDA when this machine has it), and a CUDA one reserves a GPU per
    replica."""
    replicas = check_positive_int("replicas", replicas)
    replica_cpus = check_positive_finite("replica_cpus", replica_cpus)
    max_abs_value = check_positive_finite("max_abs_value", max_abs_value)  # refused here, not in every replica
    resources, resolved = replica_resources(replica_cpus, device)
    deployment = SapVendorDeployment.options(num_replicas=replicas, ray_actor_options=resources)
    return deployment.bind(model, store=store, splits=list(splits), api_keys=tuple(api_keys),
                           api_key_file=api_key_file, api_keys_env=api_keys_env, max_sessions=max_sessions,
                           max_abs_value=max_abs_value, device=resolved, service=dict(service or {}))
