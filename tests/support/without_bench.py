"""The product's tests as they run where the bench kit is not installed. With ``$PRIVLM_TEST_WITHOUT_BENCH`` set,
tests/conftest.py calls :func:`block_bench` (``privlm_bench`` cannot be imported in the test process, and the kit's
entry point is hidden, so ``privlm`` sees no kit) and leaves tests/bench/ out. A subprocess a test starts still
sees the kit. ``.ci/run`` collects the tests so; tests/test_kit_free.py checks their imports statically."""

from __future__ import annotations

import importlib.abc
import sys
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType

import privlm.plugins

ENV = "PRIVLM_TEST_WITHOUT_BENCH"
KIT = "privlm_bench"


def is_bench_module(name: str) -> bool:
    return name.split(".")[0] == KIT


class _NoBench(importlib.abc.MetaPathFinder):
    """Refuses every module of the kit, before any other finder can find it."""

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
                  ) -> ModuleSpec | None:
        if is_bench_module(fullname):
            raise ModuleNotFoundError(f"No module named {fullname!r} (the bench kit is blocked: ${ENV})",
                                      name=fullname)
        return None


def block_bench() -> None:
    """Make the kit unimportable and its plugin absent in this process; refused once a module of it is loaded."""
    if any(isinstance(finder, _NoBench) for finder in sys.meta_path):
        return
    loaded = sorted(name for name in sys.modules if is_bench_module(name))
    if loaded:
        raise RuntimeError(f"the bench kit cannot be blocked: already imported ({', '.join(loaded)})")
    sys.meta_path.insert(0, _NoBench())
    plugins = privlm.plugins.command_plugins
    privlm.plugins.command_plugins = lambda: {name: load for name, load in plugins().items() if name != "bench"}
    privlm.plugins.bench_installed = lambda: False
