"""Issue 37, item 11: the bench kit's wheel holds the whole bench kit, and only it.

src/privlm_bench/pyproject.toml listed its packages by hand and left out ``privlm_bench.attacks``, so a built wheel
lacked it (``privlm bench attacks`` and ``bench report`` failed on import). setuptools finds them now, taking every
folder for a package: a second build in the same folder took the first one's build/lib for a package too and
shipped a copy of the kit inside the kit. This builds the wheel offline, twice, from a copy of the folder (the
checkout gets no build/ folder), and compares each with the source.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

BENCH = Path(__file__).parents[2] / "src" / "privlm_bench"
NOT_SHIPPED = shutil.ignore_patterns("*.egg-info", "__pycache__", "*.pyc", "build", "dist")


def built_wheel(source: Path, wheel_dir: Path) -> tuple[set[str], str]:
    """The files a wheel built from ``source`` ships (its metadata aside), and its entry points."""
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                            "--quiet", "--wheel-dir", str(wheel_dir), str(source)],
                           capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-3000:]
    [wheel] = wheel_dir.glob("privlm_bench-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        shipped = {name for name in archive.namelist() if not name.split("/")[0].endswith(".dist-info")}
        entry_points = next(archive.read(n).decode() for n in archive.namelist() if n.endswith("entry_points.txt"))
    return shipped, entry_points


def test_round3_11_the_bench_kits_wheel_holds_every_package_and_file_of_the_source_and_no_earlier_build(tmp_path):
    source = tmp_path / "privlm_bench"
    shutil.copytree(BENCH, source, ignore=NOT_SHIPPED)
    # Every file of every package folder (a folder with an __init__.py), code or data, and nothing else; the
    # folder's pyproject.toml is the distribution's, not the package's. Listed before the build writes build/.
    packages = [folder for folder in [source, *source.rglob("*")] if (folder / "__init__.py").is_file()]
    assert any(folder.name == "attacks" for folder in packages)
    expected = {"privlm_bench/" + file.relative_to(source).as_posix() for folder in packages
                for file in folder.iterdir() if file.is_file()} - {"privlm_bench/pyproject.toml"}
    for build in ("first", "second"):  # the second in the folder the first left its build output in
        shipped, entry_points = built_wheel(source, tmp_path / build)
        missing, extra = sorted(expected - shipped), sorted(shipped - expected)
        assert (build, missing, extra) == (build, [], [])
        assert "bench = privlm_bench.cli:add_commands" in entry_points  # `privlm bench` finds the kit
