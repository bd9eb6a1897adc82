"""What every server command does with its :class:`~privlm.settings.service.ServiceSettings` before serving:
read the keys (a bad source is a usage error), refuse an open server beyond loopback, and carry the keys of the
command line and the environment to Ray replicas. Public: the bench kit's ``privlm serve-llm`` uses it too."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TypeVar

import typer

from privlm.cli.options import made
from privlm.service.auth import KeySourceError, load_keys
from privlm.settings.service import ServiceSettings

__all__ = ["exposed", "keys_or_usage_error", "keys_read_here", "served_keys"]

_Settings = TypeVar("_Settings", bound=ServiceSettings)
_Keys = TypeVar("_Keys")


def keys_or_usage_error(load: Callable[[], _Keys]) -> _Keys:
    """``load()``, with a key source's error as a usage error (no traceback) and its warnings on stderr."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            loaded = load()
        except KeySourceError as error:
            raise typer.BadParameter(error.problem, param_hint=error.source) from None
    for warning in caught:
        typer.echo(f"Warning: {warning.message}", err=True)
    return loaded


def served_keys(settings: ServiceSettings, *, with_file: bool = True) -> tuple[str, ...]:
    """The keys the server accepts (``with_file`` False: those of the command line and the variable only)."""
    key_file = settings.api_key_file if with_file else None
    return keys_or_usage_error(lambda: load_keys(settings.api_keys, key_file=key_file, env_var=settings.api_keys_env))


def exposed(settings: _Settings) -> _Settings:
    """``settings`` checked for who can reach the server (:meth:`ServiceSettings.exposed`), with a warning when
    it is open to other machines on purpose."""
    keys = served_keys(settings)
    checked = made(lambda: settings.exposed(keys))
    if (warning := settings.open_warning(keys)) is not None:
        typer.echo(f"Warning: {warning}", err=True)
    return checked


def keys_read_here(settings: _Settings) -> _Settings:
    """``settings`` with the keys of the command line and the variable read here, as they travel to Ray replicas
    (whose nodes may have other environments); the key file stays a path, read by each replica on its node."""
    from dataclasses import replace

    return replace(settings, api_keys=served_keys(settings, with_file=False), api_keys_env=None)
