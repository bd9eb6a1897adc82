"""Bearer API keys, as a reusable FastAPI dependency that returns the caller's principal."""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Sequence
from typing import Annotated

from fastapi import Depends
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from privlm.accounting import principal_of_key
from privlm.service.errors import ServiceError

ANONYMOUS = "anonymous"
_bearer = HTTPBearer(auto_error=False, description="privlm API key")


class BearerKeys:
    """Accepts ``Authorization: Bearer <key>`` for any of ``keys`` (none: the service is open).

    Keys are compared as sha256 digests with :func:`secrets.compare_digest`, against every accepted
    key, so the time taken does not depend on how much of a key matched or on which key it was.
    """

    def __init__(self, keys: Sequence[str] = ()) -> None:
        if any(not isinstance(key, str) or not key.strip() for key in keys):
            raise ValueError("api keys must be non-empty strings; an empty key would leave the service open")
        self._digests = [hashlib.sha256(key.encode()).digest() for key in keys]

    @property
    def open(self) -> bool:
        return not self._digests

    def __call__(self, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]) -> str:
        """The principal: a hash of the caller's key, or ``anonymous`` on an open service."""
        if self.open:
            return ANONYMOUS
        if credentials is None or not self.accepts(credentials.credentials):
            raise self.refusal()
        return principal_of_key(credentials.credentials)

    def accepts(self, key: str) -> bool:
        """Whether ``key`` is one of the accepted keys (always True on an open service)."""
        if self.open:
            return True
        digest = hashlib.sha256(key.encode()).digest()
        matched = False
        for accepted in self._digests:  # no early exit
            matched |= secrets.compare_digest(accepted, digest)
        return matched

    def accepts_header(self, authorization: str) -> bool:
        """Whether an ``Authorization`` header value carries an accepted Bearer key."""
        scheme, _, key = authorization.partition(" ")
        return self.open or (scheme.lower() == "bearer" and self.accepts(key.strip()))

    @staticmethod
    def refusal() -> ServiceError:
        return ServiceError(401, "missing or invalid API key (Authorization: Bearer <key>)",
                            type="authentication_error", code="invalid_api_key",
                            headers={"www-authenticate": "Bearer"})
