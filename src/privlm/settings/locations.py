"""Where state is kept: a SQLite file or a PostgreSQL server, told apart by the location's form alone."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit

__all__ = ["POSTGRES_SCHEMES", "is_database_url"]

POSTGRES_SCHEMES = ("postgresql", "postgres")


def is_database_url(location: str | Path) -> bool:
    """Whether ``location`` names a PostgreSQL server (``postgresql://...``) rather than a SQLite file."""
    return isinstance(location, str) and urlsplit(location).scheme in POSTGRES_SCHEMES
