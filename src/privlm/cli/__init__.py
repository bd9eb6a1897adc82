"""The ``privlm`` command line: the root app, with one module per system registering its commands, and the
commands of installed plugins (the bench kit)."""

from privlm.cli import cape, gateway, sap, snd  # noqa: F401 - registers commands
from privlm.cli.app import add_plugin_commands, app

add_plugin_commands()

__all__ = ["app"]
