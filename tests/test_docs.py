"""Every command shown in the README and docs/ is one that runs: each `privlm ...` command line is parsed
by the real CLI exactly as it would be before running (subcommand, options, their types, required
values); the commands themselves are not run here (benchmarks take minutes to hours). Each Python
example that needs no running server is executed."""

import re
import shlex
from pathlib import Path

import pytest
import typer

from privlm.cli import app
from privlm.plugins import BENCH_COMMANDS, bench_installed

ROOT = Path(__file__).parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"```(\w*)\n(.*?)```", re.S)


def _commands(text: str) -> list[str]:
    """`privlm ...` lines of bash blocks (with continuations, without comments) and inline code spans."""
    found = []
    for language, body in FENCE.findall(text):
        if language != "bash":
            continue
        for line in body.replace("\\\n", " ").splitlines():
            line = line.strip()
            if line.startswith("privlm "):
                found.append(shlex.split(line, comments=True))
    prose = FENCE.sub("", text)
    found += [shlex.split(" ".join(span.split())) for span in re.findall(r"`(privlm [^`]+)`", prose)]
    return [" ".join(shlex.quote(part) for part in command) for command in found]


CASES = [(doc.relative_to(ROOT).as_posix(), command) for doc in DOCS for command in _commands(doc.read_text())]


def test_the_docs_show_commands():
    assert len(CASES) > 10 and any(doc == "README.md" for doc, _ in CASES)


@pytest.mark.parametrize(("doc", "command"), CASES)
def test_every_documented_command_parses(doc, command):
    args = shlex.split(command)[1:]
    if args[0] in BENCH_COMMANDS and not bench_installed():
        pytest.skip("the bench kit's command, and the kit is not installed")
    node = typer.main.get_command(app)  # typer's click: a group has ``commands``
    name = "privlm"
    while getattr(node, "commands", None) and args:
        if hasattr(node, "with_default_command"):  # a group with a default command (`privlm detect FILE`)
            args = node.with_default_command(args)
        if args[0] not in node.commands:
            break
        name, node, args = args[0], node.commands[args[0]], args[1:]
    if getattr(node, "commands", None):
        # A group: only a placeholder such as `privlm bench NAME` may stand for its subcommands.
        assert args and args[0].isupper(), f"{doc}: `{command}` names no command of `{name}`"
        return
    node.make_context(name, list(args))  # raises on unknown options, bad values, missing required ones


def _examples(text: str) -> list[str]:
    return [body for language, body in FENCE.findall(text) if language == "python" and "http://" not in body]


EXAMPLES = [(doc.relative_to(ROOT).as_posix(), i, code)
            for doc in DOCS for i, code in enumerate(_examples(doc.read_text()))]


@pytest.mark.slow
@pytest.mark.parametrize(("doc", "index", "code"), EXAMPLES, ids=[f"{d}#{i}" for d, i, _ in EXAMPLES])
def test_every_documented_example_runs(doc, index, code):
    exec(compile(code, f"{doc} example {index}", "exec"), {})
