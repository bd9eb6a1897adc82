"""The ``privlm`` command line: the root app, with one module per system registering its commands."""

from privlm.cli import baselines, cape, chat_bench, gateway, llm, snd  # noqa: F401 - importing registers their commands
from privlm.cli.app import app

__all__ = ["app"]
