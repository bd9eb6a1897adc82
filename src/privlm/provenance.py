"""Where a figure came from: command, seed, git commit, machine."""

from __future__ import annotations

import os
import platform
import shlex
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import torch


def git_commit(cwd: Path | None = None) -> str:
    """HEAD's hash, with ``-dirty`` when the work tree has uncommitted changes; ``unknown`` outside git."""
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True,
                                check=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=cwd,
                               capture_output=True, text=True, check=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{commit}-dirty" if dirty else commit


def machine() -> dict[str, str | int | float | None]:
    memory = None
    if hasattr(os, "sysconf") and "SC_PHYS_PAGES" in os.sysconf_names:
        memory = round(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30, 1)
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "memory_gib": memory,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def provenance(*, seed: int, command: list[str] | None = None) -> dict[str, object]:
    return {
        "command": shlex.join(command if command is not None else ["privlm", *sys.argv[1:]]),
        "seed": seed,
        "git_commit": git_commit(Path(__file__).resolve().parent),
        "machine": machine(),
        "started_utc": datetime.now(UTC).isoformat(timespec="seconds"),
    }
