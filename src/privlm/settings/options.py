"""Settings declared once: a settings dataclass's fields carry their flag, help and checks.

As vLLM's ``FrontendArgs`` does, a server's options are fields of a frozen dataclass, each made with
:func:`option`. That one declaration gives:

  - the command-line flag (``privlm.cli.options`` builds a typer command from the dataclass);
  - the config-file key (the field's name; a nested settings dataclass is a nested mapping);
  - the environment variable (``<PREFIX>_<FLAG>``, where the command gives the prefix);
  - the check (:func:`check_fields`: ``positive``, ``minimum``, ``choices``), with an error naming the flag.

Nothing here imports a model or a server: settings are plain values that can travel to a Ray replica.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
import types
import typing
from collections.abc import Iterator, Mapping
from dataclasses import MISSING, dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import yaml

__all__ = ["Flag", "SettingError", "check_fields", "flag_of", "flag_spec", "from_mapping", "nested_settings",
           "option", "read_config", "redefault", "settings_fields"]


class SettingError(ValueError):
    """A bad value of one setting: ``problem``, and the command-line ``flag`` it came from (None: the problem
    names it, or a file it names cannot be read or written)."""

    def __init__(self, problem: str, flag: str | None = None) -> None:
        super().__init__(problem if flag is None else f"{flag}: {problem}")
        self.problem, self.flag = problem, flag

    def __reduce__(self) -> tuple[type[SettingError], tuple[str, str | None]]:  # Ray carries errors pickled
        return SettingError, (self.problem, self.flag)


@dataclass(frozen=True)
class Flag:
    """How one field shows on the command line: ``help``; ``name``, the flag without ``--`` (None: the field's
    name with dashes); ``env``: whether a variable may set it (off for secrets, which have variables of their
    own); ``settable``: off for a field the program alone sets (never a flag or a config key); ``argument``: a
    positional argument,
    not a flag; ``separator``: a repeatable flag whose values may also be joined by it (``--splits 0,2``). Checks:
    ``positive`` (finite and > 0), ``minimum`` (an integer bound) and ``choices``; None passes every check."""

    help: str
    name: str | None = None
    env: bool = True
    settable: bool = True
    argument: bool = False
    separator: str | None = None
    positive: bool = False
    minimum: int | None = None
    choices: tuple[str, ...] = ()


_FLAG = "privlm.flag"


def option(default: Any = MISSING, *, help: str, flag: str | None = None, **how: Any) -> Any:
    """A settings field declared with its flag (:class:`Flag`: ``how`` holds its other fields); ``default``
    MISSING: a required field."""
    return field(default=default, metadata={_FLAG: Flag(help=help, name=flag, **how)})


def redefault(cls: type, name: str, default: Any) -> Any:
    """``cls``'s field ``name`` declared again with another default and the same flag, help and checks (a
    server's own port, say)."""
    item = next(item for item in dataclasses.fields(cls) if item.name == name)
    return field(default=default, metadata=item.metadata)


def flag_spec(item: dataclasses.Field[Any]) -> Flag:
    """The :class:`Flag` of a field declared with :func:`option`."""
    spec = item.metadata.get(_FLAG)
    if not isinstance(spec, Flag):
        raise TypeError(f"the field {item.name!r} was not declared with privlm.settings.options.option")
    return spec


def flag_of(cls: type, name: str) -> str:
    """The command-line flag of ``cls``'s field ``name``, e.g. ``--chat-memory-days``."""
    item = next(item for item in dataclasses.fields(cls) if item.name == name)
    return "--" + (flag_spec(item).name or name.replace("_", "-"))


def settings_fields(cls: type) -> Iterator[tuple[dataclasses.Field[Any], Any]]:
    """``cls``'s declared fields with their resolved types (nested settings included, as their own type)."""
    hints = _hints(cls)
    for item in dataclasses.fields(cls):
        if _FLAG in item.metadata:
            yield item, hints[item.name]


def nested_settings(annotation: Any) -> type | None:
    """The settings dataclass a field holds (``ChatSettings | None`` gives ``ChatSettings``), else None."""
    for candidate in (annotation, *typing.get_args(annotation)):
        if isinstance(candidate, type) and dataclasses.is_dataclass(candidate):
            return candidate
    return None


@cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def check_fields(settings: object) -> None:
    """Refuse (:class:`SettingError`, naming the flag) a value its declaration rules out."""
    for item, _ in settings_fields(type(settings)):
        value, spec = getattr(settings, item.name), flag_spec(item)
        if value is None or isinstance(value, bool):
            continue
        flag = flag_of(type(settings), item.name)
        if spec.positive and not (isinstance(value, int | float) and value > 0 and math.isfinite(value)):
            raise SettingError(f"must be finite and > 0, got {value}", flag)
        if spec.minimum is not None and value < spec.minimum:
            raise SettingError(f"must be >= {spec.minimum}, got {value}", flag)
        if spec.choices and value not in spec.choices:
            raise SettingError(f"must be one of {', '.join(spec.choices)}, got {value!r}", flag)


def from_mapping(cls: type, values: Mapping[str, Any], *, where: str = "") -> Any:
    """``cls`` from plain nested values (a config file, a Ray config's ``args``): its fields by name, nested
    settings as mappings, lists as tuples; an unknown name or a value of the wrong kind is a
    :class:`SettingError` naming its place (``where``: the place of ``values`` itself)."""
    if not isinstance(values, Mapping):
        raise SettingError(f"expected a mapping of {cls.__name__}'s fields, got {type(values).__name__}",
                           where.rstrip(".") or None)
    known = {item.name: annotation for item, annotation in settings_fields(cls) if flag_spec(item).settable}
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise SettingError(f"unknown setting(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}",
                           where.rstrip(".") or None)
    missing = [item.name for item, _ in settings_fields(cls) if item.default is MISSING and item.name not in values]
    if missing:
        keys = ", ".join(f"{where}{name}" for name in missing)
        raise SettingError(f"missing (in a config file: {keys})", " / ".join(flag_of(cls, name) for name in missing))
    made: dict[str, Any] = {}
    for name, value in values.items():
        inner = nested_settings(known[name])
        if inner is not None and value is not None:
            value = from_mapping(inner, value, where=f"{where}{name}.")
        elif value is not None:
            value = _of_kind(value, known[name], f"{where}{name}")
        made[name] = value
    return cls(**made)


def _of_kind(value: Any, annotation: Any, place: str) -> Any:
    """A plain value as its field's type wants it: a list as a tuple, an int where a float goes, a string where a
    number, a yes/no or a list goes read as one (Ray's ``serve run ... k=v`` gives strings; a list's items joined
    by commas); anything else of the wrong kind is refused (a config file's ``epsilon: six``)."""
    if annotation is Any:
        return value
    kinds = _kinds(annotation) - {type(None)}
    if isinstance(value, str) and str not in kinds:
        value = _from_text(value, kinds, place)
    if tuple in kinds and isinstance(value, list | tuple):
        element = _element(annotation)
        return tuple(_of_kind(item, element, f"{place}[{index}]") for index, item in enumerate(value))
    if float in kinds and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, bool) is not (bool in kinds) or not isinstance(value, tuple(kinds)):
        names = " or ".join(sorted(kind.__name__ for kind in kinds))
        raise SettingError(f"expected {names}, got {value!r}", place)
    return value


_YES_NO = {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}


def _from_text(text: str, kinds: set[type], place: str) -> Any:
    """``text`` read as the first of ``kinds`` it can be: a yes/no, an int, a float, or a comma-joined list."""
    try:
        if bool in kinds:
            return _YES_NO[text.strip().lower()]
        if int in kinds:
            return int(text)
        if float in kinds:
            return float(text)
    except (KeyError, ValueError):
        raise SettingError(f"expected {' or '.join(sorted(k.__name__ for k in kinds))}, got {text!r}", place) from None
    if tuple in kinds:
        return [part.strip() for part in text.split(",") if part.strip()]
    return text


def _element(annotation: Any) -> Any:
    """The item type of the tuple a field holds (``tuple[int, ...] | None`` gives int)."""
    for arg in (annotation, *typing.get_args(annotation)):
        if typing.get_origin(arg) is tuple:
            return typing.get_args(arg)[0]
    return Any


def _kinds(annotation: Any) -> set[type]:
    """The classes a field's type admits: ``float | None`` gives float and NoneType, ``tuple[str, ...]`` tuple,
    ``Literal["a", "b"]`` str."""
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:  # its choices are checked by check_fields
        return {type(choice) for choice in typing.get_args(annotation)}
    if origin in (typing.Union, types.UnionType):
        return set().union(*(_kinds(arg) for arg in typing.get_args(annotation)))
    return {origin or annotation}


def read_config(path: str | Path) -> dict[str, Any]:
    """A config file's settings by field name (nested settings as mappings): TOML by its ``.toml`` suffix, else
    YAML (JSON is YAML). A file that cannot be read or parsed is a :class:`SettingError` naming ``--config``."""
    path = Path(path)
    kind = "TOML" if path.suffix == ".toml" else "YAML"
    try:
        text = path.read_text()
        values = tomllib.loads(text) if kind == "TOML" else yaml.safe_load(text)
    except OSError as error:
        raise SettingError(f"{error.strerror or error}: {path}", "--config") from None
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as error:
        raise SettingError(f"{path} is not valid {kind}: {error}", "--config") from None
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise SettingError(f"{path} must hold a mapping of settings by field name", "--config")
    return values
