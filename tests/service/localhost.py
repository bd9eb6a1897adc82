"""Run an ASGI app on a real uvicorn server on 127.0.0.1, in a background thread."""

from __future__ import annotations

import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import Any

import uvicorn
from fastapi import FastAPI

from privlm.service.process import free_port, start_privlm
from privlm.service.serving import service_config


def bound_socket() -> socket.socket:
    """A socket bound to a free port of 127.0.0.1, not listening yet: connections are refused until a server listens
    on it, and no other test worker can take the port meanwhile (as it could between picking a port and binding)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    return sock


def port_of(sock: socket.socket) -> int:
    return int(sock.getsockname()[1])


@contextmanager
def dead_url() -> Iterator[str]:
    """A URL on 127.0.0.1 where nothing answers (connections are refused), held for the ``with`` block."""
    with bound_socket() as sock:
        yield f"http://127.0.0.1:{port_of(sock)}"


@contextmanager
def serving(app: FastAPI, sock: socket.socket | None = None, *, delay: float = 0.0) -> Iterator[str]:
    """Yield the base URL while the server runs on ``sock`` (by default a new :func:`bound_socket`); ``delay``
    starts it late (to test retries: until then, connections are refused)."""
    sock = sock or bound_socket()
    config = uvicorn.Config(app, host="127.0.0.1", port=port_of(sock), log_level="warning", lifespan="on")
    with _running(uvicorn.Server(config), sock, delay=delay) as url:
        yield url


@contextmanager
def serving_guarded(app: FastAPI, **limits: Any) -> Iterator[str]:
    """Like :func:`serving`, on the server ``privlm serve`` and ``privlm gateway`` run
    (:func:`privlm.service.serving.service_config`: header timeout, cap on connections); ``limits`` go to it."""
    sock = bound_socket()
    with _running(uvicorn.Server(service_config(app, host="127.0.0.1", port=port_of(sock), **limits)), sock) as url:
        yield url


def start_privlm_on_free_port(args: Callable[[int], list[str]], *, attempts: int = 3, **options: Any
                              ) -> tuple[subprocess.Popen[bytes], int]:
    """``start_privlm(args(port), its /health)`` on a port picked now. A process cannot be handed a bound socket, so
    the port is picked again when the start failed and the port is taken: another test worker bound it first."""
    for attempt in range(attempts):
        port = free_port()
        try:
            return start_privlm(args(port), f"http://127.0.0.1:{port}/health", **options), port
        except RuntimeError:
            if attempt == attempts - 1 or not _taken(port):
                raise
    raise AssertionError("unreachable")


def _taken(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


@contextmanager
def _running(server: uvicorn.Server, sock: socket.socket, *, delay: float = 0.0) -> Iterator[str]:
    """Run ``server`` on ``sock`` in a background thread (after ``delay`` s); wait until it is up unless delayed."""
    def run() -> None:
        time.sleep(delay)
        server.run(sockets=[sock])

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    if delay == 0:
        deadline = time.monotonic() + 20
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port_of(sock)}"
    finally:
        server.should_exit = True
        thread.join(timeout=20)
        sock.close()


class RecordingProxy:
    """A TCP proxy on 127.0.0.1 that forwards to ``target_port`` and records every byte, both ways."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen()
        self.port = self.listener.getsockname()[1]
        self.upstream = bytearray()  # client -> server
        self.downstream = bytearray()  # server -> client
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def clear(self) -> None:
        with self.lock:
            self.upstream.clear()
            self.downstream.clear()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.target_port))
            threading.Thread(target=self._pipe, args=(client, server, self.upstream), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, self.downstream), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket, record: bytearray) -> None:
        try:
            while data := source.recv(65536):
                with self.lock:
                    record.extend(data)
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                with suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.listener.close()
