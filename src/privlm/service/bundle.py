"""A bundle: the public files a client downloads once from a service, each with its sha256.

Server side, :class:`Bundle` holds the files and serves ``GET {prefix}`` (the manifest) and
``GET {prefix}/files/{name}``. Client side, :func:`download_bundle` fetches every listed file from
those fixed paths on the server it talks to (the manifest carries names, not URLs), checks size and
sha256, and caches the files by the manifest's hash. File names are plain relative names; anything
else (absolute, ``..``, odd characters) is refused before it touches the disk.
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

from fastapi import APIRouter
from fastapi.responses import Response

from privlm.service.errors import ServiceError
from privlm.service.retry import ServerError

_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")
_MAX_PARTS = 4


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
                raise ServiceError(404, f"no bundle file {name[:80]!r}", type="not_found_error", param="name")
            return Response(self.files[name].content, media_type="application/octet-stream",
                            headers={"x-privlm-sha256": self.files[name].sha256})

        return router


def _entries(manifest: Mapping[str, object]) -> list[tuple[str, str, int]]:
    files = manifest.get("files")
    if not isinstance(files, list):
        raise ServerError("the bundle manifest lists no files")
    entries = []
    for entry in files:
        if not isinstance(entry, dict) or not isinstance(entry.get("sha256"), str) \
                or not isinstance(entry.get("size"), int):
            raise ServerError(f"malformed bundle manifest entry: {str(entry)[:120]}")
        entries.append((check_file_name(entry.get("name")), entry["sha256"], entry["size"]))
    return entries


def download_bundle(manifest: Mapping[str, object], fetch: Callable[[str], bytes], cache: Path, *,
                    namespace: str) -> Path:
    """Every listed file, fetched by name, verified against its size and sha256, written atomically inside
    ``cache/namespace/<manifest hash>``; files already there and intact are reused."""
    digest = hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()[:20]
    folder = (cache / namespace / digest).resolve()
    for name, sha256, size in _entries(manifest):
        target = (folder / name).resolve()
        if not target.is_relative_to(folder):
            raise ServerError(f"bundle file {name!r} resolves outside the cache folder; refusing it")
        if target.is_file() and hashlib.sha256(target.read_bytes()).hexdigest() == sha256:
            continue
        content = fetch(name)
        if len(content) != size or hashlib.sha256(content).hexdigest() != sha256:
            raise ServerError(f"bundle file {name} does not match its size and sha256; refusing it")
        target.parent.mkdir(parents=True, exist_ok=True)
        handle, partial = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
        with os.fdopen(handle, "wb") as file:
            file.write(content)
        os.replace(partial, target)
    return folder
