"""`import privlm`: the version and the names a user starts from, each documented and loaded on first use."""

from __future__ import annotations

import importlib
import subprocess
import sys
from importlib.metadata import version

import pytest

import privlm


def test_every_front_door_name_is_its_module_s_own_and_documented() -> None:
    assert privlm.__version__ == version("privlm")
    names = [name for name in privlm.__all__ if name != "__version__"]
    assert 15 <= len(names) <= 30
    for name in names:
        value = getattr(privlm, name)
        assert value is getattr(importlib.import_module(privlm._EXPORTS[name]), name)
        assert (value.__doc__ or "").strip(), f"{name} has no docstring"
        assert name in dir(privlm)


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        privlm.Nope  # noqa: B018


def test_importing_privlm_alone_loads_no_model_or_server_library() -> None:
    loaded = subprocess.run([sys.executable, "-c", "import sys, privlm; print(sorted(m for m in "
                             "('torch', 'transformers', 'fastapi', 'httpx') if m in sys.modules))"],
                            capture_output=True, text=True, check=True, timeout=120)
    assert loaded.stdout.strip() == "[]"
