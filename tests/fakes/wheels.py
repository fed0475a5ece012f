"""Minimal wheels for the builder's tests: a zip with the given files under their member names."""

from __future__ import annotations

import zipfile
from pathlib import Path


def make_wheel(tmp: Path, members: dict[str, Path], dist: str = "demo_ops") -> Path:
    """tmp/<dist>-0.1.0-cp311-cp311-linux_x86_64.whl holding <dist>/__init__.py, each members[name]
    (a file on disk) as `name`, and an empty RECORD."""
    path = tmp / f"{dist}-0.1.0-cp311-cp311-linux_x86_64.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{dist}/__init__.py", "")
        for name, src in members.items():
            z.write(src, name)
        z.writestr(f"{dist}-0.1.0.dist-info/RECORD", "")
    return path
