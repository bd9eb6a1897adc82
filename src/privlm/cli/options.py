"""Commands built from settings: each flag comes from one field declared with :func:`privlm.settings.options.option`.

:func:`settings_command` turns a function of one settings object into a typer command whose flags are the
dataclass's fields (nested settings' fields too), each also read from the variable ``<PREFIX>_<FLAG>``; with
``config_file``, ``--config FILE`` (YAML or TOML, the dataclass's fields by name) gives values that variables
and flags override. Values are checked once, by the settings themselves; a bad one is a usage error naming its
flag.
"""

from __future__ import annotations

import dataclasses
import inspect
import types
import typing
from collections.abc import Callable, Iterator, Mapping
from dataclasses import MISSING, dataclass
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer

from privlm.settings.options import (
    SettingError,
    flag_spec,
    from_mapping,
    nested_settings,
    read_config,
    settings_fields,
)

__all__ = ["CONFIG_HELP", "Leaf", "leaves", "made", "settings_command", "settings_values"]

_Settings = TypeVar("_Settings")
_Made = TypeVar("_Made")
_GIVEN = ("COMMANDLINE", "ENVIRONMENT")  # by name: typer carries its own click, with its own enum
CONFIG_HELP = ("A file of these settings by field name, nested settings as mappings (YAML or JSON; TOML by its .toml "
               "suffix); the variables and the flags override it.")


@dataclass(frozen=True)
class Leaf:
    """One flag: the ``path`` of its field (``("chat", "budget")``) and its command parameter; ``separator`` and
    ``element``: a repeatable flag's values joined by it, each of that type (``--splits 0,2``)."""

    path: tuple[str, ...]
    parameter: inspect.Parameter
    separator: str | None = None
    element: type = str


def leaves(settings: type, *, env_prefix: str, prefix: tuple[str, ...] = ()) -> Iterator[Leaf]:
    """The flags of ``settings``'s fields, nested settings' included (their own panel in the help)."""
    for item, annotation in settings_fields(settings):
        inner = nested_settings(annotation)
        if inner is not None:
            yield from leaves(inner, env_prefix=env_prefix, prefix=(*prefix, item.name))
        elif flag_spec(item).settable:
            yield _leaf(item, annotation, env_prefix=env_prefix, path=(*prefix, item.name))


def _leaf(item: dataclasses.Field[Any], annotation: Any, *, env_prefix: str, path: tuple[str, ...]) -> Leaf:
    spec = flag_spec(item)
    flag = spec.name or item.name.replace("_", "-")
    nested, required = len(path) > 1, item.default is MISSING
    # A required flag may come from a config file instead: the settings refuse it missing, naming it.
    kind, default = _click_kind(annotation), None if required and not spec.argument else item.default
    envvar = f"{env_prefix}_{flag.upper().replace('-', '_')}" if spec.env else None
    info: Any
    if spec.argument:
        info = typer.Argument(help=spec.help, envvar=envvar, show_default=not required, metavar=item.name.upper())
    else:
        names = (f"--{flag}/--no-{flag}",) if kind is bool else (f"--{flag}",)
        info = typer.Option(*names, help=spec.help, envvar=envvar, rich_help_panel=path[0].capitalize() if nested
                            else None, show_default=default not in (None, ()), metavar=_metavar(kind))
    element = typing.get_args(kind)[0] if typing.get_origin(kind) is list else str
    if spec.separator is not None:
        kind = list[str]  # split and typed by settings_values
    if typing.get_origin(kind) is list:
        kind, default = kind | None, None  # None: not given (typer gives an empty list)
    elif default is None:
        kind = kind | None
    parameter = inspect.Parameter(flag.replace("-", "_"), inspect.Parameter.KEYWORD_ONLY,
                                  annotation=Annotated[kind, info],
                                  default=inspect.Parameter.empty if required and spec.argument else default)
    return Leaf(path=path, parameter=parameter, separator=spec.separator, element=element)


def _click_kind(annotation: Any) -> Any:
    """The type typer gives a field's flag: ``tuple[X, ...]`` is a repeatable flag (``list[X]``), ``X | None`` is
    X, and a ``Literal`` of strings is str (its choices are checked by the settings, as a config file's are)."""
    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    kind = next(arg for arg in (typing.get_args(annotation) if union else (annotation,)) if arg is not type(None))
    if typing.get_origin(kind) is tuple:
        return list[typing.get_args(kind)[0]]  # type: ignore[misc]
    if typing.get_origin(kind) is typing.Literal:
        return str
    return kind


def _metavar(kind: Any) -> str | None:
    """What the help shows for a flag's value: a repeatable flag shows one value's kind."""
    one = typing.get_args(kind)[0] if typing.get_origin(kind) is list else kind
    return {str: "TEXT", int: "INTEGER", float: "FLOAT"}.get(one)


def made(make: Callable[[], _Made], *, flag: str | None = None, settings_only: bool = False) -> _Made:
    """``make()``, with a bad setting as a usage error naming its flag, as every command's bad flags are; any other
    ``ValueError`` or ``OSError`` (a file that cannot be read, a model that is not there) names ``flag``, unless
    ``settings_only`` (a server's refusal is the command's own one-line error, not a usage error)."""
    try:
        return make()
    except SettingError as error:
        raise typer.BadParameter(error.problem, param_hint=error.flag or flag) from None
    except (ValueError, OSError) as error:
        if settings_only:
            raise
        raise typer.BadParameter(str(error), param_hint=flag) from None


def settings_values(ctx: typer.Context, flags: list[Leaf], given: Mapping[str, Any],
                    config: Mapping[str, Any]) -> dict[str, Any]:
    """The config file's values, overridden by every flag given on the command line or by its variable."""
    values: dict[str, Any] = _copy(config)
    for leaf in flags:
        name = leaf.parameter.name
        source = ctx.get_parameter_source(name)
        if source is None or source.name not in _GIVEN:
            continue
        place = values
        for step in leaf.path[:-1]:
            if not isinstance(place.get(step), dict):  # absent, or null in the file
                place[step] = {}
            place = place[step]
        place[leaf.path[-1]] = _joined(leaf, given[name]) if leaf.separator else given[name]
    return values


def _joined(leaf: Leaf, values: list[str]) -> list[Any]:
    """A repeatable flag's values, each of which may join several by the leaf's separator, as its element type."""
    parts = [part.strip() for value in values for part in value.split(leaf.separator) if part.strip()]
    try:
        return [leaf.element(part) for part in parts]
    except ValueError:
        flag = "--" + leaf.parameter.name.replace("_", "-")
        raise typer.BadParameter(f"expected {leaf.element.__name__}s joined by {leaf.separator!r}, got {values}",
                                 param_hint=flag) from None


def _copy(config: Mapping[str, Any]) -> dict[str, Any]:
    return {key: _copy(value) if isinstance(value, Mapping) else value for key, value in config.items()}


def settings_command(group: typer.Typer, name: str, settings: type[_Settings], *, env_prefix: str,
                     config_file: bool = False) -> Callable[[Callable[[_Settings], None]],
                                                            Callable[[_Settings], None]]:
    """Register ``run(settings)`` on ``group`` as the command ``name``, its flags built from ``settings``'s fields
    (its docstring is the command's help)."""
    flags = list(leaves(settings, env_prefix=env_prefix))
    names = [leaf.parameter.name for leaf in flags]
    if len(set(names)) != len(names):
        shared = sorted({name for name in names if names.count(name) > 1})
        raise TypeError(f"{settings.__name__}: two fields share a flag: {shared}")

    def register(run: Callable[[_Settings], None]) -> Callable[[_Settings], None]:
        def command(ctx: typer.Context, config: Path | None = None, **given: Any) -> None:
            values = settings_values(ctx, flags, given, made(lambda: read_config(config)) if config else {})
            run(made(lambda: from_mapping(settings, values)))

        extra = [inspect.Parameter("config", inspect.Parameter.KEYWORD_ONLY, default=None,
                                   annotation=Annotated[Path | None, typer.Option(help=CONFIG_HELP)])]
        context = inspect.Parameter("ctx", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=typer.Context)
        positional = [leaf.parameter for leaf in flags if leaf.parameter.default is inspect.Parameter.empty]
        rest = [leaf.parameter for leaf in flags if leaf.parameter.default is not inspect.Parameter.empty]
        command.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
            [context, *positional, *(extra if config_file else []), *rest])
        command.__doc__, command.__name__ = run.__doc__, run.__name__
        group.command(name)(command)
        return run

    return register
