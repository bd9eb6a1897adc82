"""The SnD server as a Ray Serve deployment: the same FastAPI app, replicated and load-balanced by Ray.

Each replica loads the model once and runs ``create_app`` unchanged, so its micro-batcher, limits,
API keys and metrics are exactly those of ``privlm serve``; Ray's HTTP proxy spreads requests over
the replicas, on one machine or across a cluster. Three ways in:

    privlm serve --ray --replicas 2                          # local single-node Ray, blocking
    serve run privlm.snd.service.ray:app_builder model=minilm replicas=4   # Ray's own CLI / YAML
    serve.run(snd_application(model="minilm", replicas=4))   # from Python

Keys need not sit in the application's arguments (which Ray stores): each replica also reads a key file
(``api_key_file``) and an environment variable (``api_keys_env``) on its own node.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

try:
    from ray import serve
except ImportError as error:  # pragma: no cover - exercised only without the extra
    raise ImportError("the Ray Serve deployment needs Ray: pip install 'privlm[ray]'") from error

import torch
from fastapi import FastAPI

from privlm._validation import check_positive_finite, check_positive_int
from privlm.service import ServiceOptions
from privlm.service.auth import API_KEYS_ENV, load_keys, parse_keys
from privlm.service.ray import keep_replica_ports_on_loopback, replica_resources, run_blocking

__all__ = ["SnDDeployment", "SnDServer", "app_builder", "run_blocking", "snd_application"]

# Concurrent requests one replica accepts; high enough that its micro-batcher can fill batches.
MAX_ONGOING_REQUESTS = 256


class SnDServer:
    """One replica of ``privlm serve``. Arguments as for :func:`privlm.snd.service.server.create_app`; the
    accepted keys are ``api_keys`` with those of ``api_key_file`` and of the variable ``api_keys_env``, both
    read here, on the replica's node (:func:`privlm.service.auth.load_keys`: an empty source is an error)."""

    def __init__(self, model: str = "minilm", *, denoiser_dirs: Sequence[str] | None = None,
                 api_keys: Sequence[str] = (), api_key_file: str | None = None, api_keys_env: str | None = None,
                 max_batch_rows: int = 64, max_wait_ms: float = 5.0, device: str | torch.device = "auto",
                 service: ServiceOptions | None = None) -> None:
        from privlm.models import SplitModel
        from privlm.snd.service.server import create_app

        keys = load_keys(api_keys, key_file=api_key_file, env_var=api_keys_env, option="api_keys")
        keep_replica_ports_on_loopback()
        split_model = SplitModel.from_pretrained(model, device=device)
        dirs = [Path(d) for d in denoiser_dirs] if denoiser_dirs else None
        self._app = create_app(split_model, denoiser_dirs=dirs, api_keys=keys,
                               max_batch_rows=max_batch_rows, max_wait_ms=max_wait_ms, **(service or {}))

    def __serve_build_asgi_app__(self) -> FastAPI:
        return self._app


# Applied as calls, not decorators, so that type checkers see what Ray returns (a Deployment).
SnDDeployment = serve.deployment(max_ongoing_requests=MAX_ONGOING_REQUESTS, health_check_period_s=10)(
    serve.ingress()(SnDServer))


def snd_application(model: str = "minilm", *, replicas: int = 1, replica_cpus: float = 1.0,
                    denoiser_dirs: Sequence[str | Path] | None = None, api_keys: Sequence[str] = (),
                    api_key_file: str | Path | None = None, api_keys_env: str | None = None,
                    max_batch_rows: int = 64, max_wait_ms: float = 5.0, device: str | torch.device = "auto",
                    service: ServiceOptions | None = None) -> serve.Application:
    """A Ray Serve application of ``replicas`` SnD server replicas, ready for ``serve.run``; ``service``:
    the replicas' :class:`~privlm.service.ServiceOptions` (allowed hosts, docs, in-flight cap, body timeout).

    ``api_keys`` travel to the replicas through Ray (which stores them with the application);
    ``api_key_file`` (a path on every node) and ``api_keys_env`` (a variable's name) are read by each replica.
    ``device`` is resolved here (:func:`privlm.service.ray.replica_resources`): every replica gets the same one.
    """
    replicas = check_positive_int("replicas", replicas)
    resources, resolved = replica_resources(check_positive_finite("replica_cpus", replica_cpus), device)
    deployment = SnDDeployment.options(num_replicas=replicas, ray_actor_options=resources)
    return deployment.bind(model, denoiser_dirs=[str(d) for d in denoiser_dirs] if denoiser_dirs else None,
                           api_keys=tuple(api_keys), api_key_file=None if api_key_file is None else str(api_key_file),
                           api_keys_env=api_keys_env, max_batch_rows=max_batch_rows, max_wait_ms=max_wait_ms,
                           device=resolved, service=dict(service or {}))


def app_builder(args: dict[str, Any]) -> serve.Application:
    """Entry point for Ray's CLI and config files: ``serve run privlm.snd.service.ray:app_builder k=v``.

    Keys: ``api_keys`` (comma-separated, or a list; stored by Ray with the config), ``api_key_file`` (one
    key per line, read by each replica on its node) and the variable named by ``api_keys_env`` (default
    ``PRIVLM_API_KEYS``, read by each replica; null for none). Given but empty, any of them is an error.
    ``allowed_hosts`` (comma-separated, ``*`` for any): the ``Host`` names an open server answers besides
    loopback ones; ``max_in_flight``: requests with a body each replica reads or processes at once.
    """
    keys = args.get("api_keys")
    api_keys = () if keys is None else parse_keys(keys if isinstance(keys, str) else ",".join(map(str, keys)),
                                                  "api_keys (Ray config)")
    key_file, env = args.get("api_key_file"), args.get("api_keys_env", API_KEYS_ENV)
    dirs = str(args.get("denoiser_dirs", "")).split(",")
    service = ServiceOptions()
    if "allowed_hosts" in args:
        service["allowed_hosts"] = [h.strip() for h in str(args["allowed_hosts"]).split(",") if h.strip()]
    if "max_in_flight" in args:
        service["max_in_flight"] = int(args["max_in_flight"])
    return snd_application(str(args.get("model", "minilm")), replicas=int(args.get("replicas", 1)),
                           replica_cpus=float(args.get("replica_cpus", 1.0)),
                           denoiser_dirs=[d for d in dirs if d] or None, api_keys=api_keys,
                           api_key_file=None if key_file is None else str(key_file),
                           api_keys_env=str(env) if env else None,
                           max_batch_rows=int(args.get("max_batch_rows", 64)),
                           max_wait_ms=float(args.get("max_wait_ms", 5.0)), device=str(args.get("device", "auto")),
                           service=service)
