"""What every server command shares, declared once: :class:`ServiceSettings`.

``privlm gateway``, ``privlm snd serve``, ``privlm sap vendor`` and ``privlm serve-llm`` each extend it with their
own fields; the command line, the config file and a Ray config read the same declaration
(:mod:`privlm.settings.options`).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Self, TypedDict

from privlm.settings.options import SettingError, check_fields, option

__all__ = ["ANY_HOST", "API_KEYS_ENV", "CHAT_UPSTREAM_API_KEY_ENV", "DEVICES", "GATEWAY_API_KEYS_ENV", "MAX_IN_FLIGHT",
           "SERVER_API_KEY_ENV", "ReplicatedSettings", "ServiceOptions", "ServiceSettings", "host_name",
           "is_loopback"]

DEVICES = ("auto", "cpu", "cuda")
MAX_IN_FLIGHT = 32  # requests with a body read or processed at once
ANY_HOST = "*"  # an allowed Host that admits any
# The variables that hold keys (privlm.service.auth reads them).
API_KEYS_ENV = "PRIVLM_API_KEYS"
GATEWAY_API_KEYS_ENV = "PRIVLM_GATEWAY_API_KEYS"
SERVER_API_KEY_ENV = "PRIVLM_SERVER_API_KEY"
CHAT_UPSTREAM_API_KEY_ENV = "PRIVLM_CHAT_UPSTREAM_API_KEY"  # the gateway's key for its chat upstream


class ServiceOptions(TypedDict, total=False):
    """The options of :func:`privlm.service.create_service_app` that a system's factory passes on unchanged
    (:meth:`ServiceSettings.options` gives them)."""

    docs: bool
    allowed_hosts: Sequence[str] | None
    max_in_flight: int
    max_in_flight_per_caller: int | None
    body_timeout: float


@dataclass(frozen=True)
class ServiceSettings:
    """Where a server listens, whom it lets in, how much it takes at once, and how it is replicated. The keys:
    those of ``api_keys``, of ``api_key_file`` and of the variable ``api_keys_env``, read where the server is
    built (:func:`privlm.service.auth.load_keys`)."""

    host: str = option("127.0.0.1", help="Address to listen on; beyond loopback, keys are needed (or "
                                         "--allow-keyless).")
    port: int = option(8000, help="Port to listen on.", minimum=0)
    api_keys: tuple[str, ...] = option((), flag="api-key", env=False, help="Accepted Bearer key (repeatable). "
                                       "Other users see it in the process list: prefer --api-key-file or the "
                                       "--api-keys-env variable (commas or newlines). No key from any of them: open.")
    api_key_file: str | None = option(None, help="File of accepted Bearer keys, one per line (# comments); refused "
                                                 "if every user can read it.")
    api_keys_env: str | None = option(API_KEYS_ENV, env=False, help="The environment variable holding accepted "
                                                                    "keys.")
    allow_keyless: bool = option(False, help="Serve without keys on a --host other than loopback, to anyone.")
    allowed_hosts: tuple[str, ...] | None = option(None, flag="allowed-host", help="Host names an open server "
                                                   "answers (repeatable; default: loopback names only; * any).")
    docs: bool = option(False, help="Serve /docs and /redoc (they load scripts from a CDN).")
    max_in_flight: int = option(MAX_IN_FLIGHT, minimum=1, help="Requests with a body read or processed at once (a "
                                "quarter of them per API key); more get a 503 (429) to retry. Memory for bodies: "
                                "about this times the largest request.")
    device: str = option("auto", choices=DEVICES, help="Where the served models run: auto, cpu or cuda.")

    def __post_init__(self) -> None:
        check_fields(self)

    def exposed(self, keys: tuple[str, ...]) -> Self:
        """These settings checked for who can reach the server: without ``keys`` beyond loopback refused unless
        ``allow_keyless``; with it, the server answers any ``Host`` (its loopback-only check would refuse every
        remote caller)."""
        if keys or is_loopback(self.host):
            return self
        if not self.allow_keyless:
            raise SettingError(f"{self.host} is reachable from other machines and no API key is set, so anyone who "
                               "reaches it could use the service. Give keys (--api-key-file, the environment variable "
                               "or --api-key), bind to 127.0.0.1, or pass --allow-keyless to serve it open on "
                               "purpose.", "--host")
        return replace(self, allowed_hosts=(ANY_HOST,))

    def options(self) -> ServiceOptions:
        """The app's options (:func:`privlm.service.create_service_app`)."""
        options: ServiceOptions = {"docs": self.docs, "max_in_flight": self.max_in_flight}
        if self.allowed_hosts is not None:
            options["allowed_hosts"] = list(self.allowed_hosts)
        return options

    def open_warning(self, keys: tuple[str, ...]) -> str | None:
        """What the operator is told when the server is open to other machines on purpose."""
        if keys or is_loopback(self.host):
            return None
        return f"serving without API keys on {self.host} (--allow-keyless): anyone who reaches it can use it."



@dataclass(frozen=True)
class ReplicatedSettings(ServiceSettings):
    """A server that can also run as Ray Serve replicas (``privlm gateway``, ``privlm snd serve``, ``privlm sap
    vendor``)."""

    ray: bool = option(False, help="Serve through Ray Serve (needs privlm\\[ray]): replicas that share state.")
    replicas: int = option(1, minimum=1, help="With --ray: number of replicas (each loads the models).")
    replica_cpus: float = option(1.0, positive=True, help="With --ray: CPUs reserved per replica.")
    ray_address: str | None = option(None, help="With --ray: join this cluster (default: start one).")


def host_name(value: str) -> str:
    """The name of a ``Host`` header value, lower-case, without its port or a trailing dot."""
    value = value.strip().lower()
    if value.startswith("["):  # [::1]:8000
        end = value.find("]")
        return value[:end + 1] if end != -1 else value
    if value.count(":") > 1:  # a bare IPv6 address (not a valid Host, but a valid bind address)
        return f"[{value}]"
    return value.partition(":")[0].rstrip(".")


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a ``Host`` value or a bind address, with or without a port) names this machine only."""
    name = host_name(host)
    if name == "localhost" or name.endswith(".localhost"):  # RFC 6761: never resolved by DNS
        return True
    try:
        return ipaddress.ip_address(name.strip("[]")).is_loopback
    except ValueError:
        return False
