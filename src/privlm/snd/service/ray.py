"""The SnD server as a Ray Serve deployment: the same FastAPI app, replicated and load-balanced by Ray.

Each replica loads the model once and runs ``create_app`` unchanged, so its micro-batcher, limits,
API keys and metrics are exactly those of ``privlm serve``; Ray's HTTP proxy spreads requests over
the replicas, on one machine or across a cluster. Every way in carries the same settings,
:class:`~privlm.settings.snd.SndServeSettings`:

    privlm serve --ray --replicas 2                          # local single-node Ray, blocking
    serve run privlm.snd.service.ray:app_builder model=minilm replicas=4   # Ray's own CLI / YAML
    serve.run(snd_application(SndServeSettings(replicas=4)))  # from Python

Keys need not sit in the application's arguments (which Ray stores): each replica also reads a key file
(``api_key_file``) and an environment variable (``api_keys_env``) on its own node.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

try:
    from ray import serve
except ImportError as error:  # pragma: no cover - exercised only without the extra
    raise ImportError("the Ray Serve deployment needs Ray: pip install 'privlm[ray]'") from error

from fastapi import FastAPI

from privlm.models import SplitModel
from privlm.service.auth import load_keys, parse_keys
from privlm.service.ray import keep_replica_ports_on_loopback, replica_resources, run_blocking
from privlm.settings.options import from_mapping, read_config
from privlm.settings.snd import SndServeSettings
from privlm.snd.service.server import served_app

__all__ = ["SnDDeployment", "SnDServer", "app_builder", "run_blocking", "snd_application"]

# Concurrent requests one replica accepts; high enough that its micro-batcher can fill batches.
MAX_ONGOING_REQUESTS = 256


class SnDServer:
    """One replica of ``privlm serve``, built from ``settings`` here, on the replica's node: the accepted keys
    (``api_keys`` with those of ``api_key_file`` and of the variable ``api_keys_env``, read here:
    :func:`privlm.service.auth.load_keys`, an empty source is an error) and the model."""

    def __init__(self, settings: SndServeSettings) -> None:
        keys = load_keys(settings.api_keys, key_file=settings.api_key_file, env_var=settings.api_keys_env,
                         option="api_keys")
        keep_replica_ports_on_loopback()
        split_model = SplitModel.from_pretrained(settings.model, device=settings.device)
        self._app = served_app(split_model, settings, keys)

    def __serve_build_asgi_app__(self) -> FastAPI:
        return self._app


# Applied as calls, not decorators, so that type checkers see what Ray returns (a Deployment).
SnDDeployment = serve.deployment(max_ongoing_requests=MAX_ONGOING_REQUESTS, health_check_period_s=10)(
    serve.ingress()(SnDServer))


def snd_application(settings: SndServeSettings) -> serve.Application:
    """A Ray Serve application of ``settings.replicas`` SnD server replicas, ready for ``serve.run``.
    ``settings.api_keys`` travel to the replicas through Ray (which stores them with the application); the key
    file (a path on every node) and the variable are read by each replica. The device is resolved here
    (:func:`privlm.service.ray.replica_resources`): every replica gets the same one."""
    resources, resolved = replica_resources(settings.replica_cpus, settings.device)
    deployment = SnDDeployment.options(num_replicas=settings.replicas, ray_actor_options=resources)
    return deployment.bind(replace(settings, device=str(resolved)))


def app_builder(args: Mapping[str, Any]) -> serve.Application:
    """Entry point for Ray's CLI and config files: ``serve run privlm.snd.service.ray:app_builder k=v``, with the
    fields of :class:`~privlm.settings.snd.SndServeSettings` (``privlm snd serve``'s flags, by field name; Ray's
    ``k=v`` strings are read as the fields' types) and ``config``, a ``privlm snd serve --config`` file that the
    other args override. ``api_keys``: a list, or a string of keys joined by commas (given but empty: an error);
    stored by Ray with the config. The key file and the variable (``api_keys_env``, ``PRIVLM_API_KEYS`` by
    default) are read by each replica on its node."""
    values = dict(args)
    values = {**(read_config(values.pop("config")) if "config" in values else {}), **values}
    if isinstance(keys := values.get("api_keys"), str):
        values["api_keys"] = parse_keys(keys, "api_keys (Ray config)")
    return snd_application(from_mapping(SndServeSettings, values))
