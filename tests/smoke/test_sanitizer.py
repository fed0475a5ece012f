"""compute-sanitizer: command line, tool list, and reading its verdict from outputs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from cudadoctor.errors import InputError
from cudadoctor.runner import Result
from cudadoctor.smoke import sanitizer as S
from cudadoctor.smoke.harness import judge_run

OUT = Path(__file__).parent / "sanitizer_outputs"

# file, tool, errors, warnings, summaries, first report head (prefix) or None, tool failure
PARSE = [
    ("memcheck_clean.txt", "memcheck", 0, 0, 1, None, False),
    ("memcheck_oob_write.txt", "memcheck", 1, 0, 1, "Invalid __global__ write of size 4 bytes", False),
    ("memcheck_two_processes.txt", "memcheck", 3, 0, 2, "Invalid __global__ read of size 8 bytes", False),
    ("memcheck_no_kernel_image.txt", "memcheck", 1, 0, 1, "Program hit cudaErrorNoKernelImageForDevice", False),
    ("racecheck_clean.txt", "racecheck", 0, 0, 1, None, False),
    ("racecheck_race.txt", "racecheck", 2, 1, 1, "Error: Race reported between Write access", False),
    ("initcheck_uninit.txt", "initcheck", 1, 0, 1, "Uninitialized __global__ memory read", False),
    ("synccheck_clean.txt", "synccheck", 0, 0, 1, None, False),
    ("sanitizer_no_process.txt", "memcheck", None, 0, 0, "Error: No attachable process found", True),
]


@pytest.mark.parametrize("name,tool,errors,warnings,summaries,head,failed", PARSE)
def test_parse_outputs(name, tool, errors, warnings, summaries, head, failed):
    v = S.parse_output((OUT / name).read_text(), tool)
    assert v.errors == errors
    assert v.warnings == warnings
    assert v.summaries == summaries
    if head is None:
        assert v.reports == []
    else:
        assert v.reports and v.reports[0].startswith(head)
    assert (v.tool_failure is not None) is failed
    assert v.clean is (errors == 0 and not failed)


def test_report_heads_skip_indented_detail_lines_and_dedupe():
    v = S.parse_output((OUT / "memcheck_two_processes.txt").read_text(), "memcheck")
    # two identical global-read reports collapse to one head; "Address ..." detail lines are not heads
    assert v.reports == ["Invalid __global__ read of size 8 bytes at kern(double *)",
                         "Invalid __shared__ write of size 4 bytes at kern2(float *)"]
    v = S.parse_output((OUT / "memcheck_oob_write.txt").read_text(), "memcheck")
    assert not any(r.startswith("Address") for r in v.reports)


def test_race_hazard_counts_use_the_summary_not_the_per_report_totals():
    v = S.parse_output((OUT / "racecheck_race.txt").read_text(), "racecheck")
    assert v.errors == 2  # "2 hazards displayed", not 7936 + 248
    assert any("Warning: Race reported" in r for r in v.reports)


def test_singular_and_legacy_forms():
    assert S.parse_output("========= ERROR SUMMARY: 1 error\n", "initcheck").errors == 1
    assert S.parse_output("========= RACECHECK SUMMARY: 1 hazard displayed (1 error, 0 warnings)\n",
                          "racecheck").errors == 1
    # racecheck without its own summary line falls back to ERROR SUMMARY
    assert S.parse_output("========= ERROR SUMMARY: 4 errors\n", "racecheck").errors == 4
    assert S.parse_output("", "memcheck").errors is None


def test_argv_follows_children_and_sets_the_error_exit_code():
    argv = S.sanitizer_argv("/cs", "racecheck", ["python3", "child.py", "run"])
    assert argv[:2] == ["/cs", "--tool"] and argv[2] == "racecheck"
    assert argv[argv.index("--error-exitcode") + 1] == str(S.ERROR_EXITCODE)
    assert argv[argv.index("--target-processes") + 1] == "all"
    assert argv[argv.index("--print-limit") + 1] == "20"
    assert int(argv[argv.index("--launch-timeout") + 1]) >= 60
    assert argv[-3:] == ["python3", "child.py", "run"]
    with pytest.raises(ValueError):
        S.sanitizer_argv("/cs", "leakcheck", ["x"])


def test_sanitizer_env_turns_the_caching_allocator_off():
    env = S.sanitizer_env({"PATH": "/bin"})
    assert env["PYTORCH_NO_CUDA_MEMORY_CACHING"] == "1" and env["PATH"] == "/bin"


@pytest.mark.parametrize("text,want", [
    (None, list(S.TOOLS)), ("all", list(S.TOOLS)), ("none", []), ("", []),
    ("memcheck,racecheck", ["memcheck", "racecheck"]), ("synccheck memcheck synccheck", ["synccheck", "memcheck"]),
])
def test_parse_tools(text, want):
    assert S.parse_tools(text) == want


def test_parse_tools_refuses_unknown_tool_naming_it():
    with pytest.raises(InputError) as e:
        S.parse_tools("memcheck,leakcheck")
    assert "'leakcheck'" in str(e.value) and "racecheck" in str(e.value)


def test_find_sanitizer_from_path_and_cuda_home(tmp_path):
    bin_dir = tmp_path / "cuda" / "bin"
    bin_dir.mkdir(parents=True)
    exe = bin_dir / "compute-sanitizer"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    assert S.find_sanitizer({"PATH": str(bin_dir)}) == str(exe)
    assert S.find_sanitizer({"PATH": str(tmp_path), "CUDA_HOME": str(tmp_path / "cuda")}) == str(exe)
    empty = tmp_path / "empty"
    empty.mkdir()
    found = S.find_sanitizer({"PATH": str(empty), "CUDA_HOME": str(empty)})
    assert found is None or os.path.basename(found) == "compute-sanitizer"  # /usr/local/cuda may have one


# --- one table cell from a finished child -------------------------------------------------------

def _res(name: str, rc: int | None, error: str | None = None) -> Result:
    return Result(("compute-sanitizer",), rc, (OUT / name).read_text(), "", error)


def test_cell_memcheck_error_fails_even_when_values_are_right():
    cell = judge_run("oob_write", "memcheck", _res("memcheck_oob_write.txt", 99), ["oob_write/basic"])
    assert cell["status"] == "fail" and cell["errors"] == 1
    assert cell["cases"][0]["status"] == "pass"
    assert cell["cases"][0]["sanitizer_reports"] == [
        "Invalid __global__ write of size 4 bytes at planted_bugs::oob_write_kernel(const float *, float *, long) "
        "(/src/csrc/kernels.cu:14)"]
    assert "1 error" in cell["detail"] and "Invalid __global__ write" in cell["detail"]


def test_cell_racecheck_hazards():
    cell = judge_run("smem_race", "racecheck", _res("racecheck_race.txt", 99), ["smem_race/basic"])
    assert cell["status"] == "fail" and cell["errors"] == 2 and cell["warnings"] == 1
    assert cell["detail"].startswith("2 hazards")


def test_cell_clean_run_passes():
    cell = judge_run("batch_norm", "memcheck", _res("memcheck_clean.txt", 0), ["batch_norm/train_fwd"])
    assert cell["status"] == "pass" and cell["errors"] == 0


def test_cell_clean_summary_but_target_crashed_is_not_a_pass():
    cell = judge_run("depthwise_conv2d", "racecheck", _res("racecheck_clean.txt", -11),
                     ["depthwise_conv2d/fwd_3x3", "depthwise_conv2d/bwd_3x3"])
    assert cell["status"] == "crash" and "signal 11" in cell["detail"] and "bwd_3x3" in cell["detail"]


def test_cell_missing_case_after_clean_summary_is_a_crash():
    cell = judge_run("batch_norm", "memcheck", _res("memcheck_clean.txt", 1),
                     ["batch_norm/train_fwd", "batch_norm/train_bwd"])
    assert cell["status"] == "crash" and "batch_norm/train_bwd" in cell["detail"]


def test_cell_tool_failure_and_missing_summary_are_errors():
    cell = judge_run("x", "memcheck", _res("sanitizer_no_process.txt", 1), [])
    assert cell["status"] == "error" and "No attachable process" in cell["detail"]
    cell = judge_run("x", "synccheck", Result(("cs",), 0, "nothing useful\n", ""), [])
    assert cell["status"] == "error" and "no compute-sanitizer summary" in cell["detail"]


def test_cell_timeout():
    r = Result(("cs",), None, (OUT / "memcheck_clean.txt").read_text(), "", "compute-sanitizer: timed out after 30s")
    cell = judge_run("batch_norm", "memcheck", r, ["batch_norm/train_fwd", "batch_norm/train_bwd"])
    assert cell["status"] == "timeout" and "batch_norm/train_bwd" in cell["detail"]


def test_cell_api_error_no_kernel_image_counts():
    cell = judge_run("batch_norm", "memcheck", _res("memcheck_no_kernel_image.txt", 99), ["batch_norm/train_fwd"])
    assert cell["status"] == "fail" and cell["errors"] == 1
    assert "cudaErrorNoKernelImageForDevice" in cell["detail"]


def test_reports_are_tied_to_the_case_that_was_running():
    from cudadoctor.smoke.harness import RESULT_PREFIX

    text = "\n".join([
        "========= COMPUTE-SANITIZER",
        "========= Program hit cudaErrorInvalidValue (error 1) on CUDA API call to cudaFoo.",  # start-up
        RESULT_PREFIX + '{"begin": "bn/fwd"}',
        RESULT_PREFIX + '{"case": "bn/fwd", "op": "bn", "status": "pass"}',
        RESULT_PREFIX + '{"begin": "bn/bwd"}',
        "========= Invalid __global__ read of size 4 bytes",
        "=========     at bwd_kernel+0x10",
        "========= Invalid __global__ read of size 4 bytes",
        "=========     at bwd_kernel+0x24",
        RESULT_PREFIX + '{"case": "bn/bwd", "op": "bn", "status": "pass"}',
        "========= ERROR SUMMARY: 3 errors",
    ])
    by_case = S.reports_by_case(text, RESULT_PREFIX)
    assert by_case == {"": ["Program hit cudaErrorInvalidValue (error 1) on CUDA API call to cudaFoo."],
                       "bn/bwd": ["Invalid __global__ read of size 4 bytes at bwd_kernel"]}
    cell = judge_run("bn", "memcheck", Result(("cs",), 99, text, ""), ["bn/fwd", "bn/bwd"])
    assert [c.get("sanitizer_reports") for c in cell["cases"]] == [None, ["Invalid __global__ read of size 4 bytes at bwd_kernel"]]
    assert cell["errors"] == 3 and cell["status"] == "fail"
