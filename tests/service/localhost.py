"""Run an ASGI app on a real uvicorn server on 127.0.0.1, in a background thread."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any

import uvicorn
from fastapi import FastAPI

from privlm.service.process import free_port
from privlm.service.serving import service_config


@contextmanager
def serving(app: FastAPI, port: int | None = None, *, delay: float = 0.0) -> Iterator[str]:
    """Yield the base URL while the server runs; ``delay`` starts it late (to test retries)."""
    config = uvicorn.Config(app, host="127.0.0.1", port=port or free_port(), log_level="warning", lifespan="on")
    with _running(uvicorn.Server(config), delay=delay) as url:
        yield url


@contextmanager
def serving_guarded(app: FastAPI, **limits: Any) -> Iterator[str]:
    """Like :func:`serving`, on the server ``privlm serve`` and ``privlm gateway`` run
    (:func:`privlm.service.serving.service_config`: header timeout, cap on connections); ``limits`` go to it."""
    with _running(uvicorn.Server(service_config(app, host="127.0.0.1", port=free_port(), **limits))) as url:
        yield url


@contextmanager
def _running(server: uvicorn.Server, *, delay: float = 0.0) -> Iterator[str]:
    """Run ``server`` in a background thread (after ``delay`` s); wait until it is up unless delayed."""
    def run() -> None:
        time.sleep(delay)
        server.run()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    if delay == 0:
        deadline = time.monotonic() + 20
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{server.config.port}"
    finally:
        server.should_exit = True
        thread.join(timeout=20)


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
