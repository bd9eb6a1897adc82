"""Running ``privlm serve`` / ``privlm gateway`` as background processes on localhost (demo, benchmarks)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Mapping

import httpx

from privlm.service.auth import KEY_ENV_VARS


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_privlm(args: list[str], health_url: str, *, timeout: float = 120.0,
                 env: Mapping[str, str] | None = None) -> subprocess.Popen[bytes]:
    """Start ``privlm ARGS`` in the background and wait until ``health_url`` answers 200.

    The process gets ``env``, by default this process's environment without the variables the commands
    read keys from (``PRIVLM_API_KEYS`` ...): the keys it uses are the ones ``args`` give.
    """
    return wait_healthy(launch_privlm(args, env=env), health_url, timeout=timeout)


def launch_privlm(args: list[str], *, env: Mapping[str, str] | None = None) -> subprocess.Popen[bytes]:
    """Start ``privlm ARGS`` in the background without waiting (:func:`wait_healthy` waits): several processes
    then load their models at the same time."""
    if env is None:
        env = {name: value for name, value in os.environ.items() if name not in KEY_ENV_VARS}
    return subprocess.Popen([sys.executable, "-m", "privlm.cli", *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=dict(env))


def wait_healthy(process: subprocess.Popen[bytes], health_url: str, *,
                 timeout: float = 120.0) -> subprocess.Popen[bytes]:
    """``process`` once ``health_url`` answers 200; killed, with an error, if it exits or ``timeout`` passes first."""
    command = " ".join(map(str, process.args[3:])) if isinstance(process.args, list) else str(process.args)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"privlm {command} exited with code {process.returncode}")
        try:
            if httpx.get(health_url, timeout=1.0).status_code == 200:
                return process
        except httpx.TransportError:
            time.sleep(0.2)
    process.kill()
    raise RuntimeError(f"privlm {command} did not answer {health_url} within {timeout:.0f} s")


def stop(*processes: subprocess.Popen[bytes]) -> None:
    """Terminate, then kill whatever is still running after 15 s."""
    for process in processes:
        process.terminate()
    for process in processes:
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
