"""The local backend: the doctor's blocking findings refuse, TOOLKIT_INCOMPLETE is fixed, and (when
this machine has nvcc and a CUDA torch) a real local build of the small fixture extension."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cudadoctor.build import local_backend as L
from cudadoctor.build import plan as P
from cudadoctor.build.execute import BuildRequest, make_plans
from cudadoctor.errors import RefusedError

FIX = Path(__file__).resolve().parents[1] / "fixtures"


def report(*findings):
    return {"findings": list(findings)}


def finding(id, severity="error", area="toolkit", fix=None):
    return {"id": id, "severity": severity, "area": area, "title": f"{id} title", "fix": fix or [f"fix for {id}"]}


def test_blocking_findings_pick_build_relevant_errors():
    rep = report(
        finding("NVCC_TORCH_MAJOR_MISMATCH"),
        finding("HOST_COMPILER_UNSUPPORTED", area="compiler"),
        finding("TOOLKIT_INCOMPLETE"),  # fixed automatically, never blocking
        finding("DRIVER_TOO_OLD", area="driver"),  # a runtime problem, not a build problem
        finding("NVCC_TORCH_MINOR_MISMATCH", severity="warning"),
        finding("TORCH_CPU_ONLY", area="torch"),
    )
    ids = [f["id"] for f in L.blocking_findings(rep)]
    assert ids == ["NVCC_TORCH_MAJOR_MISMATCH", "HOST_COMPILER_UNSUPPORTED", "TORCH_CPU_ONLY"]


def test_make_plans_refuses_with_the_finding(tmp_path):
    req = BuildRequest(source=str(FIX / "ext_min"), specs=[P.TargetSpec(arch="8.6")], backend="local",
                       out=str(tmp_path))
    rep = report(finding("HOST_COMPILER_UNSUPPORTED", area="compiler", fix=["export CUDAHOSTCXX=/usr/bin/g++-12"]))
    with pytest.raises(RefusedError) as e:
        make_plans(req, facts={}, report=rep)
    msg = str(e.value)
    assert "HOST_COMPILER_UNSUPPORTED" in msg and "CUDAHOSTCXX=/usr/bin/g++-12" in msg
    assert e.value.exit_code == 1


def test_local_uses_installed_torch_and_host_nvcc(tmp_path):
    facts = {"torch": {"version": "2.14.1+cu130", "cuda": "13.0"}, "host_compiler": {"name": "gcc", "version": "12.2.0"},
             "toolkits": [{"root": "/usr/local/cuda", "nvcc": "13.0.88"}]}
    base = dict(source=str(FIX / "ext_min"), backend="local", out=str(tmp_path))
    plans = make_plans(BuildRequest(specs=[P.TargetSpec(arch="8.6,8.9")], **base), facts=facts, report=report())
    assert plans[0].target.torch == "2.14.1" and plans[0].target.local_label == "cu130torch2.14"
    with pytest.raises(RefusedError, match="builds against the torch installed here"):
        make_plans(BuildRequest(specs=[P.TargetSpec(arch="8.6", torch="2.10")], **base), facts=facts, report=report())
    old = dict(facts, toolkits=[{"root": "/usr/local/cuda-12.6", "nvcc": "12.6.85"}])
    with pytest.raises(RefusedError, match="sm_100"):
        make_plans(BuildRequest(specs=[P.TargetSpec(arch="10.0")], **base), facts=old, report=report())
    gcc = dict(facts, host_compiler={"name": "gcc", "version": "99.1"})
    with pytest.raises(RefusedError, match="rejects g\\+\\+ 99"):
        make_plans(BuildRequest(specs=[P.TargetSpec(arch="8.6")], **base), facts=gcc, report=report())


def test_toolkit_incomplete_fix_adds_cpath(tmp_path):
    site = tmp_path / "site"
    inc = site / "nvidia" / "cu13" / "include"
    inc.mkdir(parents=True)
    (inc / "cusparse.h").write_text("")
    assert L.nvidia_include_dirs("13.0", [str(site)]) == [str(inc)]
    cuda12 = tmp_path / "site12"
    for lib in ("cusparse", "cublas"):
        (cuda12 / "nvidia" / lib / "include").mkdir(parents=True)
    assert L.nvidia_include_dirs("12.6", [str(cuda12)]) == [
        str(cuda12 / "nvidia" / "cusparse" / "include"), str(cuda12 / "nvidia" / "cublas" / "include")]

    plan = P.make_plan(P.TargetSpec(arch="8.6"), source="/s", out="/o", backend="local")
    toolkit = tmp_path / "cuda"
    (toolkit / "include").mkdir(parents=True)  # no cusparse.h
    facts = {"toolkits": [{"root": str(toolkit), "nvcc": "13.0.88"}]}
    import sys as _sys

    old_path = list(_sys.path)
    _sys.path.insert(0, str(site))
    try:
        env, notes = L.local_env(plan, facts, report(finding("TOOLKIT_INCOMPLETE")), {"CPATH": "/keep"})
    finally:
        _sys.path[:] = old_path
    assert env["CUDA_HOME"] == str(toolkit)
    assert env["CPATH"] == f"{inc}:/keep"
    assert env["TORCH_CUDA_ARCH_LIST"] == "8.6"
    assert any("TOOLKIT_INCOMPLETE fixed" in n for n in notes)


def _local_toolchain() -> str | None:
    nvcc = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else None)
    if not nvcc:
        return "no nvcc on this machine"
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.version.cuda:
        return "torch is a CPU build"
    return None


@pytest.mark.compile
def test_local_build_of_fixture(tmp_path):
    why = _local_toolchain()
    if why:
        pytest.skip(why)
    out = tmp_path / "dist"
    src = tmp_path / "ext_min"
    shutil.copytree(FIX / "ext_min", src)
    argv = [sys.executable, "-m", "cudadoctor", "build", str(src), "--backend", "local", "--arch", "8.6",
            "--out", str(out), "--work-dir", str(tmp_path / "work")]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=1800)
    if r.returncode == 1 and "the host toolchain cannot build this" in r.stderr:
        assert not list(out.glob("*.whl"))
        pytest.skip("this host has a blocking finding: " + r.stderr.strip().splitlines()[-1][:300])
    assert r.returncode == 0, r.stderr[-3000:]
    wheel = next(out.glob("*.whl"))
    assert "+cu" in wheel.name and "torch" in wheel.name
    from cudadoctor.build.manifest import read_manifest

    m = read_manifest(wheel)
    assert m["backend"] == "local" and m["toolkit"] == "host"
    assert all(v["sass"] == ["sm_86"] for v in m["shared_objects"].values())
    assert sorted(m["load_check"]["checked"]) == sorted(m["shared_objects"]), m["load_check"]
    assert json.dumps(m)

    # nothing changed: up to date, no toolchain check, no compiler
    again = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and "up to date" in again.stderr, again.stderr[-2000:]
    assert "checking the host toolchain" not in again.stderr
    # a changed source builds again
    (src / "csrc" / "scale.cu").write_text((src / "csrc" / "scale.cu").read_text() + "\n// changed\n")
    changed = subprocess.run(argv, capture_output=True, text=True, timeout=1800)
    assert changed.returncode == 0, changed.stderr[-3000:]
    assert "up to date" not in changed.stderr and "1 file(s) changed" in changed.stderr


def test_fingerprint_ignores_jobs_and_output_folder(tmp_path):
    from cudadoctor.build.execute import fingerprint

    a = P.make_plan(P.TargetSpec(arch="8.6,8.9"), source="/s", out="/o1", backend="local", cores=2, mem_gib=20)
    b = P.make_plan(P.TargetSpec(arch="8.6,8.9"), source="/s", out="/o2", backend="local", cores=16, mem_gib=3)
    assert dict(a.env)["MAX_JOBS"] != dict(b.env)["MAX_JOBS"]
    assert fingerprint(a, "h") == fingerprint(b, "h")
    c = P.make_plan(P.TargetSpec(arch="8.6"), source="/s", out="/o1", backend="local")
    d = P.make_plan(P.TargetSpec(arch="8.6,8.9"), source="/s", out="/o1", backend="local", compress=False)
    assert len({repr(fingerprint(x, "h")) for x in (a, c, d)}) == 3
    assert fingerprint(a, "h") != fingerprint(a, "other source")


def test_host_check_waits_for_a_slow_first_torch_import(monkeypatch):
    """The build imports torch itself, so its host check must not refuse a torch that is only slow to
    import (a cold disk cache right after installing it): it waits far longer than `check`'s 20 s."""
    import cudadoctor.probes as probes

    seen = {}
    monkeypatch.setattr(probes, "collect_facts", lambda *a, **k: seen.update(k) or {})
    assert L.host_facts() == {}
    assert seen["torch_timeout"] == L.HOST_TORCH_TIMEOUT >= 180


OOM_LOG = ["[1/3] /usr/local/cuda/bin/nvcc -c kernels.cu -o kernels.cuda.o",
           "nvcc error   : 'cicc' died due to signal 9 (Kill signal)",
           "ninja: build stopped: subcommand failed."]


def test_explain_failure_reads_the_log_like_check_error():
    from cudadoctor.build.execute import explain_failure

    hint = explain_failure("\n".join(OOM_LOG), facts={"host": {"cpus": 8, "mem_available_gib": 6.0}}, jobs=6)
    assert hint.startswith("the build's cicc was killed for memory") and "--jobs 3" in hint and "ran 6 job(s)" in hint
    hint = explain_failure("all.h:5:2: error: #error C++20 or later compatible compiler is required to use PyTorch.")
    assert "(CXX_STANDARD_TOO_OLD). Fix: setup.py: remove any '-std=c++NN'" in hint
    hint = explain_failure("torch/csrc/python_headers.h:12:10: fatal error: Python.h: No such file or directory",
                           facts={"python": {"version": "3.11.2", "executable": "/usr/bin/python3"}})
    assert "(PYTHON_HEADERS_MISSING). Fix: sudo apt-get install -y python3.11-dev" in hint
    assert explain_failure("kernels.cu(12): error: identifier \"foo\" is undefined") is None


def test_failed_local_build_hint_is_the_doctors_reading_of_its_log(tmp_path, monkeypatch):
    from rich.console import Console

    from cudadoctor.build import execute as X
    from cudadoctor.build.docker_backend import BuildFailed

    def failing_build(plan, *, work_dir, staging, progress, env, python=None):
        for line in OOM_LOG:
            progress.write(line)
        raise BuildFailed(1)

    monkeypatch.setattr(L, "build", failing_build)
    facts = {"torch": {"version": "2.14.1+cu130", "cuda": "13.0"}, "host_compiler": {"name": "gcc", "version": "12.2.0"},
             "toolkits": [{"root": "/usr/local/cuda", "nvcc": "13.0.88"}]}
    req = BuildRequest(source=str(FIX / "ext_min"), specs=[P.TargetSpec(arch="8.6")], backend="local",
                       out=str(tmp_path / "out"), work_root=str(tmp_path / "work"), jobs=4)
    plan = make_plans(req, facts=facts, report=report())[0]
    with pytest.raises(RefusedError) as e:
        X.run_plan(plan, req, Console(file=open(os.devnull, "w")), local_env=dict(os.environ), facts=facts)
    assert "'cicc' died due to signal 9" in str(e.value)
    assert e.value.hint.startswith("the build's cicc was killed for memory (BUILD_OUT_OF_MEMORY)")
    assert "run it again with --jobs 2" in e.value.hint
