"""The ids a ledger, an audit log and a rate limit keep for callers: an HMAC of their key, never the key.

An id is ``hmac-key:`` + the first 128 bits (32 hex digits) of HMAC-SHA256(secret, key). The secret is 32
random bytes kept in a file of its own beside the ledger (``<ledger>.secret``, mode 0600), created on first use
and written atomically. It is not inside the ledger on purpose: whoever holds a copy of the ledger or of an audit
log (a backup, a file handed to an auditor) but not the secret cannot test guessed keys against the ids. Whoever
reads both files can: keep the secret where the ledger's readers are not, and back it up separately, since a
ledger without its secret can no longer tell whose spends are whose (the ledger refuses to start then rather than
hand every key a fresh budget). Without a ledger the secret is made per process: ids then stay stable for one
run only. The SAP vendor keeps the secret of its sessions' owners inside its session store instead
(:meth:`privlm.sap.service.store.SessionStore.principals`), where every replica that mounts the store finds it.

The ids of earlier privlm ledgers were ``key:`` + the first 64 bits of an unsalted sha256 of the key, which anyone
could recompute for a guessable key; :func:`legacy_principal_of_key` computes them only to migrate old ledgers.

A *joint* principal (:func:`joint_principal`) stands for several principals at once, such as a LiteLLM key and
one of its end users: a ledger charges it to every one of them in one transaction, only if each has budget left
(:class:`privlm.accounting.Ledger`). It is a string, so every layer between the service and the ledger passes it
on unchanged; the prefix ``all-of:`` is reserved for it, and no id privlm makes (``hmac-key:``, ``litellm-...``)
can start with it.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import re
import secrets
from pathlib import Path

KEY_PREFIX = "hmac-key:"
LEGACY_KEY_PREFIX = "key:"
LEGACY_KEY_ID = re.compile(r"key:[0-9a-f]{16}")
SECRET_BYTES = 32
SECRET_SUFFIX = ".secret"


JOINT_PREFIX = "all-of:"


def joint_principal(*members: str) -> str:
    """One principal for all of ``members`` (duplicates dropped, order kept): a ledger charges each of them, and
    only if each has budget left. One member is itself; two or more are ``all-of:`` and their JSON list."""
    unique = list(dict.fromkeys(members))
    if not unique:
        raise ValueError("a joint principal needs at least one member")
    for member in unique:
        if not isinstance(member, str) or not member or member.startswith(JOINT_PREFIX):
            raise ValueError("each member of a joint principal must be a non-empty id that is not joint itself")
    return unique[0] if len(unique) == 1 else JOINT_PREFIX + json.dumps(unique, ensure_ascii=False)


def principal_members(principal: str) -> tuple[str, ...]:
    """The principals ``principal`` stands for: itself, or the members of a joint principal. A malformed joint
    principal is refused (``ValueError``), never charged as one id."""
    if not principal.startswith(JOINT_PREFIX):
        return (principal,)
    try:
        members = json.loads(principal[len(JOINT_PREFIX):])
    except ValueError:
        members = None
    if not (isinstance(members, list) and len(members) >= 2 and all(isinstance(m, str) for m in members)
            and joint_principal(*members) == principal):
        raise ValueError("a principal starting with 'all-of:' must be a joint principal (joint_principal)")
    return tuple(members)


class SecretFileError(ValueError):
    """A principals' secret that cannot be made or read, is malformed, or is not the one its ledger started with."""


def legacy_principal_of_key(api_key: str) -> str:
    """The id of privlm's old ledgers (an unsalted sha256 prefix): only to find and migrate them."""
    return LEGACY_KEY_PREFIX + hashlib.sha256(api_key.encode()).hexdigest()[:16]


class PrincipalHasher:
    """Names callers by an HMAC-SHA256 under one secret (see the module doc)."""

    def __init__(self, secret: bytes) -> None:
        if not isinstance(secret, bytes) or len(secret) < SECRET_BYTES:
            raise ValueError(f"a principals' secret must be at least {SECRET_BYTES} bytes")
        self._secret = secret

    @classmethod
    def ephemeral(cls) -> PrincipalHasher:
        """A secret for this process only (a service without a ledger): ids do not survive a restart."""
        return cls(secrets.token_bytes(SECRET_BYTES))

    @classmethod
    def from_file(cls, path: str | Path) -> PrincipalHasher:
        """The secret in ``path``, created there (atomically, mode 0600) if the file does not exist yet."""
        return cls(load_or_create_secret(Path(path)))

    def of_key(self, api_key: str) -> str:
        """The id of an API key."""
        return KEY_PREFIX + self.digest(api_key)

    def digest(self, value: str) -> str:
        return hmac.new(self._secret, value.encode(), hashlib.sha256).hexdigest()[:32]

    def fingerprint(self) -> str:
        """A check value a ledger (or a SAP session store) keeps to notice a replaced secret; it tells nothing of
        any key."""
        return self.digest("privlm: the ledger's secret check")


def secret_path_of(ledger_path: str | Path) -> Path:
    """Where the secret of the ledger at ``ledger_path`` lives."""
    path = Path(ledger_path)
    return path.with_name(path.name + SECRET_SUFFIX)


def load_or_create_secret(path: Path) -> bytes:
    """The secret of ``path``; a new one if there is none. Two processes starting at once agree on one: the new
    secret is written to a temporary file and linked into place, which fails if another process won."""
    try:
        if not path.exists():
            create_file_once(path, secrets.token_bytes(SECRET_BYTES))
        secret = path.read_bytes()
    except OSError as error:
        raise SecretFileError(f"the principals' secret {path} cannot be made or read ({error.strerror or error})"
                              ) from None
    if len(secret) != SECRET_BYTES:
        raise SecretFileError(f"the principals' secret {path} holds {len(secret)} bytes, not {SECRET_BYTES}")
    return secret


def create_file_once(path: Path, content: bytes) -> None:
    """Write ``content`` to ``path`` (mode 0600) unless the file exists; of processes racing to make it, the first
    wins and the others keep its file: the content goes to a temporary file that is linked into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(descriptor, "wb") as out:
            out.write(content)
            out.flush()
            os.fsync(out.fileno())
        with contextlib.suppress(FileExistsError):  # another process made it first: theirs is kept
            os.link(temporary, path)  # never replaces a file, unlike a rename
    finally:
        temporary.unlink(missing_ok=True)
