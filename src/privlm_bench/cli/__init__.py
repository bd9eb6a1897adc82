"""The bench kit's commands, added to ``privlm`` through the entry point ``privlm.commands``: ``privlm bench ...``
(every system's sweeps and ``report``) and ``privlm serve-llm`` (a local chat server, the upstream of the demo,
the tests and the chat benchmarks)."""

from __future__ import annotations

import typer

from privlm.cli.options import settings_command
from privlm_bench.cli import attacks, baselines, cape, chat, detect, sap, snd  # noqa: F401 - registers the bench commands
from privlm_bench.cli.app import bench_app
from privlm_bench.cli.llm import ENV_PREFIX, ServeLlmSettings, serve_llm


def add_commands(app: typer.Typer) -> None:
    app.add_typer(bench_app, name="bench")
    settings_command(app, "serve-llm", ServeLlmSettings, env_prefix=ENV_PREFIX, config_file=True)(serve_llm)
