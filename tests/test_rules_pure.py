"""Rules and the doctor are pure: they import nothing that runs processes, touches torch or the file
system, and evaluating them with those facilities booby-trapped still works."""

from __future__ import annotations

import ast
import builtins
import json
import subprocess
from pathlib import Path

import pytest

import cudadoctor

PKG = Path(cudadoctor.__file__).parent
PURE_FILES = sorted((PKG / "rules").glob("*.py")) + [PKG / "doctor.py"]
FORBIDDEN = {
    "subprocess", "torch", "os", "pathlib", "shutil", "socket", "ctypes", "pynvml", "docker",
    "multiprocessing", "glob", "tempfile", "io", "cudadoctor.runner", "cudadoctor.probes", "cudadoctor.redact",
}
FORBIDDEN_CALLS = {"open", "exec", "eval", "__import__"}


def _imports(tree: ast.AST) -> list[str]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append(node.module)
            out += [f"{node.module}.{a.name}" for a in node.names]
    return out


# os.path's string functions are pure; any other use of os is not
PURE_OS_PATH = {"basename", "dirname", "join", "split", "splitext", "normpath", "sep"}


def _os_uses_are_pure(tree: ast.AST) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "os":
            if node.attr != "path":
                return False
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
                and isinstance(node.value.value, ast.Name) and node.value.value.id == "os"):
            if node.attr not in PURE_OS_PATH:
                return False
    return True


@pytest.mark.parametrize("path", PURE_FILES, ids=[p.name for p in PURE_FILES])
def test_no_impure_imports(path: Path):
    tree = ast.parse(path.read_text(encoding="utf-8"))
    mods = _imports(tree)
    if "os" in mods and _os_uses_are_pure(tree):
        mods = [m for m in mods if m != "os"]
    bad = [m for m in mods if any(m == f or m.startswith(f + ".") for f in FORBIDDEN)]
    assert not bad, f"{path.name} imports {bad}"
    calls = [n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)]
    assert not FORBIDDEN_CALLS & set(calls), f"{path.name} calls {FORBIDDEN_CALLS & set(calls)}"


def test_pure_files_found():
    names = {p.name for p in PURE_FILES}
    assert {"driver.py", "platform.py", "torch.py", "toolkit.py", "arch.py", "environment.py", "doctor.py"} <= names


def test_diagnose_runs_with_processes_and_files_booby_trapped(monkeypatch):
    from cudadoctor.doctor import diagnose
    from cudadoctor.rules import load_rules
    from cudadoctor.knowledge import load_table, table_names

    load_rules()
    for name in table_names():
        load_table(name)  # knowledge is package data, read once before the trap closes
    scen = sorted((Path(__file__).parent / "fixtures" / "scenarios").glob("*.json"))
    docs = [json.loads(p.read_text(encoding="utf-8"))["facts"] for p in scen]

    def trap(*a, **k):
        raise AssertionError(f"rules touched the system: {a!r}")

    monkeypatch.setattr(subprocess, "Popen", trap)
    monkeypatch.setattr(subprocess, "run", trap)
    monkeypatch.setattr(builtins, "open", trap)
    for facts in docs:
        report = diagnose(facts)
        assert report["schema"] == "cudadoctor.report/1"
