"""The ``privlm`` command line: the root app (:mod:`privlm.cli.root`), one module per system registering its
commands, and :mod:`privlm.cli.main`, which puts them together with the plugins' commands. ``privlm.cli.app``
loads it on first use, so that a plugin's own modules may import :mod:`privlm.cli.root` without a circle."""

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "app":
        from privlm.cli.main import app

        return app
    raise AttributeError(f"module 'privlm.cli' has no attribute {name!r}")
