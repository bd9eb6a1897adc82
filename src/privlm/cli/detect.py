"""``privlm detect FILE|-``: the personal details the local detector finds in a text, coloured by kind, or as JSON.

``privlm detect`` is a group whose default command is ``text``: ``privlm detect notes.txt`` and ``privlm detect -``
run ``privlm detect text ...``, and a first argument that names another command of the group runs that one
(``privlm detect train ...``, say), so that commands can join the group without changing how text is checked.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from typer.core import TyperGroup

from privlm.cli.options import settings_command
from privlm.cli.root import app
from privlm.settings.detect import TrainSettings

if TYPE_CHECKING:
    from rich.console import Console
    from rich.text import Text
    from typer._click import Context

    from privlm.detect import Detector, Kind, Span

DEFAULT_COMMAND = "text"
USAGE_ERROR = 2  # what click answers a bad argument with: a file that cannot be read is one


class TextByDefault(TyperGroup):
    """A group that runs its default command, ``text``, unless the first argument names another of its commands
    (or asks for the group's help)."""

    def with_default_command(self, args: list[str], help_options: Sequence[str] = ("--help",)) -> list[str]:
        """``args`` as the group reads them: the default command's name first unless they name another command."""
        if args and args[0] not in self.commands and args[0] not in help_options:
            return [DEFAULT_COMMAND, *args]
        return args

    def parse_args(self, ctx: Context, args: list[str]) -> list[str]:
        return super().parse_args(ctx, self.with_default_command(args, ctx.help_option_names))


detect_app = typer.Typer(
    cls=TextByDefault, no_args_is_help=True, subcommand_metavar="FILE|- | COMMAND [ARGS]...",
    short_help="Find personal details in a text with the local detector (nothing leaves this machine).",
    help="Find personal details (names, places, ages, health, ids, ...) with the local detector: nothing leaves "
         "this machine. `privlm detect FILE|-` runs `privlm detect text FILE|-`: see `privlm detect text --help` for "
         "--json, --lines, --min-score, --backend and --device.")
app.add_typer(detect_app, name="detect")


@dataclass(frozen=True)
class _Input:
    """One text to check: a whole file, or (``--lines``) one line of it, numbered from 1."""

    file: str
    text: str
    line: int | None = None

    def as_json(self, spans: Sequence[Span]) -> dict[str, Any]:
        where: dict[str, Any] = {"file": self.file} if self.line is None else {"file": self.file, "line": self.line}
        return {**where, "text": self.text, "spans": [span.as_dict(self.text) for span in spans]}


def load_detector(device: str, backends: Sequence[str] = ()) -> Detector:
    """The packaged detector, with the ``backends`` named (tests replace this function)."""
    from privlm.detect import Detector

    return Detector.default(device=device, backends=backends)


@detect_app.command(DEFAULT_COMMAND)
def detect_text(
    files: Annotated[list[str], typer.Argument(metavar="FILE|-", help="UTF-8 text files; - reads standard input.",
                                               show_default=False)],
    as_json: Annotated[bool, typer.Option("--json", help="JSON Lines: one object per text (per file, or per line "
                                          "with --lines): {\"file\", \"line\" (with --lines), \"text\", \"spans\": "
                                          "[{\"start\", \"end\", \"kind\", \"score\", \"source\", \"text\"}]}; "
                                          "offsets in characters of that text.")] = False,
    lines: Annotated[bool, typer.Option("--lines", help="Each line is a text of its own (detected in batches); "
                                        "blank lines have no spans, and --json leaves them out.")] = False,
    min_score: Annotated[float, typer.Option(min=0.0, max=1.0, help="Show only spans scored at least this (the "
                                             "detector's own thresholds apply first).")] = 0.0,
    labels: Annotated[bool, typer.Option("--labels/--no-labels", help="Print each span's kind beside it (else "
                                         "only in the legend).")] = True,
    batch_size: Annotated[int, typer.Option(min=1, help="Texts per call of the detector.")] = 32,
    backend: Annotated[list[str] | None, typer.Option(help="One more detector, joined by union, where its library "
                                                      "is installed: presidio, spacy, gliner, or a plugin's "
                                                      "(entry points privlm.detect_backends); repeatable.",
                                                      show_default=False)] = None,
    device: Annotated[str, typer.Option(help="auto, cpu or cuda.")] = "auto",
) -> None:
    """Print the text with its personal details coloured by kind (the default command), or --json.

    Each detail is coloured by its kind, the kind beside it, and a legend follows.
    Without a colour terminal (a pipe, NO_COLOR), each detail reads \\[detail](kind).
    Nothing leaves this machine.
    """
    inputs = list(_inputs(files, lines=lines))  # every file read before the detector loads: a bad path fails fast
    backends = _known_backends(backend or [])
    detector = _loaded(device, backends)
    found = [[span for span in spans if span.score >= min_score]
             for spans in _detect(detector, [entry.text for entry in inputs], batch_size)]
    if as_json:
        for entry, spans in zip(inputs, found, strict=True):
            if entry.text.strip() or entry.line is None:
                typer.echo(json.dumps(entry.as_json(spans), ensure_ascii=False))
        return
    _print_coloured(inputs, found, several_files=len(files) > 1, labels=labels)


def _fail(message: str, status: int) -> typer.Exit:
    """One line on stderr, as every privlm command reports what it cannot do (no usage box, no traceback)."""
    typer.echo(f"Error: {' '.join(message.split())}", err=True)
    return typer.Exit(status)


def _read(file: str) -> str:
    if file == "-":
        return sys.stdin.read()
    try:
        with open(file, encoding="utf-8", newline="") as handle:  # newline="": offsets count every character
            return handle.read()
    except OSError as error:
        raise _fail(f"cannot read {file}: {error.strerror or error}", USAGE_ERROR) from None
    except UnicodeDecodeError:
        raise _fail(f"cannot read {file}: it is not UTF-8 text", USAGE_ERROR) from None


def _inputs(files: Sequence[str], *, lines: bool) -> Iterator[_Input]:
    for file in files:
        text = _read(file)
        if not lines:
            yield _Input(file, text)
            continue
        rows = text.split("\n")  # lines as an editor numbers them (not str.splitlines's \f, \x1c, \u2028...)
        for number, line in enumerate(rows[:-1] if rows[-1] == "" else rows, start=1):
            yield _Input(file, line.removesuffix("\r"), number)


def _known_backends(names: Sequence[str]) -> list[str]:
    from privlm.detect.backends import known_backends

    try:
        known_backends(names)
    except ValueError as error:
        raise _fail(str(error), USAGE_ERROR) from None
    return list(names)


def _loaded(device: str, backends: Sequence[str]) -> Detector:
    try:
        return load_detector(device, backends)
    except Exception as error:  # a missing weight file, a bad --device: the user's to fix, in one line
        raise _fail(f"the detector could not be loaded: {type(error).__name__}: {error}", 1) from None


def _detect(detector: Detector, texts: Sequence[str], batch_size: int) -> list[list[Span]]:
    """Every text's spans, the non-blank ones detected ``batch_size`` at a time (a blank text has none)."""
    wanted = [i for i, text in enumerate(texts) if text.strip()]
    found: list[list[Span]] = [[] for _ in texts]
    for start in range(0, len(wanted), batch_size):
        batch = wanted[start:start + batch_size]
        for i, spans in zip(batch, detector.detect([texts[i] for i in batch]), strict=True):
            found[i] = spans
    return found


# -- the coloured text -----------------------------------------------------------------------------------------------

# Light backgrounds under black text: black on each is readable whatever the terminal's own colours, dark or light
# (a foreground colour alone is not: yellow vanishes on white, navy on black). One colour per kind, always the same:
# of the xterm-256 cube (exact on 256-colour and truecolor terminals), or of the 16 standard colours, whose light
# ones are fewer than the kinds (the label beside each span tells those that share one apart).
BACKGROUNDS: dict[str, str] = {
    "person": "#ffafaf", "organization": "#afd7ff", "location": "#afffaf", "address": "#d7ffaf", "age": "#ffd7af",
    "date": "#ffffaf", "amount": "#d7d7ff", "contact": "#afffff", "identifier": "#ffafd7", "health": "#ffaf87",
    "medication": "#d7afff", "occupation": "#d7d7af", "religion": "#ffd787", "ethnicity": "#afd7af",
    "sexuality": "#ffafff", "union": "#afafd7",
}
STANDARD_BACKGROUNDS: dict[str, str] = {
    "person": "bright_red", "organization": "bright_blue", "location": "bright_green", "address": "green",
    "age": "bright_yellow", "date": "yellow", "amount": "bright_cyan", "contact": "cyan",
    "identifier": "bright_magenta", "health": "red", "medication": "magenta", "occupation": "bright_white",
    "religion": "white", "ethnicity": "green", "sexuality": "bright_magenta", "union": "bright_blue",
}
Palette = Mapping[str, str]


def palette_of(console: Console) -> Palette | None:
    """The backgrounds this console can show, or None where it shows no colour (a pipe, a file, NO_COLOR)."""
    if console.color_system is None or console.no_color:
        return None
    return BACKGROUNDS if console.color_system in ("256", "truecolor") else STANDARD_BACKGROUNDS


def kind_style(kind: Kind | str, palette: Palette, *, label: bool = False) -> str:
    return f"{'italic ' if label else ''}black on {palette[str(kind)]}"


def render(text: str, spans: Sequence[Span], *, palette: Palette | None, labels: bool = True) -> Text:
    """``text`` with each span marked: on ``palette``'s background of its kind, its kind beside it in italics
    (``detail(kind)``); or, without a palette, as ``[detail](kind)``."""
    from rich.text import Text

    out = Text()
    at = 0
    for span in spans:
        out.append(text[at:span.start])
        detail, kind = text[span.start:span.end], span.kind.value
        if palette is not None:
            out.append(detail, style=kind_style(kind, palette))
            if labels:
                out.append(f"({kind})", style=kind_style(kind, palette, label=True))
        else:
            out.append(f"[{detail}]({kind})" if labels else f"[{detail}]")
        at = span.end
    out.append(text[at:])
    return out


def legend(counts: Mapping[str, int], *, palette: Palette | None) -> Text:
    """The kinds found, each in its colour, with how many spans of it."""
    from rich.text import Text

    if not counts:
        return Text("No personal details found.")
    out = Text("Kinds found: ")
    for n, (kind, count) in enumerate(counts.items()):
        if n:
            out.append("  " if palette is not None else ", ")
        out.append(f" {kind} " if palette is not None else kind,
                   style=kind_style(kind, palette) if palette is not None else "")
        out.append(f" {count}")
    return out


def _print_coloured(inputs: Sequence[_Input], found: Sequence[Sequence[Span]], *, several_files: bool,
                    labels: bool) -> None:
    from rich.console import Console
    from rich.text import Text

    from privlm.detect import KINDS

    console = Console(highlight=False, soft_wrap=True)  # soft wrap: the text's own lines, never cut by rich
    palette = palette_of(console)
    file = None
    for entry, spans in zip(inputs, found, strict=True):
        if several_files and entry.file != file:
            file = entry.file
            console.rule(Text(file))
        _print_text(console, render(entry.text, spans, palette=palette, labels=labels))
    counts = {kind.value: n for kind in KINDS if (n := sum(s.kind == kind for spans in found for s in spans))}
    console.print()
    console.print(legend(counts, palette=palette))


def _print_text(console: Console, text: Text) -> None:
    console.print(text, end="" if text.plain.endswith("\n") else "\n")


@settings_command(detect_app, "train", TrainSettings, env_prefix="PRIVLM_DETECT_TRAIN")
def detect_train(settings: TrainSettings) -> None:
    """Train the tagger on synthetic data from the committed generator; choose thresholds on validation."""
    from privlm.data import public_corpus
    from privlm.detect import Layer
    from privlm.detect.gazetteers import GazetteerLayer, default_gazetteer
    from privlm.detect.patterns import PatternLayer
    from privlm.detect.synthetic import plain_public_texts
    from privlm.detect.tagger import TaggerConfig, load_features, write_tagger
    from privlm.detect.training import train_tagger, training_vocabularies
    from privlm.provenance import provenance

    vocabularies = training_vocabularies(default_gazetteer().entries)
    marking: list[Layer] = [PatternLayer(), GazetteerLayer()]
    negatives = settings.negatives
    public = plain_public_texts(public_corpus(limit=negatives, seed=settings.seed), marking) if negatives else []
    features, fingerprint = load_features(TaggerConfig(), settings.device)
    held_out = [line.strip() for path in settings.hold_out for line in _read(path).splitlines() if line.strip()]
    started = provenance(seed=settings.seed)
    head, card = train_tagger(features, fingerprint, vocabularies=vocabularies, negatives=public, settings=settings,
                              held_out=held_out)
    card.training["provenance"] = started
    write_tagger(Path(settings.out), head, card)
    test = card.training["test"]
    typer.echo(f"wrote {settings.out}: test tokens recall (any kind) {test['any']['recall']:.4f}, "  # type: ignore[index]
               f"precision {test['any']['precision']:.4f}")  # type: ignore[index]
