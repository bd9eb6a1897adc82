"""Table files of yours: CSV or TSV with a header row, or JSON lines, read as rows of named cells.

:func:`read_table` reads a file in order and checks its shape: the columns asked for exist, and every row has
them (a CSV/TSV row as many fields as the header, a JSON line an object with those keys). A file that fails is
refused with a :class:`TableError` naming the file and, for one row, its line; ``bad_rows="skip"`` leaves such
rows out instead and lists their lines. Cells are as the file holds them: CSV/TSV cells are strings, JSON values
are as JSON wrote them (numbers, booleans, null). What the cells mean is the caller's to check.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Literal

from privlm.data.core import PathLike
from privlm.validation import check_choice

TableFormat = Literal["csv", "tsv", "jsonl"]
TABLE_FORMATS: tuple[TableFormat, ...] = ("csv", "tsv", "jsonl")
_SUFFIXES: dict[str, TableFormat] = {".csv": "csv", ".tsv": "tsv", ".tab": "tsv", ".jsonl": "jsonl",
                                     ".ndjson": "jsonl"}


class TableError(ValueError):
    """A table file that cannot be read as asked; the message names the file and, for one row, its line."""


@dataclass(frozen=True)
class Table:
    """A table file's rows in file order, each a dict of its cells. ``lines[i]`` is the line ``rows[i]`` ends on
    (a quoted CSV cell may span lines); ``bad_lines`` are the lines of the rows left out (``bad_rows="skip"``)."""

    path: Path
    format: TableFormat
    columns: tuple[str, ...]
    rows: tuple[dict[str, Any], ...]
    lines: tuple[int, ...]
    bad_lines: tuple[int, ...] = ()

    def __len__(self) -> int:
        return len(self.rows)


def table_format(path: PathLike, format: Literal["auto", "csv", "tsv", "jsonl"] = "auto") -> TableFormat:
    """``format``, or with ``"auto"`` the one the file's suffix names (.csv; .tsv, .tab; .jsonl, .ndjson)."""
    check_choice("format", format, ("auto", *TABLE_FORMATS))
    if format != "auto":
        return format
    found = _SUFFIXES.get(Path(path).suffix.lower())
    if found is None:
        raise TableError(f"format='auto' cannot tell the format of {Path(path).name}; "
                         "pass format='csv', 'tsv' or 'jsonl'")
    return found


def read_table(
    path: PathLike,
    *,
    columns: Sequence[str] = (),
    format: Literal["auto", "csv", "tsv", "jsonl"] = "auto",
    quoting: Literal["minimal", "none"] = "minimal",
    header: Sequence[str] | None = None,
    bad_rows: Literal["raise", "skip"] = "raise",
) -> Table:
    """The rows of a CSV/TSV file with a header row (or ``header``, the column names of a file without one) or of
    a JSON-lines file, in file order; blank lines are not rows.

    ``columns`` must all be columns of the file (else :class:`TableError`, always); a row that is malformed or
    lacks one of them raises :class:`TableError` naming its line, or with ``bad_rows="skip"`` is left out and its
    line kept in ``bad_lines``. ``quoting="none"`` reads TSV files whose quotes are literal text (GLUE). A missing
    file raises :class:`FileNotFoundError`.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no such file: {path}")
    fmt = table_format(path, format)
    check_choice("quoting", quoting, ("minimal", "none"))
    check_choice("bad_rows", bad_rows, ("raise", "skip"))
    try:
        with open(path, encoding="utf-8-sig", newline="") as handle:
            names, rows = (_json_rows(handle) if fmt == "jsonl"
                           else _delimited_rows(path, handle, "\t" if fmt == "tsv" else ",", quoting, header))
            numbered = list(rows)
    except UnicodeDecodeError as error:
        raise TableError(f"{path} is not UTF-8 text: {error.reason} at byte {error.start}") from None
    if fmt == "jsonl":
        names = list(dict.fromkeys(key for _, row in numbered if isinstance(row, dict) for key in row))
    missing = [c for c in columns if c not in names]
    if missing:
        named = f"column {missing[0]!r}" if len(missing) == 1 else f"columns {', '.join(map(repr, missing))}"
        raise TableError(f"{path} has no {named}; its columns are {names}")
    return _table(path, fmt, names, numbered, columns=columns, skip=bad_rows == "skip")


def _table(path: Path, fmt: TableFormat, names: list[str], numbered: list[tuple[int, dict[str, Any] | str]], *,
           columns: Sequence[str], skip: bool) -> Table:
    """Keep the good rows; raise on the first bad one, or (``skip``) keep its line."""
    rows, lines, bad_lines = [], [], []
    for line, row in numbered:
        if isinstance(row, dict):
            missing = next((column for column in columns if column not in row), None)
            if missing is None:
                rows.append(row)
                lines.append(line)
                continue
            row = f"no {missing!r}"
        if not skip:
            raise TableError(f"{path}, line {line}: {row}")
        bad_lines.append(line)
    return Table(path, fmt, tuple(names), tuple(rows), tuple(lines), tuple(bad_lines))


def _json_rows(handle: IO[str]) -> tuple[list[str], Iterator[tuple[int, dict[str, Any] | str]]]:
    """No names yet (they are the keys the rows use) and each non-blank line's object, or what is wrong with it."""
    return [], ((number, _json_row(line)) for number, line in enumerate(handle, start=1) if line.strip())


def _json_row(line: str) -> dict[str, Any] | str:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as error:
        return f"not JSON ({error.msg} at column {error.colno})"
    return row if isinstance(row, dict) else f"not a JSON object but {type(row).__name__}"


def _delimited_rows(path: Path, handle: IO[str], delimiter: str, quoting: str, header: Sequence[str] | None
                    ) -> tuple[list[str], Iterator[tuple[int, dict[str, Any] | str]]]:
    """The column names (the header row, stripped, unless ``header`` is given) and each non-empty row's cells."""
    reader = (csv.reader(handle, delimiter=delimiter, quoting=csv.QUOTE_NONE, escapechar=None)
              if quoting == "none" else csv.reader(handle, delimiter=delimiter))

    def rows() -> Iterator[list[str]]:
        try:
            yield from reader
        except csv.Error as error:  # a stray quote, a field over csv's size limit
            raise TableError(f"{path}, line {reader.line_num}: {error}") from None

    lines = rows()
    names = list(header) if header is not None else [cell.strip() for cell in next(lines, [])]
    numbered = ((reader.line_num, dict(zip(names, row, strict=True)) if len(row) == len(names)
                 else f"{len(row)} fields where there are {len(names)} columns")
                for row in lines if row)  # a blank line is not a row; a row of empty cells is
    return names, numbered
