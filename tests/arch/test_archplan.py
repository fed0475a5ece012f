"""Arch plans against recorded nvcc / nvidia-smi output (FakeRunner), and the env exports."""

import os
import subprocess
import sys

import pytest

from cudadoctor.archplan import Nvcc, make_plan, present_gpus, probe_nvcc
from cudadoctor.envcmd import EnvPlan, EnvVar, header_fix_dirs, max_jobs, render
from cudadoctor.errors import InputError, RefusedError
from cudadoctor.runner import FakeRunner

NV130 = "nvcc: NVIDIA (R) Cuda compiler driver\nCuda compilation tools, release 13.0, V13.0.88\n"
NV121 = "Cuda compilation tools, release 12.1, V12.1.105\n"
NV118 = "Cuda compilation tools, release 11.8, V11.8.89\n"
CODES130 = "sm_75\nsm_80\nsm_86\nsm_87\nsm_88\nsm_89\nsm_90\nsm_100\nsm_110\nsm_103\nsm_120\nsm_121\n"


def nvcc_runner(version_text, codes=None, smi=None):
    r = {("/fake/nvcc", "--version"): (0, version_text)}
    r[("/fake/nvcc", "--list-gpu-code")] = (0, codes) if codes else (1, "", "nvcc fatal : Unknown option '--list-gpu-code'")
    if smi is not None:
        r["nvidia-smi"] = (0, smi)
    return FakeRunner(responses=r)


def nvcc(version_text, codes=None):
    return probe_nvcc(nvcc_runner(version_text, codes), "/fake/nvcc")


def test_probe_nvcc_reads_version_and_codes():
    n = nvcc(NV130, CODES130)
    assert n.version == "13.0.88" and "sm_120" in n.codes
    old = nvcc(NV118)
    assert old.version == "11.8.89" and old.codes is None


def test_unrunnable_explicit_nvcc_is_input_error():
    with pytest.raises(InputError):
        probe_nvcc(FakeRunner(), "/nope/nvcc")


@pytest.mark.parametrize(
    "spec,version,codes,needle",
    [
        ("12.0", NV121, None, "CUDA >= 12.8"),
        ("3.5", NV130, CODES130, "CUDA <= 11.8"),
        ("7.0", NV130, CODES130, "removed in CUDA 13.0"),
        ("8.6,7.0+PTX", NV130, None, "removed in CUDA 13.0"),  # table path, no --list-gpu-code
        ("9.0a", NV118, None, "CUDA >= 12.0"),
        ("10.0f", "release 12.8, V12.8.61", None, "CUDA >= 12.9"),
    ],
)
def test_refusals_name_the_nvcc_range(spec, version, codes, needle):
    with pytest.raises(RefusedError) as ei:
        make_plan(spec, nvcc=nvcc(version, codes), gpus=[])
    assert needle in str(ei.value)
    assert ei.value.exit_code == 1


def test_refusal_keeps_the_rest():
    with pytest.raises(RefusedError) as ei:
        make_plan("8.6;8.9;7.0", nvcc=nvcc(NV130, CODES130), gpus=[])
    assert "keeps 8.6;8.9" in str(ei.value)


def test_default_is_present_gpus_with_ptx_for_highest():
    gpus = [{"index": 0, "name": "NVIDIA GeForce RTX 3090", "cc": "8.6"},
            {"index": 1, "name": "NVIDIA GeForce RTX 4090", "cc": "8.9"}]
    plan = make_plan(None, nvcc=nvcc(NV130, CODES130), gpus=gpus)
    j = plan.to_json()
    assert j["torch_cuda_arch_list"] == "8.6;8.9+PTX"
    assert j["gencode"] == ["-gencode=arch=compute_86,code=sm_86", "-gencode=arch=compute_89,code=sm_89",
                            "-gencode=arch=compute_89,code=compute_89"]
    assert [(g["runs"], g["via"]) for g in j["gpus"]] == [(True, "sass"), (True, "sass")]


def test_gpu_verdicts_sass_ptx_none():
    gpus = [{"index": 0, "name": "A", "cc": "8.9"}, {"index": 1, "name": "H", "cc": "9.0"},
            {"index": 2, "name": "A100", "cc": "8.0"}]
    plan = make_plan("8.6,8.9+PTX", nvcc=nvcc(NV130, CODES130), gpus=gpus, driver="575.51.03")
    g = plan.to_json()["gpus"]
    assert (g[0]["runs"], g[0]["via"]) == (True, "sass")
    assert g[1]["via"] == "ptx" and g[1]["needs_driver"].startswith("580.")
    assert g[1]["runs"] is False and "12.9" in g[1]["note"]  # driver 575 = CUDA 12.9 < 13.0 PTX
    assert (g[2]["runs"], g[2]["via"]) == (False, None)


def test_no_gpu_no_spec_suggests_instead_of_crashing():
    plan = make_plan(None, nvcc=nvcc(NV130, CODES130), gpus=[])
    assert plan.suggested
    assert plan.torch_cuda_arch_list == "7.5;8.0;8.6;8.9;9.0;10.0;12.0+PTX"
    assert "No GPU found" in plan.notes[0]
    old = make_plan(None, nvcc=nvcc(NV118), gpus=[])
    assert old.torch_cuda_arch_list == "5.0;6.0;7.0;7.5;8.0;8.6;8.9;9.0+PTX"


def test_native_without_gpu_suggests():
    plan = make_plan("native", nvcc=nvcc(NV130, CODES130), gpus=[])
    assert plan.suggested and plan.items


def test_all_follows_list_gpu_code():
    plan = make_plan("all", nvcc=nvcc(NV130, CODES130), gpus=[])
    assert plan.torch_cuda_arch_list.split(";")[0] == "7.5"


def test_present_gpus_from_smi_and_name_fallback():
    smi = "0, NVIDIA H200, 9.0, 580.95.05\n1, Tesla T4, [N/A], 580.95.05\n"
    gpus, driver, err = present_gpus(nvcc_runner(NV130, smi=smi))
    assert [g["cc"] for g in gpus] == ["9.0", "7.5"] and driver == "580.95.05" and err is None
    gpus, driver, err = present_gpus(FakeRunner())
    assert gpus == [] and err


def test_header_fix_dirs(tmp_path):
    tk = tmp_path / "cuda"
    (tk / "include").mkdir(parents=True)
    (tk / "include" / "cuda_runtime.h").write_text("")
    site = tmp_path / "site"
    inc = site / "nvidia" / "cu13" / "include"
    inc.mkdir(parents=True)
    (inc / "cusparse.h").write_text("")
    (inc / "cublas_v2.h").write_text("")
    assert header_fix_dirs(str(tk), [str(site)]) == [str(inc)]
    (tk / "include" / "cusparse.h").write_text("")
    (tk / "include" / "cublas_v2.h").write_text("")
    assert header_fix_dirs(str(tk), [str(site)]) == []


def test_max_jobs():
    assert max_jobs(16, 10.0) == 3
    assert max_jobs(2, 22.0) == 2
    assert max_jobs(8, 1.0) == 1
    assert max_jobs(4, None) == 4


PLAN = EnvPlan([EnvVar("TORCH_CUDA_ARCH_LIST", "8.6;8.9+PTX", "why"), EnvVar("CPATH", "/a b/it's", "x")], ["a note"])


def test_render_every_shell():
    assert "export TORCH_CUDA_ARCH_LIST='8.6;8.9+PTX'" in render(PLAN, "bash")
    assert "set -gx TORCH_CUDA_ARCH_LIST '8.6;8.9+PTX'" in render(PLAN, "fish")
    assert "$env:CPATH = '/a b/it''s'" in render(PLAN, "pwsh")
    assert 'set "TORCH_CUDA_ARCH_LIST=8.6;8.9+PTX"' in render(PLAN, "cmd")
    gh = render(PLAN, "github")
    assert gh.splitlines() == ["TORCH_CUDA_ARCH_LIST=8.6;8.9+PTX", "CPATH=/a b/it's"]
    assert 'TORCH_CUDA_ARCH_LIST="8.6;8.9+PTX"' in render(PLAN, "dotenv")
    with pytest.raises(InputError):
        render(PLAN, "tcsh")


def test_bash_eval_of_rendered_plan_round_trips():
    out = subprocess.run(["bash", "-c", 'eval "$1"; printf "%s|%s" "$TORCH_CUDA_ARCH_LIST" "$CPATH"', "_",
                          render(PLAN, "bash")], capture_output=True, text=True, check=True)
    assert out.stdout == "8.6;8.9+PTX|/a b/it's"


def test_ptx_only_spec_is_noted():
    plan = make_plan("compute_86", nvcc=nvcc(NV130, CODES130), gpus=[])
    assert plan.gencode == ["-gencode=arch=compute_86,code=compute_86"]
    assert any("PTX-only" in n for n in plan.notes)


def _fake_gxx(tmp_path, name, version):
    p = tmp_path / name
    p.write_text(f"#!/bin/sh\necho {version}\n")
    p.chmod(0o755)
    return str(p)


def test_cudahostcxx_when_default_gcc_too_new(tmp_path):
    from cudadoctor.envcmd import gcc_max_for, host_compiler_fix
    from cudadoctor.runner import Runner
    from cudadoctor.versions import CudaVersion

    limit = gcc_max_for(CudaVersion(12, 1))
    assert limit == 12
    gxx = _fake_gxx(tmp_path, "g++", "14.2.0")
    old = _fake_gxx(tmp_path, "g++-12", "12.3.0")
    env = {"PATH": str(tmp_path)}
    value, why = host_compiler_fix(Runner(), env, CudaVersion(12, 1))
    assert value == old and "g++ 14" in why
    assert host_compiler_fix(Runner(), env, CudaVersion(13, 0)) == (None, None)  # 14 <= 15
    os.remove(old)
    value, why = host_compiler_fix(Runner(), env, CudaVersion(12, 1))
    assert value is None and "g++-12" in why
    assert host_compiler_fix(Runner(), dict(env, CUDAHOSTCXX=gxx), CudaVersion(12, 1)) == (None, None)


def _tcal(plan):
    return {v.name: v for v in plan.vars}.get("TORCH_CUDA_ARCH_LIST")


@pytest.mark.parametrize(
    "current,gpus,want,why",
    [
        ("9.0a", ["9.0"], "9.0a", "kept"),
        ("7.0;8.0", ["8.9"], "8.9+PTX", "cannot target sm_70"),
        ("8.0", ["9.0"], "9.0+PTX", "covers none"),
        ("bogus", ["8.6"], "8.6+PTX", "cannot read"),
        (None, ["8.6", "8.9"], "8.6;8.9+PTX", "GPUs present"),
    ],
)
def test_env_keeps_or_replaces_existing_arch_list(current, gpus, want, why):
    from cudadoctor.envcmd import make_env_plan

    env = {"PATH": "/nonexistent", "MAX_JOBS": "1"}
    if current:
        env["TORCH_CUDA_ARCH_LIST"] = current
    plan = make_env_plan(runner=nvcc_runner(NV130, CODES130), env=env, nvcc_path="/fake/nvcc",
                         gpus=[{"index": i, "name": "g", "cc": cc} for i, cc in enumerate(gpus)], sites=[])
    v = _tcal(plan)
    assert v.value == want and why in v.why
