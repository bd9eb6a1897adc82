"""The SnD server as a Ray Serve deployment: the same FastAPI app, replicated and load-balanced by Ray.

Each replica loads the model once and runs ``create_app`` unchanged, so its micro-batcher, limits,
API keys and metrics are exactly those of ``privlm serve``; Ray's HTTP proxy spreads requests over
the replicas, on one machine or across a cluster. Three ways in:

    privlm serve --ray --replicas 2                          # local single-node Ray, blocking
    serve run privlm.snd.service.ray:app_builder model=minilm replicas=4   # Ray's own CLI / YAML
    serve.run(snd_application(model="minilm", replicas=4))   # from Python
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

try:
    from ray import serve
except ImportError as error:  # pragma: no cover - exercised only without the extra
    raise ImportError("the Ray Serve deployment needs Ray: pip install 'privlm[ray]'") from error

from fastapi import FastAPI

from privlm._validation import check_positive_finite, check_positive_int
from privlm.service.ray import run_blocking

__all__ = ["SnDDeployment", "SnDServer", "app_builder", "run_blocking", "snd_application"]

# Concurrent requests one replica accepts; high enough that its micro-batcher can fill batches.
MAX_ONGOING_REQUESTS = 256


class SnDServer:
    """One replica of ``privlm serve``. Arguments as for :func:`privlm.snd.service.server.create_app`."""

    def __init__(self, model: str = "minilm", *, denoiser_dirs: Sequence[str] | None = None,
                 api_keys: Sequence[str] = (), max_batch_rows: int = 64, max_wait_ms: float = 5.0,
                 device: str = "cpu") -> None:
        from privlm.models import SplitModel
        from privlm.snd.service.server import create_app

        split_model = SplitModel.from_pretrained(model, device=device)
        dirs = [Path(d) for d in denoiser_dirs] if denoiser_dirs else None
        self._app = create_app(split_model, denoiser_dirs=dirs, api_keys=api_keys,
                               max_batch_rows=max_batch_rows, max_wait_ms=max_wait_ms)

    def __serve_build_asgi_app__(self) -> FastAPI:
        return self._app


# Applied as calls, not decorators, so that type checkers see what Ray returns (a Deployment).
SnDDeployment = serve.deployment(max_ongoing_requests=MAX_ONGOING_REQUESTS, health_check_period_s=10)(
    serve.ingress()(SnDServer))


def snd_application(model: str = "minilm", *, replicas: int = 1, replica_cpus: float = 1.0,
                    denoiser_dirs: Sequence[str | Path] | None = None, api_keys: Sequence[str] = (),
                    max_batch_rows: int = 64, max_wait_ms: float = 5.0, device: str = "cpu") -> serve.Application:
    """A Ray Serve application of ``replicas`` SnD server replicas, ready for ``serve.run``."""
    replicas = check_positive_int("replicas", replicas)
    replica_cpus = check_positive_finite("replica_cpus", replica_cpus)
    resources = {"num_cpus": replica_cpus, **({"num_gpus": 1} if device.startswith("cuda") else {})}
    deployment = SnDDeployment.options(num_replicas=replicas, ray_actor_options=resources)
    return deployment.bind(model, denoiser_dirs=[str(d) for d in denoiser_dirs] if denoiser_dirs else None,
                           api_keys=tuple(api_keys), max_batch_rows=max_batch_rows, max_wait_ms=max_wait_ms,
                           device=device)


def app_builder(args: dict[str, Any]) -> serve.Application:
    """Entry point for Ray's CLI and config files: ``serve run privlm.snd.service.ray:app_builder k=v``."""
    keys = str(args.get("api_keys", "")).split(",")
    dirs = str(args.get("denoiser_dirs", "")).split(",")
    return snd_application(str(args.get("model", "minilm")), replicas=int(args.get("replicas", 1)),
                           replica_cpus=float(args.get("replica_cpus", 1.0)),
                           denoiser_dirs=[d for d in dirs if d] or None, api_keys=[k for k in keys if k],
                           max_batch_rows=int(args.get("max_batch_rows", 64)),
                           max_wait_ms=float(args.get("max_wait_ms", 5.0)), device=str(args.get("device", "cpu")))
