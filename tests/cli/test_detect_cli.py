"""`privlm detect FILE|-`: the text with its spans marked by kind, or JSON Lines; a file that cannot be read is one
line and exit status 2. A fake layer stands in for the packaged detector (no model loads here)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import typer
from rich.color import Color
from rich.console import Console
from typer.testing import CliRunner

import privlm.cli.detect as detect_cli
from privlm.cli import app
from privlm.detect import KINDS, Detector, Kind, Span

runner = CliRunner()
PROMPT = "I am Maria Gonzalez, 34, from Seattle. My asthma is getting worse."
FOUND = {"Maria Gonzalez": (Kind.PERSON, 0.9), "34": (Kind.AGE, 0.5), "Seattle": (Kind.LOCATION, 0.8),
         "asthma": (Kind.HEALTH, 0.7)}


class FakeLayer:
    """Finds the details of FOUND wherever they occur, and records the batches it was given (and, as the detector of
    the ``layer`` fixture, the devices it was loaded for)."""

    name = "fake"

    def __init__(self) -> None:
        self.batches: list[list[str]] = []
        self.devices: list[str] = []
        self.backends: list[list[str]] = []

    def detect(self, texts: Sequence[str]) -> list[list[Span]]:
        self.batches.append(list(texts))
        return [[Span(m.start(), m.end(), kind, score, "fake")
                 for detail, (kind, score) in FOUND.items() for m in re.finditer(rf"\b{re.escape(detail)}\b", text)]
                for text in texts]


@pytest.fixture
def layer(monkeypatch: pytest.MonkeyPatch) -> FakeLayer:
    """The fake layer, as the detector every `privlm detect` of the test loads; the devices asked for are kept."""
    fake = FakeLayer()

    def load(device: str, backends: Sequence[str] = ()) -> Detector:
        fake.devices.append(device)
        fake.backends.append(list(backends))
        return Detector([fake])

    monkeypatch.setattr(detect_cli, "load_detector", load)
    return fake


@pytest.fixture
def notes(tmp_path: Path) -> Path:
    path = tmp_path / "notes.txt"
    path.write_text(PROMPT + "\n", encoding="utf-8")
    return path


def test_a_file_is_printed_with_each_detail_marked_by_kind_and_a_legend(layer, notes):
    result = runner.invoke(app, ["detect", str(notes)])
    assert result.exit_code == 0, result.output
    assert ("I am [Maria Gonzalez](person), [34](age), from [Seattle](location). My [asthma](health) is getting "
            "worse.") in result.stdout  # no colour terminal here: the marks are brackets
    assert "Kinds found: person 1, location 1, age 1, health 1" in result.stdout
    assert layer.devices == ["auto"]


def test_standard_input_and_the_text_command_by_name_give_the_same(layer, notes):
    from_stdin = runner.invoke(app, ["detect", "-"], input=PROMPT + "\n")
    by_name = runner.invoke(app, ["detect", "text", str(notes)])
    assert from_stdin.exit_code == by_name.exit_code == 0, from_stdin.output + by_name.output
    assert from_stdin.stdout == by_name.stdout and "[Maria Gonzalez](person)" in by_name.stdout


def test_json_is_one_object_per_file_with_exact_offsets(layer, notes, tmp_path):
    other = tmp_path / "other.txt"
    other.write_text("Nothing personal here.", encoding="utf-8")
    result = runner.invoke(app, ["detect", "--json", str(notes), str(other), "--device", "cpu"])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert [row["file"] for row in rows] == [str(notes), str(other)]
    assert rows[0]["text"] == PROMPT + "\n" and rows[1]["spans"] == []
    spans = rows[0]["spans"]
    assert [(s["text"], s["kind"]) for s in spans] == [("Maria Gonzalez", "person"), ("34", "age"),
                                                         ("Seattle", "location"), ("asthma", "health")]
    for span in spans:
        assert rows[0]["text"][span["start"]:span["end"]] == span["text"]
        assert set(span) == {"start", "end", "kind", "score", "source", "text"}
    assert layer.devices == ["cpu"]


def test_lines_are_texts_of_their_own_detected_in_batches(layer, tmp_path):
    lines = ["Maria Gonzalez called.", "", "She is 34.", "From Seattle.", "asthma", "no detail"]
    path = tmp_path / "lines.txt"
    path.write_text("\r\n".join(lines) + "\r\n", encoding="utf-8")
    result = runner.invoke(app, ["detect", str(path), "--lines", "--json", "--batch-size", "2"])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert [row["line"] for row in rows] == [1, 3, 4, 5, 6]  # the blank line is left out, the numbering kept
    assert [row["text"] for row in rows] == [line for line in lines if line]
    assert [[s["kind"] for s in row["spans"]] for row in rows] == [["person"], ["age"], ["location"], ["health"], []]
    assert [len(batch) for batch in layer.batches] == [2, 2, 1]  # blank lines never reach the detector


def test_lines_without_json_keep_the_text_as_it_was(layer, tmp_path):
    path = tmp_path / "lines.txt"
    path.write_text("Maria Gonzalez\n\nSeattle\n", encoding="utf-8")
    result = runner.invoke(app, ["detect", "--lines", str(path)])
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("[Maria Gonzalez](person)\n\n[Seattle](location)\n")


def test_min_score_and_no_labels(layer, notes):
    result = runner.invoke(app, ["detect", str(notes), "--min-score", "0.75", "--no-labels"])
    assert result.exit_code == 0, result.output
    assert "I am [Maria Gonzalez], 34, from [Seattle]. My asthma" in result.stdout
    assert "Kinds found: person 1, location 1\n" in result.stdout


@pytest.mark.parametrize("score", ["-0.1", "1.5"])
def test_a_min_score_outside_0_1_is_a_usage_error(layer, notes, score):
    result = runner.invoke(app, ["detect", str(notes), "--min-score", score])
    assert result.exit_code == 2 and not layer.batches


def test_a_text_without_details_says_so(layer, tmp_path):
    path = tmp_path / "plain.txt"
    path.write_text("The weather is fine.", encoding="utf-8")
    result = runner.invoke(app, ["detect", str(path)])
    assert result.exit_code == 0 and result.stdout == "The weather is fine.\n\nNo personal details found.\n"


@pytest.mark.parametrize("make", ["missing", "directory", "latin-1"])
def test_a_file_that_cannot_be_read_is_one_line_and_exit_status_2_before_anything_loads(layer, notes, tmp_path, make):
    bad = {"missing": tmp_path / "nope.txt", "directory": tmp_path, "latin-1": tmp_path / "latin.txt"}[make]
    if make == "latin-1":
        bad.write_bytes("Café Müller".encode("latin-1"))
    result = runner.invoke(app, ["detect", str(notes), str(bad)])
    assert result.exit_code == 2
    assert result.stdout == "" and result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert result.stderr.startswith(f"Error: cannot read {bad}: ")
    assert layer.devices == []  # checked before the detector loads


def test_backends_are_passed_by_name_and_an_unknown_one_is_a_usage_error(layer, notes):
    result = runner.invoke(app, ["detect", str(notes), "--backend", "spacy", "--backend", "presidio", "--json"])
    assert result.exit_code == 0, result.output
    assert layer.backends == [["spacy", "presidio"]]
    result = runner.invoke(app, ["detect", str(notes), "--backend", "no-such-detector"])
    assert result.exit_code == 2
    assert result.stderr.startswith("Error: no detection backend named 'no-such-detector'; installed: ")
    assert "presidio" in result.stderr and layer.backends == [["spacy", "presidio"]]  # nothing loaded


def test_a_detector_that_cannot_load_is_one_line_and_exit_status_1(monkeypatch, notes):
    def missing(device: str, backends: Sequence[str] = ()) -> Detector:
        raise FileNotFoundError("no tagger weights in the package")

    monkeypatch.setattr(detect_cli, "load_detector", missing)
    result = runner.invoke(app, ["detect", str(notes)])
    assert result.exit_code == 1
    assert result.stderr == ("Error: the detector could not be loaded: FileNotFoundError: no tagger weights in the "
                             "package\n")


@pytest.fixture
def train_command() -> Iterator[list[str]]:
    """A dummy `privlm detect train` in the group, as the tagger's training command will join it; removed after."""
    called: list[str] = []

    @detect_cli.detect_app.command("train")
    def train(out: str = typer.Option("tagger")) -> None:
        called.append(out)

    yield called
    detect_cli.detect_app.registered_commands.pop()


def test_another_command_of_the_group_runs_and_a_file_still_falls_through_to_text(layer, notes, train_command):
    trained = runner.invoke(app, ["detect", "train", "--out", "here"])
    assert trained.exit_code == 0 and train_command == ["here"], trained.output
    text = runner.invoke(app, ["detect", str(notes)])
    options_first = runner.invoke(app, ["detect", "--json", str(notes)])
    assert text.exit_code == options_first.exit_code == 0, text.output + options_first.output
    assert "[Maria Gonzalez](person)" in text.stdout and json.loads(options_first.stdout)["spans"]
    listed = runner.invoke(app, ["detect", "--help"])
    assert listed.exit_code == 0 and "train" in listed.stdout and "text" in listed.stdout


def test_help_says_what_json_holds(layer):
    result = runner.invoke(app, ["detect", "text", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    assert "JSON Lines" in result.stdout and '"spans"' in result.stdout and "--lines" in result.stdout
    alone = runner.invoke(app, ["detect"])  # the group's help, as every group's: no detection
    assert alone.exit_code == 2 and "privlm detect text --help" in " ".join(alone.output.split())
    assert not layer.batches


def _contrast(background: str) -> float:
    """WCAG's contrast ratio of black text on ``background``."""
    red, green, blue = (channel / 255 for channel in Color.parse(background).get_truecolor())
    linear = [c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in (red, green, blue)]
    return (0.2126 * linear[0] + 0.7152 * linear[1] + 0.0722 * linear[2] + 0.05) / 0.05


def test_every_kind_has_its_own_light_background_under_black_text():
    """Black on a light background reads the same on a dark and a light terminal: every colour is set, none is the
    terminal's. WCAG AAA asks 7:1 of body text; each kind's colour differs from every other's."""
    assert set(detect_cli.BACKGROUNDS) == set(detect_cli.STANDARD_BACKGROUNDS) == {kind.value for kind in KINDS}
    assert len(set(detect_cli.BACKGROUNDS.values())) == len(KINDS)
    for kind, background in detect_cli.BACKGROUNDS.items():
        assert _contrast(background) >= 7, kind
    assert not {"black", "blue", "bright_black"} & set(detect_cli.STANDARD_BACKGROUNDS.values())


@pytest.mark.parametrize(("color_system", "palette"), [("truecolor", detect_cli.BACKGROUNDS),
                                                        ("256", detect_cli.BACKGROUNDS),
                                                        ("standard", detect_cli.STANDARD_BACKGROUNDS)])
def test_on_a_colour_terminal_each_span_is_black_on_its_kinds_background(color_system, palette):
    console = Console(force_terminal=True, color_system=color_system, no_color=False)
    assert detect_cli.palette_of(console) is palette
    spans = Detector([FakeLayer()]).detect([PROMPT])[0]
    text = detect_cli.render(PROMPT, spans, palette=palette)
    assert text.plain == ("I am Maria Gonzalez(person), 34(age), from Seattle(location). My asthma(health) is getting "
                          "worse.")
    styled = {text.plain[s.start:s.end]: str(s.style) for s in text.spans}
    assert styled["Maria Gonzalez"] == f"black on {palette['person']}"
    assert styled["(person)"] == f"italic black on {palette['person']}"
    assert styled["asthma"] == f"black on {palette['health']}"
    with console.capture() as captured:
        console.print(text)
    assert "\x1b[" in captured.get()  # the terminal gets colours


def test_no_colour_is_asked_for_by_no_color_and_by_a_pipe():
    assert detect_cli.palette_of(Console(force_terminal=True, no_color=True)) is None
    assert detect_cli.palette_of(Console(force_terminal=False)) is None
