"""A bundle: the public files a client downloads once from a service, each with its sha256.

Server side, :class:`Bundle` holds the files and serves ``GET {prefix}`` (the manifest) and
``GET {prefix}/files/{name}``. Client side, :func:`download_bundle` fetches every listed file from
those fixed paths on the server it talks to (the manifest carries names, not URLs), checks size and
sha256, and caches the files by the manifest's hash. File names are plain relative names from the set
the bundle kind allows; anything else (absolute, ``..``, odd characters, a name the kind never holds) is
refused before anything is fetched. :func:`get_capped` reads an answer while it streams and stops at a
size cap, so a hostile server cannot fill the client's memory or disk with an endless body.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

import httpx
from fastapi import APIRouter
from fastapi.responses import Response

from privlm.service.errors import ServiceError
from privlm.service.retry import RetryPolicy, ServerError

_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")
_MAX_PARTS = 4
MANIFEST_LIMIT = 1 << 20  # bytes of a bundle manifest a client reads at most
ERROR_BODY_LIMIT = 64 << 10  # bytes of a non-2xx answer's body a client keeps (the status is what counts)
# Framing headers of the body as it travelled; the rebuilt response holds the decoded bytes instead.
_FRAMING = ("content-encoding", "content-length", "transfer-encoding")


def check_file_name(name: object) -> str:
    """A bundle file name: up to 4 '/'-separated parts of letters, digits, '_', '.', '-' (no '..')."""
    if not isinstance(name, str):
        raise ServerError(f"bundle file name must be a string, got {type(name).__name__}")
    parts = PurePosixPath(name).parts
    if (not parts or len(parts) > _MAX_PARTS or name.startswith("/") or str(PurePosixPath(*parts)) != name
            or any(not _NAME.fullmatch(part) or part.strip(".") == "" for part in parts)):
        raise ServerError(f"bundle file name {name[:80]!r} is not a plain relative name; refusing the bundle")
    return name


@dataclass(frozen=True)
class BundleFile:
    name: str
    content: bytes

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.content).hexdigest()


@dataclass
class Bundle:
    """Files by name, plus facts about them that go in the manifest (``format`` names the bundle kind)."""

    format: str
    facts: Mapping[str, object] = field(default_factory=dict)
    files: dict[str, BundleFile] = field(default_factory=dict)

    def add(self, name: str, content: bytes) -> None:
        self.files[check_file_name(name)] = BundleFile(name, content)

    def manifest(self) -> dict[str, object]:
        return {"format": self.format, **self.facts,
                "files": [{"name": f.name, "sha256": f.sha256, "size": len(f.content)} for f in self.files.values()]}

    def router(self, prefix: str) -> APIRouter:
        """``GET prefix`` -> the manifest; ``GET prefix/files/{name}`` -> the file's bytes."""
        router = APIRouter(tags=["bundle"])
        manifest = self.manifest()

        @router.get(prefix)
        async def bundle_manifest() -> dict[str, object]:
            return manifest

        @router.get(prefix + "/files/{name:path}", response_class=Response)
        async def bundle_file(name: str) -> Response:
            if name not in self.files:
                raise ServiceError(404, "no such bundle file; the manifest lists them", type="not_found_error",
                                   param="name")
            return Response(self.files[name].content, media_type="application/octet-stream",
                            headers={"x-privlm-sha256": self.files[name].sha256})

        return router


def get_capped(http: httpx.Client, path: str, limit: int, retry: RetryPolicy) -> httpx.Response:
    """``GET path`` through ``retry``, its body read while it streams: a 2xx body over ``limit`` bytes
    (decoded) is a :class:`ServerError` as soon as it crosses the limit, and is not retried; a non-2xx
    body is cut at :data:`ERROR_BODY_LIMIT`. The answer comes back as an ordinary, fully read response."""
    def send() -> httpx.Response:
        request = http.build_request("GET", path)
        response = http.send(request, stream=True)
        try:
            cap = limit if response.is_success else ERROR_BODY_LIMIT
            declared = response.headers.get("content-length", "")  # counts decoded bytes only when not encoded
            if response.is_success and declared.isdigit() and int(declared) > limit \
                    and "content-encoding" not in response.headers:
                raise ServerError(f"the answer to GET {path[:80]} declares {declared} bytes, over its limit of "
                                  f"{limit} bytes; refusing it")
            body = bytearray()
            for chunk in response.iter_bytes():
                body += chunk
                if len(body) > cap:
                    if not response.is_success:
                        del body[cap:]
                        break
                    raise ServerError(f"the answer to GET {path[:80]} runs past its limit of {limit} bytes; "
                                      "refusing it")
        finally:
            response.close()
        headers = [(k, v) for k, v in response.headers.multi_items() if k.lower() not in _FRAMING]
        return httpx.Response(response.status_code, headers=headers, content=bytes(body), request=request)
    return retry.call(send)


def _entries(manifest: Mapping[str, object]) -> list[tuple[str, str, int]]:
    files = manifest.get("files")
    if not isinstance(files, list):
        raise ServerError("the bundle manifest lists no files")
    entries = []
    for entry in files:
        size = entry.get("size") if isinstance(entry, dict) else None
        if not isinstance(entry, dict) or not isinstance(entry.get("sha256"), str) \
                or not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise ServerError(f"malformed bundle manifest entry: {str(entry)[:120]}")
        entries.append((check_file_name(entry.get("name")), entry["sha256"], entry["size"]))
    return entries


MAX_BUNDLE_BYTES = 2 * 2**30  # what a client downloads at most, whatever a manifest declares


def download_bundle(manifest: Mapping[str, object], fetch: Callable[[str, int], bytes], cache: Path, *,
                    namespace: str, allowed: Callable[[str], bool], max_bytes: int = MAX_BUNDLE_BYTES) -> Path:
    """Every listed file, fetched by name, verified against its size and sha256, written atomically inside
    ``cache/namespace/<manifest hash>``; files already there and intact are reused. ``allowed`` says which
    names the bundle kind holds: a manifest naming any other file, or declaring more than ``max_bytes`` in
    all, is refused before anything is fetched. ``fetch(name, size)`` gets the size the manifest declares,
    to stop reading past it."""
    digest = hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()[:20]
    folder = (cache / namespace / digest).resolve()
    entries = _entries(manifest)
    for name, _, _ in entries:
        if not allowed(name):
            raise ServerError(f"the bundle manifest names {name!r}, not a file this kind of bundle holds; "
                              "refusing the bundle")
    declared = sum(size for _, _, size in entries)
    if declared > max_bytes:
        raise ServerError(f"the bundle manifest declares {declared} bytes, more than max_bytes={max_bytes}; "
                          "refusing the bundle")
    for name, sha256, size in entries:
        target = (folder / name).resolve()
        if not target.is_relative_to(folder):
            raise ServerError(f"bundle file {name!r} resolves outside the cache folder; refusing it")
        if target.is_file() and hashlib.sha256(target.read_bytes()).hexdigest() == sha256:
            continue
        content = fetch(name, size)
        if len(content) != size or hashlib.sha256(content).hexdigest() != sha256:
            raise ServerError(f"bundle file {name} does not match its size and sha256; refusing it")
        target.parent.mkdir(parents=True, exist_ok=True)
        handle, partial = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
        with os.fdopen(handle, "wb") as file:
            file.write(content)
        os.replace(partial, target)
    return folder
