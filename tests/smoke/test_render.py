"""Table and JSON rendering of smoke reports, and the exit-code decision."""

from __future__ import annotations

import json

from cudadoctor.smoke import render
from cudadoctor.smoke.harness import EXIT_FAILED, EXIT_PASSED, EXIT_SKIPPED, _finish


def _cell(op, tool, status, errors=None, cases=1, bad=0, detail=None):
    cs = [{"case": f"{op}/c{i}", "op": op, "status": "fail" if i < bad else "pass"} for i in range(cases)]
    return {"op": op, "tool": tool, "status": status, "errors": errors, "warnings": 0, "returncode": 0,
            "detail": detail, "reports": ["Invalid __global__ write of size 4 bytes"] if errors else [], "cases": cs}


def _report(results, checks=None, findings=None, skipped=None):
    rep = {"schema": "cudadoctor.smoke/1", "target": {"package": "pkg", "wheel": "/d/pkg-0.1-cp311-cp311-linux_x86_64.whl",
                                                     "version": "0.1"},
           "runtime": {"torch": "2.11.0+cu130", "cuda": "13.0", "cxx11_abi": True, "python": "3.11.7",
                       "gpus": [{"index": 0, "name": "NVIDIA H200", "cc": "9.0"}]},
           "checks": checks or [{"name": "import", "ok": True, "detail": "ok"}], "findings": findings or [],
           "tools": ["memcheck", "racecheck"], "ops": sorted({r["op"] for r in results}, key=lambda o: o != "bn"),
           "results": results, "skipped": skipped or []}
    return _finish(rep, 0.0)


def test_table_op_by_tool_with_counts():
    rep = _report([
        _cell("bn", "run", "pass", cases=3), _cell("bn", "memcheck", "pass", errors=0), _cell("bn", "racecheck", "pass", errors=0),
        _cell("oob", "run", "pass"), _cell("oob", "memcheck", "fail", errors=2, detail="2 errors"),
        _cell("oob", "racecheck", "fail", errors=3),
    ])
    lines = render.table(rep)
    assert lines[0].split() == ["op", "run", "memcheck", "racecheck"]
    assert set(lines[1].replace(" ", "")) == {"-"}
    assert lines[2].split("  ")[0] == "bn"
    assert "pass (3 cases)" in lines[2] and "pass (0 errors)" in lines[2] and "pass (0 hazards)" in lines[2]
    assert "FAIL (2 errors)" in lines[3] and "FAIL (3 hazards)" in lines[3]
    # columns line up
    assert lines[2].index("pass (0 errors)") == lines[0].index("memcheck") == lines[3].index("FAIL (2 errors)")
    assert rep["exit_code"] == EXIT_FAILED and rep["status"] == "fail"


def test_cell_texts():
    assert render.cell_text(_cell("x", "run", "fail", cases=4, bad=2)) == "FAIL (2 cases)"
    assert render.cell_text(_cell("x", "memcheck", "fail", errors=1)) == "FAIL (1 error)"
    assert render.cell_text(_cell("x", "racecheck", "fail", errors=1)) == "FAIL (1 hazard)"
    assert render.cell_text(_cell("x", "memcheck", "fail", errors=0)) == "FAIL (wrong result)"
    assert render.cell_text(_cell("x", "initcheck", "crash")) == "CRASH"
    assert render.cell_text(_cell("x", "run", "timeout")) == "TIMEOUT"
    assert render.cell_text(_cell("x", "synccheck", "skipped")) == "skipped"
    assert render.cell_text(None) == "-"


def test_human_lists_findings_with_fixes_problems_and_closing_line():
    finding = {"id": "EXT_NO_KERNEL_IMAGE", "severity": "error", "title": "_C.so has no kernel image for NVIDIA H200 (cc 9.0)",
               "detail": "carries sm_80", "fix": ['export TORCH_CUDA_ARCH_LIST="9.0+PTX"']}
    rep = _report([_cell("bn", "run", "fail", cases=2, bad=2, detail="bn/c0: error: no kernel image"),
                   _cell("bn", "memcheck", "skipped")],
                  checks=[{"name": "archs", "ok": False, "detail": "predicted 'no kernel image'"}],
                  findings=[finding], skipped=["memcheck: no kernel image for this GPU (predicted above)"])
    rep["prediction_confirmed"] = True
    out = render.human(rep)
    assert "✗ archs" in out and "✗ EXT_NO_KERNEL_IMAGE: _C.so has no kernel image" in out
    assert 'fix: export TORCH_CUDA_ARCH_LIST="9.0+PTX"' in out
    assert "prediction confirmed" in out
    assert "✗ bn / run: bn/c0: error: no kernel image" in out
    assert out.rstrip().splitlines()[-1].startswith("FAIL (exit 1): failed checks: archs")
    plain = render.human(rep, ascii_only=True)
    assert "✗" not in plain and "x archs" in plain


def test_exit_codes_pass_skip_fail():
    ok = _report([_cell("bn", "run", "pass"), _cell("bn", "memcheck", "pass", errors=0)])
    assert (ok["status"], ok["exit_code"]) == ("pass", EXIT_PASSED)
    skipped = _report([], skipped=["no GPU: torch sees no CUDA device"])
    assert (skipped["status"], skipped["exit_code"]) == ("skipped", EXIT_SKIPPED)
    # a failure wins over a skip
    both = _report([], checks=[{"name": "manifest", "ok": False}], skipped=["no GPU"])
    assert both["exit_code"] == EXIT_FAILED
    # an error finding alone fails
    f = _report([], findings=[{"id": "EXT_ABI_MISMATCH", "severity": "error", "title": "t"}])
    assert f["exit_code"] == EXIT_FAILED
    # a skipped cell next to passing ones still means "skipped"
    part = _report([_cell("bn", "run", "pass"), _cell("bn", "memcheck", "skipped")], skipped=["memcheck: not found"])
    assert part["exit_code"] == EXIT_SKIPPED


def test_json_round_trips_and_keeps_the_schema():
    rep = _report([_cell("bn", "run", "pass")])
    back = json.loads(render.as_json(rep))
    assert back["schema"] == "cudadoctor.smoke/1" and back["exit_code"] == 0
    assert back["results"][0]["cases"][0]["case"] == "bn/c0"


def test_human_names_the_case_a_sanitizer_report_came_from():
    cell = _cell("oob", "memcheck", "fail", errors=1, detail="1 error: Invalid __global__ write of size 4 bytes")
    cell["cases"][0]["sanitizer_reports"] = ["Invalid __global__ write of size 4 bytes"]
    out = render.human(_report([_cell("oob", "run", "pass"), cell]))
    assert "during oob/c0: Invalid __global__ write of size 4 bytes" in out
