"""Fake filesystem trees for probe tests: files, modes and symlinks under a tmp root."""

from __future__ import annotations

import os
from pathlib import Path

FAKES = Path(__file__).resolve().parent

# an executable placeholder: probes check the file exists and is executable; what it prints comes
# from the scripted runner
EXE = "#!/bin/sh\nexit 0\n", 0o755


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
