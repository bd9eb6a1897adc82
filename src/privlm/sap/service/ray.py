"""The SAP vendor as a Ray Serve deployment: the same app on several replicas over one shared session store.

Each replica is built from the same :class:`~privlm.settings.sap.SapVendorSettings` (plain values, pickled by Ray):
it loads the model (:meth:`privlm.sap.model.VendorModel.load`) and runs
:func:`privlm.sap.service.server.create_vendor_app` with ``shared_store=True``: every step is
checkpointed to the store (a folder every replica can read: a shared volume across machines), and a replica
serves a session only while the store's latest checkpoint is the one it wrote or read, else it reloads it. So
a replica that restarts, or a request that lands on another replica, loses no session: at worst the step in
flight is replayed (the client rewinds, see :mod:`privlm.sap.service.client`). The client names its session in
the ``serve_multiplexed_model_id`` header, and Ray's model multiplexing keeps a session's requests on the
replica that holds it, so replays stay rare.

    privlm sap vendor --ray --replicas 2 --store /shared/sap-sessions
"""

from __future__ import annotations

from dataclasses import replace

try:
    from ray import serve
except ImportError as error:  # pragma: no cover - exercised only without the extra
    raise ImportError("the Ray Serve deployment needs Ray: pip install 'privlm[ray]'") from error

from fastapi import FastAPI

from privlm.service.auth import load_keys
from privlm.service.ray import keep_replica_ports_on_loopback, replica_resources
from privlm.settings.sap import SapVendorSettings

MAX_ONGOING_REQUESTS = 64


class SapVendorServer:
    """One replica of ``privlm sap vendor``, built from ``settings`` here, on the replica's node: it loads the model
    (:meth:`~privlm.sap.model.VendorModel.load`), reads the keys (``api_keys``, the key file and the variable
    ``api_keys_env``: :func:`~privlm.service.auth.load_keys`) and serves the store shared with the other replicas."""

    def __init__(self, settings: SapVendorSettings) -> None:
        from privlm.sap.model import VendorModel
        from privlm.sap.service.server import vendor_app

        keys = load_keys(settings.api_keys, key_file=settings.api_key_file, env_var=settings.api_keys_env,
                         option="api_keys")
        keep_replica_ports_on_loopback()
        model = VendorModel.load(settings.model, splits=settings.splits, device=settings.device)
        self._app = vendor_app(model, settings, keys, shared_store=True, on_session=self.hold_session)

    @serve.multiplexed(max_num_models_per_replica=64)
    async def hold_session(self, session_id: str) -> str:
        """Tells Ray this replica holds ``session_id`` (the session itself is loaded, and checked fresh, per
        request)."""
        return session_id

    def __serve_build_asgi_app__(self) -> FastAPI:
        return self._app


SapVendorDeployment = serve.deployment(max_ongoing_requests=MAX_ONGOING_REQUESTS, health_check_period_s=10)(
    serve.ingress()(SapVendorServer))


def sap_vendor_application(settings: SapVendorSettings) -> serve.Application:
    """A Ray Serve application of ``settings.replicas`` vendor replicas over the shared ``settings.store``, ready for
    ``serve.run``; each replica loads the model itself. The device is resolved here ("auto": CUDA when this machine
    has it), and a CUDA one reserves a GPU per replica. ``settings.api_keys`` are stored by Ray with the
    application; the key file and the variable are read by each replica, on its node. The settings checked their
    values when made, so no replica refuses them."""
    resources, resolved = replica_resources(settings.replica_cpus, settings.device)
    deployment = SapVendorDeployment.options(num_replicas=settings.replicas, ray_actor_options=resources)
    return deployment.bind(replace(settings, device=str(resolved)))
