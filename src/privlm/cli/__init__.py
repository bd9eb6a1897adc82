"""The ``privlm`` command line: the root app, with one module per system registering its commands."""

from privlm.cli import baselines, cape, chat_bench, gateway, llm, sap, sap_bench, snd  # noqa: F401 - registers commands
from privlm.cli.app import app

__all__ = ["app"]
