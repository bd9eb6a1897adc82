"""Running any privlm app on Ray Serve, in the foreground (``privlm serve --ray``)."""

from __future__ import annotations

import signal

try:
    import ray
    from ray import serve
except ImportError as error:  # pragma: no cover - exercised only without the extra
    raise ImportError("the Ray Serve deployment needs Ray: pip install 'privlm[ray]'") from error


def run_blocking(application: serve.Application, *, host: str, port: int, name: str,
                 address: str | None = None) -> None:
    """Join (``address``) or start a Ray cluster, serve on ``host:port`` until SIGINT/SIGTERM, then clean up."""
    def stop(signum: int, _: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    ray.init(address=address, include_dashboard=False, logging_level="warning", log_to_driver=False,
             **({} if address else {"object_store_memory": 256 * 2**20}))
    try:
        serve.start(http_options={"host": host, "port": port})
        serve.run(application, name=name, route_prefix="/", blocking=False)
        signal.pause()
    finally:
        serve.shutdown()
        ray.shutdown()
