"""The GPU path of run_smoke without a GPU: a runner that answers the child processes (probe, plain
runs, compute-sanitizer runs) the way they answer on a GPU machine, and does the pip install for real."""

from __future__ import annotations

import json

import pytest

from cudadoctor.runner import Result, Runner
from cudadoctor.smoke import EXIT_FAILED, EXIT_PASSED, SmokeRequest, run_smoke
from cudadoctor.smoke import sanitizer as S
from cudadoctor.smoke.harness import CHILD, RESULT_PREFIX

from smoke_wheels import PASSING_CASES, make_wheel, package_files

torch = pytest.importorskip("torch")
TORCH = {"torch": torch.__version__.split("+")[0], "cuda": torch.version.cuda,
         "cxx11_abi": bool(torch._C._GLIBCXX_USE_CXX11_ABI)}
H200 = {"index": 0, "name": "NVIDIA H200", "cc": "9.0"}
CASES = {"double": ["double/basic", "double/grad"], "square": ["square/basic"]}
FAKE_SANITIZER = "/opt/fake/compute-sanitizer"


class GpuMachine(Runner):
    """Answers the smoke children as a one-GPU machine would; everything else runs for real."""

    def __init__(self, *, case_status=None, summaries=None, torch_devices=(H200,)):
        super().__init__()
        self.torch_devices = list(torch_devices)
        self.calls: list[tuple[tuple[str, ...], dict]] = []
        self.case_status = case_status or {}  # op -> (status, detail)
        self.summaries = summaries or {}  # (op, tool) -> sanitizer summary text

    def run(self, argv, *, timeout=None, env=None, input=None):
        argv = tuple(str(a) for a in argv)
        if CHILD not in argv:
            if argv[0] == "nvidia-smi":
                return Result(argv, 0, "0, NVIDIA H200, 9.0, 580.95.05\n", "")
            return super().run(argv, timeout=timeout, env=env, input=input)
        self.calls.append((argv, dict(env or {})))
        i = argv.index(CHILD)
        mode, package = argv[i + 1], argv[argv.index("--package") + 1]
        if mode == "probe":
            probe = {"python": "3.11.7", "torch": {"version": torch.__version__, "cuda": torch.version.cuda,
                                                    "cxx11_abi": TORCH["cxx11_abi"]},
                     "package": package, "import_error": None, "file": f"{env['PYTHONPATH'].split(':')[0]}/{package}/__init__.py",
                     "cases": [{"name": c, "op": op} for op, cs in CASES.items() for c in cs],
                     "cases_error": None, "devices": self.torch_devices, "device_error": None}
            return Result(argv, 0, json.dumps(probe) + "\n", "")
        op = argv[argv.index("--op") + 1]
        tool = argv[argv.index("--tool") + 1] if argv[0] == FAKE_SANITIZER else "run"
        status, detail = self.case_status.get(op, ("pass", None))
        out = "".join(RESULT_PREFIX + json.dumps({"case": c, "op": op, "status": status, "detail": detail}) + "\n"
                      for c in CASES[op])
        rc = 0 if status == "pass" else 1
        if tool != "run":
            summary = self.summaries.get((op, tool))
            if summary is None:
                summary = ("========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)\n"
                           if tool == "racecheck" else "========= ERROR SUMMARY: 0 errors\n")
            out = "========= COMPUTE-SANITIZER\n" + out + summary
            if " 0 errors" not in summary and " 0 hazards" not in summary:
                rc = S.ERROR_EXITCODE
        return Result(argv, rc, out, "")


@pytest.fixture
def sanitizer_here(monkeypatch):
    monkeypatch.setattr(S, "find_sanitizer", lambda env=None: FAKE_SANITIZER)


def test_every_op_runs_plainly_and_under_each_tool(tmp_path, sanitizer_here):
    whl = make_wheel(tmp_path, files=package_files(cases=PASSING_CASES, so="libkern_sm86_sm89_ptx89.so"), manifest=TORCH)
    machine = GpuMachine()
    rep = run_smoke(SmokeRequest(wheel=str(whl), jobs=2), runner=machine)
    assert rep["exit_code"] == EXIT_PASSED and rep["status"] == "pass", rep
    assert rep["runtime"]["gpus"] == [H200]
    assert rep["verdicts"][0]["via"] == "ptx"  # compute_89 JIT-compiled on 9.0
    assert {(r["op"], r["tool"]) for r in rep["results"]} == {(op, t) for op in CASES for t in ["run", *S.TOOLS]}
    runs = [(argv, env) for argv, env in machine.calls if "run" in argv]
    assert len(runs) == 2 * 5
    for argv, env in runs:
        assert env["PYTHONPATH"].startswith(rep["target"]["installed_to"])
        if argv[0] == FAKE_SANITIZER:
            assert env["PYTORCH_NO_CUDA_MEMORY_CACHING"] == "1"
            assert argv[argv.index("--target-processes") + 1] == "all"
            assert argv[argv.index("--error-exitcode") + 1] == "99"
        else:
            assert "PYTORCH_NO_CUDA_MEMORY_CACHING" not in env or env.get("PYTORCH_NO_CUDA_MEMORY_CACHING") != "1"
        assert argv[argv.index("--device") + 1] == "cuda:0"


def test_sanitizer_errors_fail_the_cell_and_the_run(tmp_path, sanitizer_here):
    whl = make_wheel(tmp_path, files=package_files(cases=PASSING_CASES), manifest=TORCH)
    machine = GpuMachine(summaries={
        ("square", "memcheck"): "========= Invalid __global__ write of size 4 bytes\n========= ERROR SUMMARY: 3 errors\n",
        ("double", "racecheck"): "========= RACECHECK SUMMARY: 1 hazard displayed (1 error, 0 warnings)\n"})
    rep = run_smoke(SmokeRequest(wheel=str(whl), jobs=3), runner=machine)
    assert rep["exit_code"] == EXIT_FAILED
    cells = {(r["op"], r["tool"]): r for r in rep["results"]}
    assert (cells[("square", "memcheck")]["status"], cells[("square", "memcheck")]["errors"]) == ("fail", 3)
    assert (cells[("double", "racecheck")]["status"], cells[("double", "racecheck")]["errors"]) == ("fail", 1)
    assert cells[("square", "run")]["status"] == "pass" and cells[("double", "initcheck")]["status"] == "pass"


def test_predicted_no_kernel_image_is_confirmed_by_the_plain_run_and_tools_are_skipped(tmp_path, sanitizer_here):
    whl = make_wheel(tmp_path, files=package_files(cases=PASSING_CASES, so="libkern_sm87.so"), manifest=TORCH)
    err = "RuntimeError: CUDA error: no kernel image is available for execution on the device"
    machine = GpuMachine(case_status={"double": ("error", err), "square": ("error", err)})
    rep = run_smoke(SmokeRequest(wheel=str(whl)), runner=machine)
    assert rep["exit_code"] == EXIT_FAILED
    assert [f["id"] for f in rep["findings"]] == ["EXT_NO_KERNEL_IMAGE"]
    assert "NVIDIA H200 (cc 9.0)" in rep["findings"][0]["title"]
    assert rep["prediction_confirmed"] is True
    tools = {r["status"] for r in rep["results"] if r["tool"] != "run"}
    assert tools == {"skipped"}
    assert not any(argv[0] == FAKE_SANITIZER for argv, _ in machine.calls)  # nothing ran under a sanitizer


def test_missing_sanitizer_skips_tools_but_runs_the_cases(tmp_path, monkeypatch):
    monkeypatch.setattr(S, "find_sanitizer", lambda env=None: None)
    whl = make_wheel(tmp_path, files=package_files(cases=PASSING_CASES), manifest=TORCH)
    rep = run_smoke(SmokeRequest(wheel=str(whl), tools=["memcheck"]), runner=GpuMachine())
    assert rep["exit_code"] == 3 and rep["status"] == "skipped"
    assert {r["status"] for r in rep["results"] if r["tool"] == "run"} == {"pass"}
    assert any("compute-sanitizer not found" in s for s in rep["skipped"])


def test_torch_without_devices_on_a_gpu_machine_is_skipped_but_judged_against_the_driver_gpus(tmp_path, sanitizer_here):
    whl = make_wheel(tmp_path, files=package_files(cases=PASSING_CASES, so="libkern_sm87.so"), manifest=TORCH)
    machine = GpuMachine(torch_devices=())
    rep = run_smoke(SmokeRequest(wheel=str(whl)), runner=machine)
    assert rep["runtime"]["gpus"][0]["source"] == "nvidia-smi"
    assert [f["id"] for f in rep["findings"]] == ["EXT_NO_KERNEL_IMAGE"]  # judged for the H200 nvidia-smi lists
    assert any("nvidia-smi lists NVIDIA H200" in s for s in rep["skipped"])
    assert rep["results"] == [] and rep["exit_code"] == EXIT_FAILED
    assert not any("run" in argv for argv, _ in machine.calls)


def test_interrupt_ends_the_running_children(tmp_path):
    import os
    import subprocess
    import sys
    import time

    from cudadoctor.smoke.harness import _kill_children

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    time.sleep(0.2)
    _kill_children()
    assert child.wait(timeout=10) == -9
    assert os.getpid()  # this process is still here
