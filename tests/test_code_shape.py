"""Short functions: no function of the product is over 60 lines or takes more than 8 parameters (``self`` and
``cls`` not counted, keyword-only ones counted). The commands built from settings take ``**given`` and are counted
as the functions they are."""

import ast
from pathlib import Path

PRODUCT = Path(__file__).parents[1] / "src" / "privlm"
MAX_LINES, MAX_PARAMETERS = 60, 8


def _parameters(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    args = node.args
    named = [a for a in (*args.posonlyargs, *args.args, *args.kwonlyargs) if a.arg not in ("self", "cls")]
    return len(named) + (args.vararg is not None) + (args.kwarg is not None)


def _too_big(source: str, name: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            lines = (node.end_lineno or node.lineno) - node.lineno + 1
            if lines > MAX_LINES or _parameters(node) > MAX_PARAMETERS:
                found.append(f"{name}:{node.lineno} {node.name}: {lines} lines, {_parameters(node)} parameters")
    return found


def test_every_product_function_is_short_and_takes_few_parameters():
    found = [line for path in sorted(PRODUCT.rglob("*.py"))
             for line in _too_big(path.read_text(), str(path.relative_to(PRODUCT)))]
    assert not found, "\n".join(found)


def test_the_check_finds_a_long_function_and_a_wide_one():
    long = "def f():\n" + "    x = 1\n" * 60
    wide = "def g(self, a, b, c, d, e, f, g, *, h, i): pass\n"
    assert [line.split(" ")[1] for line in _too_big(long + wide, "m.py")] == ["f:", "g:"]
    assert _too_big("def h(self, a, b, c, d, e, f, g, h): pass\n", "m.py") == []
