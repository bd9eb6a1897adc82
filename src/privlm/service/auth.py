"""Bearer API keys, as a reusable FastAPI dependency that returns the caller's principal."""

from __future__ import annotations

import copy
import hashlib
import os
import re
import secrets
import stat
import uuid
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Annotated

from fastapi import Depends
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer

from privlm.accounting import Ledger, PrincipalHasher
from privlm.service.errors import ServiceError
from privlm.settings.service import API_KEYS_ENV, CHAT_UPSTREAM_API_KEY_ENV, GATEWAY_API_KEYS_ENV, SERVER_API_KEY_ENV

ANONYMOUS = "anonymous"
_bearer = HTTPBearer(auto_error=False, description="privlm API key")
API_KEY_HEADER = "x-api-key"  # where LiteLLM (and Anthropic's SDK) put an API key
_api_key_header = APIKeyHeader(name=API_KEY_HEADER, auto_error=False,
                               description="privlm API key, for clients that send it here (LiteLLM's api_key)")
# What an API key may hold: visible ASCII, no whitespace. Anything else could not be sent, or would be
# altered on the way (header values are latin-1, stripped), and so could never match.
_KEY_CHARACTERS = re.compile(r"[\x21-\x7e]+")


class BearerKeys:
    """Accepts ``Authorization: Bearer <key>``, or ``x-api-key: <key>``, for any of ``keys`` (none: the service is
    open). A request with both must carry the same key in each (:func:`request_key`).

    Keys are compared as sha256 digests with :func:`secrets.compare_digest`, against every accepted
    key, so the time taken does not depend on how much of a key matched or on which key it was.

    A caller is named by ``principals`` (an HMAC of its key, :mod:`privlm.accounting.principals`), here where
    its key is checked, so nothing downstream sees the key. The default secret lasts one process (the in-memory
    in-flight counts use it); :meth:`charging` names callers as a ledger does, under the ledger's persistent
    secret, so that the ledger and the audit log share one id.
    """

    def __init__(self, keys: Sequence[str] = (), *, principals: PrincipalHasher | None = None) -> None:
        if any(not isinstance(key, str) or not key.strip() for key in keys):
            raise ValueError("api keys must be non-empty strings; an empty key would leave the service open")
        if any(not _KEY_CHARACTERS.fullmatch(key) for key in keys):
            raise ValueError("api keys must be visible ASCII without spaces; another key could never match")
        self._keys = tuple(keys)  # only to migrate ledgers of old ids (adopt_keys)
        self._digests = [hashlib.sha256(key.encode()).digest() for key in keys]
        self.principals = principals or PrincipalHasher.ephemeral()

    def charging(self, ledger: Ledger | None) -> BearerKeys:
        """The same keys, naming callers as ``ledger`` does (under its secret), after moving its spends under
        these keys' old ids to the new ones (:meth:`Ledger.adopt_keys`). Itself without a ledger or keys."""
        if ledger is None or self.open:
            return self
        ledger.adopt_keys(self._keys)
        charged = copy.copy(self)
        charged.principals = ledger.principals
        return charged

    def principal(self, key: str) -> str:
        """The id of an (accepted) key."""
        return self.principals.of_key(key)

    @property
    def open(self) -> bool:
        return not self._digests

    def fair_caller(self, principal: str) -> str:
        """Who takes turns in a shared batch (:class:`~privlm.service.Batcher`): the key's principal, or, on an open
        service (no keys, one principal for all), each request on its own, so that no client crowds out another."""
        return principal if not self.open else f"request-{uuid.uuid4()}"

    def __call__(self, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
                 api_key: Annotated[str | None, Depends(_api_key_header)] = None) -> str:
        """The principal: an HMAC of the caller's key, or ``anonymous`` on an open service."""
        if self.open:
            return ANONYMOUS
        key = request_key(credentials.credentials if credentials is not None else None, api_key)
        if key is None or not self.accepts(key):
            raise self.refusal()
        return self.principal(key)

    @property
    def dependency(self) -> Callable[..., str]:
        """What routes depend on for the principal. On an open service it asks for no credentials, so its
        OpenAPI document declares no security scheme it would not enforce."""
        return _anonymous if self.open else self

    def accepts(self, key: str) -> bool:
        """Whether ``key`` is one of the accepted keys (always True on an open service)."""
        if self.open:
            return True
        digest = hashlib.sha256(key.encode()).digest()
        matched = False
        for accepted in self._digests:  # no early exit
            matched |= secrets.compare_digest(accepted, digest)
        return matched

    @staticmethod
    def refusal() -> ServiceError:
        return ServiceError(401, "missing or invalid API key (Authorization: Bearer <key>, or x-api-key: <key>)",
                            type="authentication_error", code="invalid_api_key",
                            headers={"www-authenticate": "Bearer"})


def _anonymous() -> str:
    return ANONYMOUS


def request_key(bearer: str | None, api_key: str | None) -> str | None:
    """The key a request carries: its Bearer key (:func:`bearer_key`) or its ``x-api-key`` value (stripped), or
    None for neither, or for both with different keys (which one would be charged is not the client's to leave
    open). The body-limit middleware and the routes' dependency both decide through this."""
    api_key = api_key.strip() if api_key and api_key.strip() else None
    if bearer and api_key and not secrets.compare_digest(bearer.encode(), api_key.encode()):
        return None
    return bearer or api_key


def bearer_key(authorization: str | None) -> str | None:
    """The key of an ``Authorization`` header value by RFC 6750 (section 2.1): ``Bearer <key>``, the scheme
    in any case. None for no header, a bare key, another scheme (``Basic ...``) or no key.

    It splits the value as FastAPI's ``HTTPBearer`` (which guards the routes) does, so the body-limit
    middleware, which checks the key before the body is read, and the routes agree on every header.
    """
    if not authorization:
        return None
    scheme, _, key = authorization.partition(" ")
    key = key.strip()
    return key if scheme.lower() == "bearer" and key else None


# Where the commands read keys from the environment: the keys `privlm serve` accepts, those `privlm gateway`
# accepts (another variable, so that a shell that runs both does not hand the server's keys to the gateway),
# and the key the gateway sends to its server.
KEY_ENV_VARS = (API_KEYS_ENV, GATEWAY_API_KEYS_ENV, SERVER_API_KEY_ENV, CHAT_UPSTREAM_API_KEY_ENV)


class KeySourceError(ValueError):
    """A source of API keys that is empty, unreadable or unsafe; ``source`` names it. Never quotes a key."""

    def __init__(self, source: str, problem: str) -> None:
        super().__init__(f"{source}: {problem}")
        self.source, self.problem = source, problem


class InsecureKeyFileWarning(UserWarning):
    """A key file that the members of its group can read."""


def _check_key(key: str, source: str, where: str = "") -> str:
    what = f"{where} " if where else ""
    if not isinstance(key, str) or not key.strip():
        raise KeySourceError(source, f"{what}is empty; an empty key would leave the service open")
    if not _KEY_CHARACTERS.fullmatch(key.strip()):
        raise KeySourceError(source, f"{what}holds a space, a control or a non-ASCII character; keys are visible "
                                     "ASCII (the key itself is not shown)")
    return key.strip()


def parse_keys(text: str, source: str) -> tuple[str, ...]:
    """Keys separated by commas or newlines, surrounding blanks ignored. Nothing at all, or an empty item
    between separators, is an error naming ``source``: an empty key never means an open service."""
    if not text.strip():
        raise KeySourceError(source, "is empty; an empty key would leave the service open")
    items = re.split(r"[,\n]", text.strip())
    return tuple(_check_key(item, source, f"key {i}" if len(items) > 1 else "") for i, item in enumerate(items, 1))


def read_key_file(path: str | os.PathLike[str]) -> tuple[str, ...]:
    """The keys of a file, one per line; blank lines and lines starting with ``#`` are ignored.

    A missing or unreadable file, a file with no key, or a file every user can read is refused
    (:class:`KeySourceError`); a file its group can read is accepted with an :class:`InsecureKeyFileWarning`.
    """
    source = f"key file {os.fspath(path)}"
    try:
        mode = os.stat(path).st_mode
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise KeySourceError(source, "does not exist") from None
    except (OSError, UnicodeDecodeError) as error:
        reason = error.strerror if isinstance(error, OSError) and error.strerror else type(error).__name__
        raise KeySourceError(source, f"cannot be read ({reason})") from None
    if os.name == "posix" and mode & stat.S_IROTH:
        raise KeySourceError(source, f"is readable by every user (mode {stat.S_IMODE(mode):o}); "
                                     f"`chmod 600 {os.fspath(path)}`, or let systemd's LoadCredential= hand it over")
    if os.name == "posix" and mode & stat.S_IRGRP:
        warnings.warn(f"{source} is readable by its group (mode {stat.S_IMODE(mode):o}); `chmod 600` it",
                      InsecureKeyFileWarning, stacklevel=2)
    lines = [(number, line.strip()) for number, line in enumerate(text.splitlines(), 1)]
    keys = [_check_key(line, source, f"line {number}") for number, line in lines if line and not line.startswith("#")]
    if not keys:
        raise KeySourceError(source, "holds no key (only blank lines and # comments); an empty key file would "
                                     "leave the service open")
    return tuple(keys)


def load_keys(keys: Iterable[str] = (), *, key_file: str | os.PathLike[str] | None = None,
              env_var: str | None = None, environ: Mapping[str, str] | None = None,
              option: str = "--api-key") -> tuple[str, ...]:
    """The accepted keys of a service, from every source given, together (duplicates dropped, order kept).

    ``keys`` come from the command line (named ``option`` in errors; other users can read a process's
    command line, so prefer the other two), ``key_file`` holds one key per line (:func:`read_key_file`),
    and the environment variable ``env_var`` (of ``environ``, default ``os.environ``) holds keys separated
    by commas or newlines. No source at all gives ``()``: an open service. A source that is given but
    empty, or holds an empty key, is a :class:`KeySourceError` naming that source, never an open service.
    """
    found = [_check_key(key, option) for key in keys]
    if key_file is not None:
        found += read_key_file(key_file)
    environ = os.environ if environ is None else environ
    if env_var is not None and env_var in environ:
        found += parse_keys(environ[env_var], f"environment variable {env_var}")
    return tuple(dict.fromkeys(found))


def load_key(key: str | None = None, *, key_file: str | os.PathLike[str] | None = None,
             env_var: str | None = None, environ: Mapping[str, str] | None = None,
             option: str = "--server-api-key") -> str | None:
    """The one key a client sends: ``key`` (named ``option`` in errors) or the key in ``key_file``, not both,
    else the environment variable ``env_var``; None when none of them is given. Errors as :func:`load_keys`."""
    if key is not None and key_file is not None:
        raise KeySourceError(option, f"given together with a key file ({os.fspath(key_file)}); give one of them")
    environ = os.environ if environ is None else environ
    if key is not None:
        source, keys = option, load_keys([key], option=option)
    elif key_file is not None:
        source, keys = f"key file {os.fspath(key_file)}", read_key_file(key_file)
    elif env_var is not None and env_var in environ:
        source = f"environment variable {env_var}"
        keys = parse_keys(environ[env_var], source)
    else:
        return None
    if len(keys) != 1:
        raise KeySourceError(source, f"holds {len(keys)} keys; a client sends exactly one")
    return keys[0]
