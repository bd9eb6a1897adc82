"""Where the vendor keeps its fine-tuning sessions: a folder any replica can read (a shared volume).

    <root>/<session id>/session.json               the session's settings and its owner (an HMAC of a key)
    <root>/<session id>/uploads/<n>.safetensors    each Upload as it arrived (SAP message bytes), in order
    <root>/<session id>/checkpoint.safetensors     the vendor's training state, its JSON facts in the metadata
    <root>/principals.secret                       the secret of the owners' HMACs (32 bytes, mode 0600)
    <root>/principals.check                        its check value, to refuse a lost or replaced secret

The secret lives inside the store, so every replica that mounts the store (wherever it mounts it) reads the same
one, and a copy of the store carries it: whoever holds that copy can test guessed keys against its owners.

Every file is written to a temporary name and renamed into place, so a reader (another replica, a restarted
one) sees the old file or the new one, never half of one. A checkpoint is one file: tensors and facts change
together. The owners' secret and its check are linked into place instead, so they are never replaced. Nothing
here is pickled: safetensors and JSON only, and the secret's raw bytes and its check in hex.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from privlm.accounting import PrincipalHasher, SecretFileError
from privlm.accounting.principals import create_file_once
from privlm.wire import read_safetensors_metadata

SESSION_FILE = "session.json"
CHECKPOINT_FILE = "checkpoint.safetensors"
SECRET_FILE = "principals.secret"
SECRET_CHECK_FILE = "principals.check"
_SESSION_ID = re.compile(r"sap-[0-9a-f]{32}")


class SessionNotFoundError(LookupError):
    """No session with this id, or one that belongs to someone else (the two are not told apart)."""


def new_session_id() -> str:
    return f"sap-{secrets.token_hex(16)}"


def check_session_id(session_id: object) -> str:
    if not isinstance(session_id, str) or not _SESSION_ID.fullmatch(session_id):
        raise SessionNotFoundError("no such session")
    return session_id


def _write_atomically(path: Path, content: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, partial = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(handle, "wb") as file:
        file.write(content)
        file.flush()
        os.fsync(file.fileno())
    os.replace(partial, path)


def _read_checkpoint(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    data = path.read_bytes()
    try:
        tensors = load_safetensors(data)
        facts = json.loads(read_safetensors_metadata(data)["facts"])
    except (SafetensorError, KeyError, ValueError) as error:
        raise ValueError(f"{path} is not a readable checkpoint: {error}") from error
    if not isinstance(facts, dict):
        raise ValueError(f"{path} is not a readable checkpoint: its facts are not a JSON object")
    return tensors, facts


@dataclass(frozen=True)
class StoredSession:
    """A session as the store holds it: its record, its uploads (message bytes, in order) and its checkpoint."""

    record: dict[str, Any]
    uploads: list[bytes]
    checkpoint: tuple[dict[str, torch.Tensor], dict[str, Any]] | None


class SessionStore:
    """Sessions on disk under ``root``."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def principals(self) -> PrincipalHasher:
        """How the store names its sessions' owners: an HMAC under ``principals.secret`` (made on first use). A
        secret that has gone missing, or another than the one the store was started with, is refused
        (:class:`SecretFileError`): every session would silently lose its owner."""
        secret, check = self.root / SECRET_FILE, self.root / SECRET_CHECK_FILE
        if check.exists() and not secret.exists():
            raise SecretFileError(f"the session store {self.root} was started with the secret {secret}, which is "
                                  "gone; restore it from a backup (a new one would orphan every session)")
        hasher = PrincipalHasher.from_file(secret)
        try:
            if not check.exists():  # the first start; of replicas starting at once, the first one's is kept
                create_file_once(check, hasher.fingerprint().encode())
            kept = check.read_bytes()
        except OSError as error:
            raise SecretFileError(f"the check value {check} cannot be made or read ({error.strerror or error})"
                                  ) from None
        if kept != hasher.fingerprint().encode():
            raise SecretFileError(f"{secret} is not the secret the session store {self.root} was started with; "
                                  "restore that one (another would orphan every session)")
        return hasher

    def _folder(self, session_id: str) -> Path:
        return self.root / check_session_id(session_id)

    def create(self, session_id: str, record: dict[str, Any]) -> None:
        folder = self._folder(session_id)
        if folder.exists():
            raise FileExistsError(f"session {session_id} exists already")
        _write_atomically(folder / SESSION_FILE, json.dumps(record, sort_keys=True).encode())

    def exists(self, session_id: str) -> bool:
        return (self._folder(session_id) / SESSION_FILE).is_file()

    def record(self, session_id: str) -> dict[str, Any]:
        path = self._folder(session_id) / SESSION_FILE
        if not path.is_file():
            raise SessionNotFoundError("no such session")
        record = json.loads(path.read_text())
        if not isinstance(record, dict):
            raise ValueError(f"{path} is not a session record")
        return record

    def rename_owner(self, old: str, new: str) -> int:
        """Hand every session of owner ``old`` to ``new`` (a change of how owners are named); how many moved."""
        moved = 0
        for session_id in self.session_ids():
            record = self.record(session_id)
            if record.get("owner") == old:
                record["owner"] = new
                _write_atomically(self._folder(session_id) / SESSION_FILE, json.dumps(record, sort_keys=True).encode())
                moved += 1
        return moved

    def add_upload(self, session_id: str, message: bytes) -> int:
        """Keep one Upload message; returns its number (0, 1, ...)."""
        folder = self._folder(session_id) / "uploads"
        number = len(list(folder.glob("*.safetensors"))) if folder.exists() else 0
        _write_atomically(folder / f"{number:08d}.safetensors", message)
        return number

    def upload_bytes(self, session_id: str) -> int:
        folder = self._folder(session_id) / "uploads"
        return sum(p.stat().st_size for p in folder.glob("*.safetensors")) if folder.exists() else 0

    def save_checkpoint(self, session_id: str, tensors: dict[str, torch.Tensor], facts: dict[str, Any], *,
                        keep: bool = False) -> None:
        """The latest checkpoint; ``keep`` also files it under its step (an epoch's end, to select later)."""
        content = save_safetensors({k: v.detach().cpu().contiguous() for k, v in tensors.items()},
                                   metadata={"facts": json.dumps(facts)})
        folder = self._folder(session_id)
        if keep:
            _write_atomically(folder / "kept" / f"{int(facts['steps_done']):08d}.safetensors", content)
        _write_atomically(folder / CHECKPOINT_FILE, content)

    def generation(self, session_id: str) -> str | None:
        """The ``generation`` of the session's latest checkpoint, read from its header alone (cheap)."""
        try:
            facts = json.loads(read_safetensors_metadata(self._folder(session_id) / CHECKPOINT_FILE)["facts"])
            return facts.get("generation") if isinstance(facts, dict) else None
        except (OSError, KeyError, ValueError):
            return None

    def kept_checkpoint(self, session_id: str, step: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        path = self._folder(session_id) / "kept" / f"{step:08d}.safetensors"
        if not path.is_file():
            raise KeyError(f"no checkpoint was kept at step {step}")
        return _read_checkpoint(path)

    def load(self, session_id: str) -> StoredSession:
        record = self.record(session_id)
        folder = self._folder(session_id)
        uploads = [path.read_bytes() for path in sorted((folder / "uploads").glob("*.safetensors"))] \
            if (folder / "uploads").exists() else []
        path = folder / CHECKPOINT_FILE
        checkpoint = _read_checkpoint(path) if path.is_file() else None
        return StoredSession(record=record, uploads=uploads, checkpoint=checkpoint)

    def delete(self, session_id: str) -> None:
        shutil.rmtree(self._folder(session_id), ignore_errors=True)

    def session_ids(self) -> list[str]:
        return sorted(p.name for p in self.root.iterdir() if _SESSION_ID.fullmatch(p.name) and p.is_dir())
