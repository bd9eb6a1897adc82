"""What every privlm client SDK shares: its HTTP client (the Bearer key; :class:`RetryPolicy` follows no
redirect), JSON answers read as typed models, a bundle fetched once, and closing the client."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Self, TypeVar

import httpx
from pydantic import BaseModel, ValidationError

from privlm.models.sources import cache_dir as privlm_cache_dir
from privlm.service.bundle import MANIFEST_LIMIT, download_bundle, get_capped
from privlm.service.retry import RetryPolicy, ServerError

Answer = TypeVar("Answer", bound=BaseModel)


def open_http(base_url: str, *, api_key: str | None, timeout: float,
              transport: httpx.BaseTransport | None = None) -> httpx.Client:
    """A client for ``base_url`` that sends ``api_key`` (if any) as a Bearer key."""
    return httpx.Client(base_url=base_url, timeout=timeout, headers=bearer(api_key), transport=transport)


def bearer(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def read_answer(model: type[Answer], response: httpx.Response) -> Answer:
    """The server's JSON answer as ``model``, validated: anything else is a :class:`ServerError`."""
    try:
        return model.model_validate_json(response.content)
    except ValidationError as error:
        raise ServerError(f"the server's answer is not a {model.__name__} (a server of another privlm version?): "
                          f"{error}") from error


def fetch_bundle(http: httpx.Client, prefix: str, manifest: type[Answer], retry: RetryPolicy, *,
                 cache_dir: str | Path | None, namespace: str, allowed: Callable[[str], bool],
                 max_bytes: int) -> tuple[Answer, Path]:
    """``GET prefix``, the bundle's manifest read as ``manifest``, then every file it lists from
    ``prefix/files/<name>`` (:func:`download_bundle`: names ``allowed``, sizes and sha256 checked, cached by
    hash in ``cache_dir``, default privlm's). Every answer is read with a size cap: an endless body is refused."""
    checked = read_answer(manifest, get_capped(http, prefix, MANIFEST_LIMIT, retry))
    folder = download_bundle(checked.model_dump(mode="json"), lambda name, size: get_capped(
        http, f"{prefix}/files/{name}", size, retry).content, Path(cache_dir) if cache_dir else privlm_cache_dir(),
        namespace=namespace, allowed=allowed, max_bytes=max_bytes)
    return checked, folder


class ClosesHttp:
    """A client SDK's ``close`` of its ``http`` client, and the context manager that calls it."""

    http: httpx.Client

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
