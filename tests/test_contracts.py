"""The import contracts cover what they say they cover (`lint-imports` checks the imports themselves)."""

import tomllib
from pathlib import Path

import privlm

ROOT = Path(__file__).resolve().parents[1]
SYSTEMS = ("snd", "cape", "sap", "detect", "chat")


def _contract(name_start: str) -> dict:
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    return next(c for c in contracts if c["name"].startswith(name_start))


def test_every_core_module_of_a_system_is_held_to_no_http():
    package = Path(privlm.__file__).parent
    cores = {f"privlm.{system}.{path.stem}" for system in SYSTEMS for path in (package / system).glob("*.py")
             if path.stem != "__init__"}
    cores |= {f"privlm.{system}.{path.parent.name}" for system in SYSTEMS  # core sub-packages (detect's layers)
              for path in (package / system).glob("*/__init__.py") if path.parent.name != "service"}
    assert set(_contract("The systems' cores do no I/O")["source_modules"]) == cores


def test_the_product_may_not_import_the_bench_kit():
    contract = _contract("The product never imports the bench kit")
    assert contract["source_modules"] == ["privlm"] and contract["forbidden_modules"] == ["privlm_bench"]
