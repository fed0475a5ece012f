"""The installed package carries every file of cudadoctor/ that the code reads at run time (data
tables, the build scripts copied into containers): a wheel of this checkout is built and its files
compared with the source tree's. An editable install (what the tests run against) cannot show a
file missing from package-data; a user's `pip install cudadoctor` would."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _setuptools_ok() -> str | None:
    try:
        import setuptools
    except ImportError:
        return "setuptools is not installed"
    from packaging.version import Version

    if Version(setuptools.__version__) < Version("70.1"):
        return f"setuptools {setuptools.__version__} builds wheels only with the `wheel` package (needs >= 70.1)"
    return None


def test_wheel_holds_every_runtime_file_of_the_package(tmp_path):
    why = _setuptools_ok()
    if why:
        pytest.skip(why)
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    shutil.copytree(ROOT / "cudadoctor", src / "cudadoctor", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "--no-index",
                        "-q", "-w", str(tmp_path / "dist"), str(src)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    wheel = next((tmp_path / "dist").glob("cudadoctor-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        in_wheel = {n for n in z.namelist() if n.startswith("cudadoctor/")}
    in_tree = {p.relative_to(src).as_posix() for p in (src / "cudadoctor").rglob("*") if p.is_file()}
    assert in_tree - in_wheel == set(), f"files of cudadoctor/ missing from the wheel: {sorted(in_tree - in_wheel)}"
    for needed in ("cudadoctor/build/scripts/setup_toolchain.sh", "cudadoctor/build/scripts/build_wheel.py",
                   "cudadoctor/data/torch_wheels.toml"):
        assert needed in in_wheel
