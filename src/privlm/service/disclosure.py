"""What a service may say about its model: names and config without the operator's filesystem paths.

A model loaded from a folder is named by that folder's path, and a Hugging Face config records where
it was loaded from (``_name_or_path``). Services answer ``/health`` without a key and ship the config
in their bundles, so both are cut down to what a client needs before they leave.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import PurePath


def _looks_like_path(value: str) -> bool:
    return os.path.isabs(value) or value.startswith(("~", ".")) or os.path.exists(value)


def public_model_name(name: str) -> str:
    """The model's name as a service may state it: a filesystem path becomes its last component."""
    return PurePath(name).name if _looks_like_path(name) else name


def public_config(config: Mapping[str, object]) -> dict[str, object]:
    """The config without loader bookkeeping (keys that start with '_', ``name_or_path``) and with any
    string value that is a filesystem path reduced to its last component."""
    public: dict[str, object] = {}
    for key, value in config.items():
        if key.startswith("_") or key == "name_or_path":
            continue
        public[key] = public_model_name(value) if isinstance(value, str) else value
    return public
