"""The whole ``privlm`` command: every system's commands, then the commands of installed plugins (the bench kit's).
The console script runs this module's ``app``; ``privlm.cli.app`` is the same object."""

from privlm.cli import cape, detect, gateway, ledger, sap, snd  # noqa: F401 - registers commands
from privlm.cli.root import add_plugin_commands, app

add_plugin_commands()

__all__ = ["app"]
