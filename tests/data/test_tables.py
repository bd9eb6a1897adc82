"""privlm.data.read_table: CSV, TSV and JSON lines in file order, every bad row refused naming its file and line
(or left out and listed), a missing column refused naming the file."""

from __future__ import annotations

import pytest

from privlm.data import Table, TableError, read_table, table_format


def test_a_csv_file_gives_its_rows_as_strings_in_order_with_their_lines(tmp_path):
    path = tmp_path / "d.csv"
    path.write_text(' text , label\n"two\nlines",1\n\nplain,0\n', encoding="utf-8")
    table = read_table(path, columns=["text", "label"])
    assert isinstance(table, Table) and table.format == "csv" and table.columns == ("text", "label")
    assert table.rows == ({"text": "two\nlines", "label": "1"}, {"text": "plain", "label": "0"})
    assert table.lines == (3, 5) and table.bad_lines == () and len(table) == 2  # a row's last line; blanks skipped


def test_a_tsv_file_and_one_without_a_header(tmp_path):
    path = tmp_path / "d.tsv"
    path.write_text('a "quoted" word\t1\n', encoding="utf-8")
    table = read_table(path, header=["text", "label"], quoting="none")
    assert table.format == "tsv" and table.rows == ({"text": 'a "quoted" word', "label": "1"},)


def test_json_lines_keep_their_json_values_and_every_key_is_a_column(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "a", "label": 2}\n\n{"text": "b", "label": true, "note": null}\n', encoding="utf-8")
    table = read_table(path, columns=["text", "label"])
    assert table.columns == ("text", "label", "note") and table.lines == (1, 3)
    assert table.rows == ({"text": "a", "label": 2}, {"text": "b", "label": True, "note": None})


@pytest.mark.parametrize(("name", "content", "problem"), [
    ("d.jsonl", '{"text": "a", "label": 1}\n{"text": "b", "label": 0\n', "line 2: not JSON"),
    ("d.jsonl", '{"text": "a", "label": 1}\n["b", 0]\n', "line 2: not a JSON object but list"),
    ("d.jsonl", '{"text": "a", "label": 1}\n\n{"text": "b"}\n', "line 3: no 'label'"),
    ("d.csv", "text,label\na,1\nb,0,extra\n", "line 3: 3 fields where there are 2 columns"),
])
def test_a_bad_row_is_refused_naming_the_file_and_its_line_or_skipped_and_listed(tmp_path, name, content, problem):
    path = tmp_path / name
    path.write_text(content, encoding="utf-8")
    with pytest.raises(TableError, match=f"{path.name}, {problem}"):
        read_table(path, columns=["text", "label"])
    table = read_table(path, columns=["text", "label"], bad_rows="skip")
    assert table.rows == ({"text": "a", "label": 1 if name.endswith("jsonl") else "1"},)
    assert table.bad_lines == (int(problem.split()[1].rstrip(":")),)


@pytest.mark.parametrize(("name", "content"), [("d.csv", "text,labels\na,1\n"), ("d.jsonl", '{"text": "a"}\n'),
                                               ("d.csv", "")])
def test_a_missing_column_is_refused_naming_the_file_even_when_skipping(tmp_path, name, content):
    path = tmp_path / name
    path.write_text(content, encoding="utf-8")
    for bad_rows in ("raise", "skip"):
        with pytest.raises(TableError, match=f"{path.name} has no columns? ('text', )?'label'; its columns are"):
            read_table(path, columns=["text", "label"], bad_rows=bad_rows)


def test_files_that_are_not_tables_are_refused_by_name(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file"):
        read_table(tmp_path / "absent.csv")
    (tmp_path / "d.txt").write_text("a\n", encoding="utf-8")
    with pytest.raises(TableError, match=r"cannot tell the format of d\.txt"):
        read_table(tmp_path / "d.txt")
    assert read_table(tmp_path / "d.txt", format="csv").columns == ("a",)
    (tmp_path / "d.csv").write_bytes(b"text\n\xff\xfe\n")
    with pytest.raises(TableError, match=r"d\.csv is not UTF-8 text"):
        read_table(tmp_path / "d.csv")
    (tmp_path / "big.csv").write_text("text\nshort\n" + "x" * 200_000 + "\n", encoding="utf-8")
    with pytest.raises(TableError, match=r"big\.csv, line 3: field larger than field limit"):
        read_table(tmp_path / "big.csv")


def test_the_format_comes_from_the_suffix_unless_named():
    assert [table_format(f"x{suffix}") for suffix in (".CSV", ".tab", ".ndjson")] == ["csv", "tsv", "jsonl"]
    assert table_format("x.txt", "tsv") == "tsv"
    with pytest.raises(ValueError, match="format must be one of"):
        table_format("x.csv", "xlsx")
