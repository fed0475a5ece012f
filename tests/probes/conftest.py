"""Shared helpers for the probe tests: fake trees, the scripted runner, fake packages."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent.parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

from fakes.runner import ScriptedRunner, recorded  # noqa: E402

FAKES = TESTS / "fakes"


def make_tree(root: Path, files: dict | None = None, links: dict | None = None, dirs=()) -> Path:
    """Create ``files`` ({"/etc/os-release": text or (text, mode)}), ``links`` ({link: target}) and
    ``dirs`` under ``root``; absolute link targets stay absolute (resolved inside the root)."""
    for d in dirs:
        (root / d.lstrip("/")).mkdir(parents=True, exist_ok=True)
    for path, content in (files or {}).items():
        p = root / path.lstrip("/")
        p.parent.mkdir(parents=True, exist_ok=True)
        mode = None
        if isinstance(content, tuple):
            content, mode = content
        p.write_text(content)
        if mode is not None:
            os.chmod(p, mode)
    for link, target in (links or {}).items():
        p = root / link.lstrip("/")
        p.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(target, p)
    return root


EXE = "#!/bin/sh\nexit 0\n", 0o755


@pytest.fixture
def tree(tmp_path):
    def _make(files=None, links=None, dirs=()):
        return make_tree(tmp_path, files, links, dirs)

    return _make


__all__ = ["ScriptedRunner", "recorded", "make_tree", "EXE", "FAKES"]
