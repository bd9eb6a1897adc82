"""Running any privlm app on Ray Serve, in the foreground (``privlm serve --ray``)."""

from __future__ import annotations

import ipaddress
import os
import signal
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from privlm.models.device import resolve_device

try:
    import ray
    from ray import serve
except ImportError as error:  # pragma: no cover - exercised only without the extra
    raise ImportError("the Ray Serve deployment needs Ray: pip install 'privlm[ray]'") from error

# Ray's own switch (meant for Windows and macOS): with it off, Ray keeps a node's address on loopback
# instead of replacing 127.0.0.1 by the machine's address, and every Ray process binds there.
_CLUSTER_SWITCH = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
LOOPBACK = "127.0.0.1"


def replica_resources(replica_cpus: float, device: str | torch.device = "auto"
                      ) -> tuple[dict[str, float], torch.device]:
    """Ray's actor options for one replica (a GPU when it runs on CUDA) and the device it runs on, resolved where
    the application is built (``auto``: CUDA when this node has it), so that every replica gets the same one."""
    resolved = resolve_device(device)
    return {"num_cpus": replica_cpus, **({"num_gpus": 1} if resolved.type == "cuda" else {})}, resolved


def run_blocking(application: serve.Application, *, host: str, port: int, name: str,
                 address: str | None = None) -> None:
    """Join (``address``) or start a Ray cluster, serve on ``host:port`` until SIGINT/SIGTERM, then clean up.

    A cluster started here has this one node, and nothing but the HTTP proxy has to be reached from
    elsewhere: its own ports (GCS, raylet, object manager, agents, workers) listen on 127.0.0.1 only,
    whatever ``host`` is. A cluster that is joined keeps the addresses it was started with.
    """
    def stop(signum: int, _: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    started_here = address is None or address == "local"
    with _ray_on_loopback(started_here):
        ray.init(address=address, include_dashboard=False, logging_level="warning", log_to_driver=False,
                 **({"object_store_memory": 256 * 2**20, "_node_ip_address": LOOPBACK} if started_here else {}))
        try:
            if started_here:
                _warn_unless_loopback(ray.util.get_node_ip_address())
            serve.start(http_options={"host": host, "port": port})
            serve.run(application, name=name, route_prefix="/", blocking=False)
            signal.pause()
        finally:
            serve.shutdown()
            ray.shutdown()


@contextmanager
def _ray_on_loopback(active: bool) -> Iterator[None]:
    """Turn Ray's cluster switch off while a single-node cluster is started and runs (then restore it).

    Ray reads the switch when it is imported, so it is set on Ray's constants as well as in the
    environment, which the processes that ``ray.init`` starts inherit.
    """
    if not active:
        yield
        return
    try:
        import ray._private.ray_constants as constants
    except ImportError:  # pragma: no cover - a Ray without the module: the check after ray.init warns
        constants = None
    before_env, before_constant = os.environ.get(_CLUSTER_SWITCH), getattr(constants, "ENABLE_RAY_CLUSTER", None)
    os.environ[_CLUSTER_SWITCH] = "0"
    if before_constant is not None:
        constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        if before_env is None:
            os.environ.pop(_CLUSTER_SWITCH, None)
        else:
            os.environ[_CLUSTER_SWITCH] = before_env
        if before_constant is not None:
            constants.ENABLE_RAY_CLUSTER = before_constant


def keep_replica_ports_on_loopback() -> None:
    """In a Ray Serve replica on a loopback node (a cluster started by :func:`run_blocking`), bind the
    replica's inter-deployment gRPC server to 127.0.0.1: Ray Serve binds it to ``[::]:0``, every interface,
    whatever the node's address. Call it from the deployment's constructor (Ray starts that server after);
    elsewhere it does nothing, and so does a Ray that no longer has the hook.
    """
    global _REPLICA_PATCHED
    if _REPLICA_PATCHED or not ray.is_initialized() or not _is_loopback(ray.util.get_node_ip_address()):
        return
    try:
        from ray.serve._private import replica
    except ImportError:  # pragma: no cover - another Ray layout
        return
    original = getattr(replica, "add_port_to_grpc_server", None)
    if original is None:  # pragma: no cover - another Ray layout
        return

    def add_port(server: object, address: str) -> int:
        host, _, port = address.rpartition(":")
        return int(original(server, f"{LOOPBACK}:{port}" if host in ("[::]", "0.0.0.0", "") else address))

    replica.add_port_to_grpc_server = add_port
    _REPLICA_PATCHED = True


_REPLICA_PATCHED = False


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return address == "localhost"


def _warn_unless_loopback(node_address: str) -> None:
    if not _is_loopback(node_address):
        warnings.warn(f"Ray's node address is {node_address}, not loopback: its internal ports listen on it; "
                      "firewall them (docs/snd.md, Ray Serve)", RuntimeWarning, stacklevel=3)
