"""Your own labelled files: CSV/TSV with a header row, JSONL, and the GLUE train/dev TSVs (read by
:func:`privlm.data.read_table`).

User files keep their order (a ``limit`` subsample too) and their text (cells are only stripped);
every row that cannot be used is counted in the dataset's ``report``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from privlm.data import (
    PathLike,
    Table,
    Task,
    TextDataset,
    check_limit,
    check_seed,
    default_metric,
    finish_dataset,
    new_report,
    read_table,
    table_format,
)
from privlm.validation import check_choice


def _cell(value: Any) -> str:
    """A cell as text: JSON numbers and booleans the way they are written (1, true), None as empty."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    return value.strip() if isinstance(value, str) else str(value)


def _check_label_values(labels: object) -> tuple[str, ...]:
    if isinstance(labels, str) or not isinstance(labels, Iterable):
        raise ValueError(f"labels must be a sequence of label values, got {labels!r}")
    values = tuple(_cell(v) for v in labels)
    if len(values) < 2 or len(set(values)) != len(values) or "" in values:
        raise ValueError(f"labels must be at least two distinct, non-empty label values, got {values!r}")
    return values


def _label_order(values: Iterable[str]) -> tuple[str, ...]:
    """Sorted distinct labels, numerically when they are all integers (so "10" comes after "9")."""
    distinct = set(values)
    if all(re.fullmatch(r"[+-]?\d+", v) for v in distinct):
        return tuple(sorted(distinct, key=int))
    return tuple(sorted(distinct))


def _table_dataset(
    table: Table,
    *,
    text: tuple[str, str],
    pair: tuple[str, str] | None,
    label: tuple[str, str],
    values: Sequence[str] | None,
    names: Sequence[str] | None,
    name: str,
    metric: str | None,
    report: dict[str, Any],
) -> tuple[Task, list[tuple[str, str | None, int]]]:
    """Check the columns, then turn rows into (text, pair, label id) rows, counting every skip."""
    for parameter, column in (text, label, *((pair,) if pair else ())):
        if column not in table.columns:
            raise ValueError(f"{parameter}={column!r} is not a column of {report['source']}; it has "
                             f"{list(table.columns)}")
    report["rows_read"] += len(table) + len(table.bad_lines)
    report["skipped"]["malformed row"] += len(table.bad_lines)
    cells = []
    for record in table.rows:
        row = (_cell(record.get(text[1])), _cell(record.get(pair[1])) if pair else None, _cell(record.get(label[1])))
        reason = "empty text" if not row[0] else "empty text pair" if pair and not row[1] else None
        reason = reason or ("empty label" if not row[2] else None)
        if reason:
            report["skipped"][reason] += 1
        else:
            cells.append(row)
    values = tuple(values) if values is not None else _label_order(c[2] for c in cells)
    if len(values) < 2:
        raise ValueError(
            f"{label[0]}={label[1]!r} has fewer than 2 distinct labels {values} in the usable rows "
            f"(skipped: {dict(report['skipped'])}); pass labels= to name the classes"
        )
    index = {v: i for i, v in enumerate(values)}
    rows = [(t, p, index[v]) for t, p, v in cells if v in index]
    report["skipped"]["label not in labels"] += len(cells) - len(rows)
    names = tuple(names) if names is not None else values
    task = Task(name, "pair" if pair else "single", names, metric or default_metric(len(names)))
    return task, rows


def load_table(
    path: PathLike,
    *,
    text_column: str,
    label_column: str,
    text_pair_column: str | None = None,
    format: Literal["auto", "csv", "tsv", "jsonl"] = "auto",
    name: str | None = None,
    labels: Sequence[str | int] | None = None,
    quoting: Literal["minimal", "none"] = "minimal",
    limit: int | None = None,
    seed: int = 0,
) -> TextDataset:
    """A labelled CSV/TSV (header row) or JSONL file of yours, in file order.

    Labels may be strings or integers; ids follow ``labels`` if given (rows with any other label are
    skipped and counted), else the sorted distinct labels. Text cells are only stripped. Rows with an
    empty text or label, or the wrong number of fields, are skipped and counted in ``report``.
    ``quoting="none"`` reads TSV files whose quotes are literal text (GLUE). ``limit`` takes a
    seeded, stratified subsample, still in file order.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no such file: {path}")
    fmt = table_format(path, format)
    check_choice("quoting", quoting, ("minimal", "none"))
    values = None if labels is None else _check_label_values(labels)
    limit, seed = check_limit(limit), check_seed(seed)
    table = read_table(path, format=fmt, quoting=quoting, bad_rows="skip")
    report = new_report(path, format=fmt)
    task, rows = _table_dataset(
        table, text=("text_column", text_column), label=("label_column", label_column),
        pair=("text_pair_column", text_pair_column) if text_pair_column is not None else None,
        values=values, names=None, name=name or path.stem, metric=None, report=report,
    )
    return finish_dataset(task, rows, report, limit=limit, seed=seed, shuffle=False)


@dataclass(frozen=True)
class _Glue:
    text: str
    pair: str | None
    label: str
    values: tuple[str, ...]
    names: tuple[str, ...]
    header: tuple[str, ...] | None = None
    metric: str | None = None


_GLUE = {
    "sst2": _Glue("sentence", None, "label", ("0", "1"), ("negative", "positive")),
    "mrpc": _Glue("#1 String", "#2 String", "Quality", ("0", "1"), ("not_equivalent", "equivalent")),
    "qqp": _Glue("question1", "question2", "is_duplicate", ("0", "1"), ("not_duplicate", "duplicate")),
    "rte": _Glue("sentence1", "sentence2", "label", ("entailment", "not_entailment"), ("entailment", "not_entailment")),
    "qnli": _Glue("question", "sentence", "label", ("entailment", "not_entailment"), ("entailment", "not_entailment")),
    "cola": _Glue(
        "sentence", None, "label", ("0", "1"), ("unacceptable", "acceptable"),
        header=("source", "label", "orig_label", "sentence"), metric="matthews",
    ),
}
GLUE_TASKS = tuple(_GLUE)


def load_glue(name: str, path: PathLike, *, limit: int | None = None, seed: int = 0) -> TextDataset:
    """A GLUE train/dev TSV you already have (sst2, mrpc, qqp, rte, qnli, cola), with GLUE's label names.

    Files are read unquoted, as GLUE writes them; CoLA files have no header. Test files carry no
    labels and are refused with the missing column named.
    """
    key = str(name).lower().replace("-", "")
    spec = _GLUE.get(key)
    if spec is None:
        raise ValueError(f"name must be one of {GLUE_TASKS}, got {name!r}")
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no such file: {path}")
    limit, seed = check_limit(limit), check_seed(seed)
    table = read_table(path, format="tsv", quoting="none", header=spec.header, bad_rows="skip")
    report = new_report(path, format="glue-tsv")
    task, rows = _table_dataset(
        table, text=("text column", spec.text), label=("label column", spec.label),
        pair=("text pair column", spec.pair) if spec.pair else None,
        values=spec.values, names=spec.names, name=key, metric=spec.metric, report=report,
    )
    return finish_dataset(task, rows, report, limit=limit, seed=seed, shuffle=False)

