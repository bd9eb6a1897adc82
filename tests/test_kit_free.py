"""The product's tests need no bench kit: outside tests/bench/ no test module, conftest or helper imports
``privlm_bench``, at the top or inside a function (a static scan, so it costs no test run). `.ci/run` also collects
them with the kit made unimportable (``$PRIVLM_TEST_WITHOUT_BENCH``: tests/support/without_bench.py)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from tests.support.without_bench import ENV, is_bench_module

TESTS = Path(__file__).parent
KIT_TESTS = TESTS / "bench"
IMPORT_CALLS = {"import_module", "importorskip", "__import__"}  # an import by a name in a string


def _imported(node: ast.AST) -> list[str]:
    """The modules an import statement, or an import call with a literal name, imports."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom):
        return [node.module or ""] if node.level == 0 else []
    if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
        called = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
        return [str(node.args[0].value)] if called in IMPORT_CALLS else []
    return []


def bench_imports(path: Path) -> list[tuple[int, str]]:
    """Each import of the bench kit in ``path``: its line and the module."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    return sorted((node.lineno, name) for node in ast.walk(tree) for name in _imported(node) if is_bench_module(name))


def test_no_product_test_imports_the_bench_kit():
    product = [path for path in sorted(TESTS.rglob("*.py")) if KIT_TESTS not in path.parents]
    assert len(product) > 100
    found = [f"{path.relative_to(TESTS.parent)}:{line}: {name}" for path in product
             for line, name in bench_imports(path)]
    assert found == []


def test_the_scan_finds_every_way_of_importing_the_kit(tmp_path):
    source = tmp_path / "sample.py"
    source.write_text("import privlm_bench.cli\nfrom privlm_bench import data\nfrom privlm import data as d\n\n"
                      "def f():\n    importlib.import_module('privlm_bench.harness')\n    importorskip('numpy')\n",
                      encoding="utf-8")
    assert bench_imports(source) == [(1, "privlm_bench.cli"), (2, "privlm_bench"), (6, "privlm_bench.harness")]


def test_with_the_kit_blocked_it_cannot_be_imported_and_privlm_sees_no_kit():
    code = ("from tests.support.without_bench import block_bench; block_bench()\n"
            "from privlm.plugins import bench_installed, command_plugins\n"
            "print(bench_installed(), sorted(command_plugins()))\n"
            "import privlm_bench.data\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=TESTS.parent)
    assert done.stdout.split() == ["False", "[]"]
    assert done.returncode == 1 and f"the bench kit is blocked: ${ENV}" in done.stderr
