"""Rendering: flutter-doctor layout, ASCII fallback, GitHub annotation escaping, rule list."""

from __future__ import annotations

import sys
from pathlib import Path

from cudadoctor import render
from cudadoctor.doctor import diagnose

sys.path.insert(0, str(Path(__file__).parent / "rules"))
from factsbuilder import facts  # noqa: E402


def _broken():
    return facts(host_compiler={"version": "14.2.0"}, tools={"ninja": None, "docker": "24.0.7"},
                 toolkits=[{"root": "/usr/local/cuda-12.4", "nvcc": "12.4.131", "via": ["PATH", "CUDA_HOME"]}])


def test_human_marks_areas_and_numbers_findings():
    out = render.human(diagnose(_broken()))
    lines = out.splitlines()
    assert any(ln.startswith("[✗] Host compiler: gcc 14.2.0") for ln in lines)
    assert any(ln.startswith("[!] Tools:") for ln in lines)
    assert any(ln.startswith("[✓] Driver: driver 550.54.15, CUDA 12.4") for ln in lines)
    assert "[HOST_COMPILER_UNSUPPORTED, #1]" in out and "[NINJA_MISSING, #2]" in out
    assert "      fix: sudo apt-get install -y g++-13 && export CUDAHOSTCXX=/usr/bin/g++-13" in out
    assert lines[-1] == "! Doctor found 1 error(s) and 1 warning(s) in 2 area(s)."


def test_human_ascii_and_verbose():
    out = render.human(diagnose(_broken()), verbose=True, ascii_only=True)
    assert not set("✓✗•") & set(out) and "[x] Host compiler" in out and "[+] Driver" in out
    assert "libcuda /usr/lib/x86_64-linux-gnu/libcuda.so.1" in out  # -v shows more facts
    assert "kernel module 550.54.15" in out


def test_human_healthy():
    out = render.human(diagnose(facts()))
    assert out.rstrip().endswith("No issues found!")


def test_github_escapes_newlines_and_properties():
    rep = {"findings": [{"id": "X", "severity": "error", "title": "a: b, c", "detail": "50% done\nnext",
                         "fix": ["do it"]},
                        {"id": "Y", "severity": "info", "title": "t", "detail": "", "fix": []}],
           "status": "fail"}
    out = render.github(rep).splitlines()
    assert out[0] == "::error title=X%3A a%3A b%2C c::50%25 done%0Anext%0AFix:%0A  do it"
    assert out[1].startswith("::notice title=Y%3A t::")
    assert out[-1] == "cudadoctor: status fail, 2 finding(s)"


def test_rule_list_alignment():
    text = render.rule_list([("A", "error", "one"), ("LONGER_ID", "warning", "two")])
    assert text.splitlines() == ["A          error    one", "LONGER_ID  warning  two"]


def test_human_empty_snapshot_says_nothing_was_judged():
    from cudadoctor.doctor import diagnose
    from cudadoctor.render import human

    out = human(diagnose({}))
    assert "nothing could be judged" in out
    assert "No issues found" not in out


def test_verbose_compiler_row_shows_where_python_h_was_looked_for():
    ok = facts(python={"include_dir": "/usr/include/python3.11", "has_python_h": True})
    out = render.human(diagnose(ok), verbose=True, ascii_only=True)
    assert "Python headers: /usr/include/python3.11\n" in out
    bad = facts(python={"include_dir": "/usr/include/python3.11", "has_python_h": False})
    out = render.human(diagnose(bad), verbose=True, ascii_only=True)
    assert "Python headers: /usr/include/python3.11 (no Python.h)" in out and "PYTHON_HEADERS_MISSING" in out
    assert "Python headers" not in render.human(diagnose(facts()), verbose=True, ascii_only=True)
