"""Each option is declared once: the gateway's flags, config file and variables all come from its settings' fields.

The values are made from the declarations themselves, so a field added to the settings is covered here without
touching this file."""

from __future__ import annotations

import dataclasses
import inspect
import json
import types
import typing
from pathlib import Path
from typing import Any

import pytest
import typer
import yaml
from typer.testing import CliRunner

from privlm.cli.options import leaves, settings_command
from privlm.settings.detect import TrainSettings
from privlm.settings.gateway import GatewaySettings
from privlm.settings.options import flag_spec, settings_fields
from privlm.settings.sap import SapCustomerSettings, SapVendorSettings
from privlm.settings.snd import SndServeSettings, SndTrainSettings

runner = CliRunner()
# Values a field's declaration alone cannot give: they must hang together (a secret needs a database ledger).
CONSTRAINED: dict[tuple[str, ...], Any] = {
    ("host",): "localhost",
    ("device",): "cpu",
    ("chat", "ledger"): "postgresql://privlm@db.internal/chat",
    ("embeddings", "ledger"): "postgresql://privlm@db.internal/embeddings",
    ("sources",): ("wordnet", "tweets"),
}
EVERY_SETTINGS = [GatewaySettings, SndServeSettings, SndTrainSettings, SapVendorSettings, SapCustomerSettings,
                  TrainSettings]
ROOT = Path(__file__).resolve().parents[2]


def _field(cls: type, path: tuple[str, ...]) -> tuple[dataclasses.Field[Any], Any]:
    for item, annotation in settings_fields(cls):
        if item.name == path[0]:
            if len(path) == 1:
                return item, annotation
            inner = next(arg for arg in (annotation, *typing.get_args(annotation)) if dataclasses.is_dataclass(arg))
            return _field(inner, path[1:])
    raise KeyError(path)


def _changed(cls: type, path: tuple[str, ...]) -> Any:
    """A value of the field at ``path`` other than its default, that its checks accept."""
    if path in CONSTRAINED:
        return CONSTRAINED[path]
    item, annotation = _field(cls, path)
    spec, default = flag_spec(item), item.default
    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    kinds = set(typing.get_args(annotation)) if union else {annotation}
    if spec.choices:
        return next(choice for choice in spec.choices if choice != default)
    if bool in kinds:
        return not default
    if int in kinds:
        return (default or 0) + 3
    if float in kinds:
        return 2.5 if default in (None, dataclasses.MISSING) else default * 1.5
    for kind in kinds:
        if typing.get_origin(kind) is tuple:
            one = typing.get_args(kind)[0]
            return (1, 2) if one is int else (1.5, 2.5) if one is float else (f"{path[-1]}-a", f"{path[-1]}-b")
    return f"x-{'-'.join(path)}"


def _every_value(cls: type = GatewaySettings) -> dict[tuple[str, ...], Any]:
    return {leaf.path: _changed(cls, leaf.path) for leaf in leaves(cls, env_prefix="T")}


def _flags(values: dict[tuple[str, ...], Any], cls: type = GatewaySettings) -> list[str]:
    by_path = {leaf.path: leaf for leaf in leaves(cls, env_prefix="T")}
    args: list[str] = []
    for path, value in values.items():
        flag = "--" + by_path[path].parameter.name.replace("_", "-")
        if by_path[path].parameter.default is inspect.Parameter.empty and flag_spec(_field(cls, path)[0]).argument:
            args.insert(0, str(value))
        elif isinstance(value, bool):
            args.append(flag if value else f"--no-{flag[2:]}")
        elif isinstance(value, tuple):
            args += [part for each in value for part in (flag, str(each))]
        else:
            args += [flag, str(value)]
    return args


def _nested(values: dict[tuple[str, ...], Any]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for path, value in values.items():
        place = tree
        for step in path[:-1]:
            place = place.setdefault(step, {})
        place[path[-1]] = list(value) if isinstance(value, tuple) else value
    return tree


def _toml(tree: dict[str, Any]) -> str:
    """Settings as TOML: plain values first, then one table per nested mapping (JSON's literals are TOML's)."""
    plain = [f"{key} = {json.dumps(value)}" for key, value in tree.items() if not isinstance(value, dict)]
    tables = [f"[{key}]\n{_toml(value)}" for key, value in tree.items() if isinstance(value, dict)]
    return "\n".join([*plain, *tables]) + "\n"


def _get(settings: object, path: tuple[str, ...]) -> Any:
    for step in path:
        settings = getattr(settings, step)
    return settings


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> list[GatewaySettings]:
    """The settings ``privlm gateway`` would serve (in this process or on Ray), without serving."""
    import privlm.cli.gateway
    import privlm.cli.service

    got: list[GatewaySettings] = []
    monkeypatch.setattr(privlm.cli.service, "exposed", lambda settings: settings)
    monkeypatch.setattr(privlm.cli.gateway, "_serve_in_process", got.append)
    monkeypatch.setattr(privlm.cli.gateway, "_gateway_with_ray", got.append)
    return got


def gateway(*args: str, env: dict[str, str] | None = None) -> Any:
    from privlm.cli import app

    result = runner.invoke(app, ["gateway", *args], env=env)
    assert result.exit_code == 0, (result.output, result.exception)
    return result


def test_every_field_but_the_programs_own_has_a_flag():
    flags = {leaf.path for leaf in leaves(GatewaySettings, env_prefix="PRIVLM_GATEWAY")}
    declared = {(item.name,) for item, _ in settings_fields(GatewaySettings) if flag_spec(item).settable}
    nested = {path for path in flags if len(path) == 2}
    assert {("chat", "budget"), ("chat", "upstream"), ("embeddings", "server"), ("port",)} <= flags
    assert declared - {("chat",), ("embeddings",)} == flags - nested
    assert ("replicated",) not in flags  # set by for_replicas, never by a user


def test_what_the_program_alone_sets_is_no_config_key():
    from privlm.settings.options import SettingError, from_mapping

    with pytest.raises(SettingError, match="unknown setting"):
        from_mapping(GatewaySettings, {"replicated": True, "chat": {"upstream": "http://up/v1", "epsilon": 1.0}})


def test_every_flag_round_trips(served):
    values = _every_value()
    gateway(*_flags(values))
    [settings] = served
    for path, value in values.items():
        assert _get(settings, path) == value, path


@pytest.mark.parametrize("suffix", [".yaml", ".toml", ".json"])
def test_every_setting_round_trips_from_a_config_file(served, tmp_path: Path, suffix: str):
    values = _every_value()
    tree = _nested(values)
    path = tmp_path / f"gateway{suffix}"
    dump = {".yaml": yaml.safe_dump, ".toml": _toml, ".json": json.dumps}[suffix]
    path.write_text(dump(tree))
    gateway("--config", str(path))
    [settings] = served
    for place, value in values.items():
        assert _get(settings, place) == value, place


def test_variables_override_the_file_and_flags_override_both(served, tmp_path: Path):
    config = tmp_path / "gateway.yaml"
    config.write_text(yaml.safe_dump({"port": 9001, "chat": {"upstream": "http://up/v1", "epsilon": 4.0,
                                                             "budget": 5.0, "perturb_system": True}}))
    env = {"PRIVLM_GATEWAY_CHAT_BUDGET": "6", "PRIVLM_GATEWAY_PORT": "9002"}
    gateway("--config", str(config), "--port", "9003", env=env)
    gateway("--config", str(config), "--no-perturb-system", env=env)
    first, second = served
    assert (first.port, first.chat.budget, first.chat.epsilon) == (9003, 6.0, 4.0)  # type: ignore[union-attr]
    assert second.port == 9002 and second.chat is not None and not second.chat.perturb_system


@pytest.mark.parametrize(("content", "message"), [
    ("chat: {upstream: http://up/v1, epsilon: 4, budgt: 3}", "chat: unknown setting(s) budgt"),
    ("chat: {upstream: http://up/v1, epsilon: six}", "chat.epsilon: expected float"),
    ("chat: {upstream: http://up/v1, epsilon: 4, budget: -1}", "--chat-budget: must be finite and > 0"),
    ("port: [1, 2]", "port: expected int"),
    ("- a list", "must hold a mapping of settings"),
    ("chat: {upstream: [", "is not valid YAML"),
])
def test_a_bad_config_file_is_a_usage_error_naming_the_setting(served, tmp_path: Path, content: str, message: str):
    from privlm.cli import app

    config = tmp_path / "gateway.yaml"
    config.write_text(content)
    result = runner.invoke(app, ["gateway", "--config", str(config)])
    assert result.exit_code == 2 and message in " ".join(result.output.split()), result.output
    assert served == []


def test_a_chat_flag_without_the_upstream_names_what_is_missing(served):
    from privlm.cli import app

    result = runner.invoke(app, ["gateway", "--server", "http://127.0.0.1:9", "--eta", "50", "--chat-budget", "3"])
    assert result.exit_code == 2 and served == []
    assert "upstream" in result.output and "chat" in result.output, result.output


@pytest.mark.parametrize("cls", EVERY_SETTINGS, ids=lambda cls: cls.__name__)
def test_every_flag_of_every_settings_command_round_trips(cls: type, tmp_path: Path):
    """Each command built from settings: every flag reaches its field, and so does every key of a config file."""
    got: list[object] = []
    group = typer.Typer()
    settings_command(group, "run", cls, env_prefix="T", config_file=True)(got.append)
    settings_command(group, "other", cls, env_prefix="T")(got.append)  # two commands: typer keeps the name
    values = _every_value(cls)
    flagged = runner.invoke(group, ["run", *_flags(values, cls)])
    config = tmp_path / "settings.yaml"
    config.write_text(yaml.safe_dump(_nested(values)))
    arguments = [str(value) for path, value in values.items() if flag_spec(_field(cls, path)[0]).argument]
    from_file = runner.invoke(group, ["run", *arguments, "--config", str(config)])
    assert flagged.exit_code == from_file.exit_code == 0, (flagged.output, from_file.output)
    for settings in got:
        for path, value in values.items():
            assert _get(settings, path) == value, (cls.__name__, path)


def test_the_shipped_gateway_config_file_starts_the_gateway(served):
    shipped = yaml.safe_load((ROOT / "deploy" / "gateway.yaml").read_text())
    gateway("--config", str(ROOT / "deploy" / "gateway.yaml"))
    [settings] = served
    assert settings.chat is not None and settings.chat.budget == shipped["chat"]["budget"]
    assert settings.replicas == shipped["replicas"] and not settings.ray  # Ray only when asked


def test_a_repeatable_flag_with_a_separator_takes_joined_values_too():
    got: list[SapVendorSettings] = []
    group = typer.Typer()
    settings_command(group, "vendor", SapVendorSettings, env_prefix="T")(got.append)
    settings_command(group, "other", SapVendorSettings, env_prefix="T")(got.append)
    joined = runner.invoke(group, ["vendor", "--store", "s", "--splits", "0,2", "--splits", "3"])
    bad = runner.invoke(group, ["vendor", "--store", "s", "--splits", "0,two"])
    assert joined.exit_code == 0 and [settings.splits for settings in got] == [(0, 2, 3)], joined.output
    assert bad.exit_code == 2 and "--splits" in bad.output and "expected ints" in bad.output, bad.output
