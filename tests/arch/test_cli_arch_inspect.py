"""`cudadoctor arch`, `env` and `inspect` through the real CLI entry point."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cudadoctor.cli import main

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "binaries"
REPO = Path(__file__).resolve().parents[2]


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_arch_json_shape(capsys):
    code, out, _ = run(capsys, "arch", "8.6,8.9+PTX", "--gpu", "8.9", "--gpu", "8.0", "--json")
    assert code == 0
    j = json.loads(out)
    assert j["torch_cuda_arch_list"] == "8.6;8.9+PTX"
    assert "-gencode=arch=compute_89,code=compute_89" in j["gencode"]
    assert [(g["cc"], g["runs"]) for g in j["gpus"]] == [("8.9", True), ("8.0", False)]


def test_arch_spec_as_option_equals_argument(capsys):
    # `env --arch` and `build --arch` spell it as an option; `arch --arch` takes it too
    code, out, _ = run(capsys, "arch", "--arch", "8.6,8.9", "--gpu", "8.9", "--json")
    assert code == 0
    as_opt = json.loads(out)
    code, out, _ = run(capsys, "arch", "8.6,8.9", "--gpu", "8.9", "--json")
    assert code == 0 and json.loads(out) == as_opt
    assert as_opt["torch_cuda_arch_list"] == "8.6;8.9"
    # the same spec twice is fine; two different ones are an input error (exit 2)
    code, out, _ = run(capsys, "arch", "8.6,8.9", "--arch", "8.6,8.9", "--gpu", "8.9", "--json")
    assert code == 0 and json.loads(out) == as_opt
    code, _, err = run(capsys, "arch", "8.6", "--arch", "8.9", "--gpu", "8.9")
    assert code == 2 and "'8.6'" in err and "'8.9'" in err and "Traceback" not in err
    # a bad spec given as the option is quoted like the argument
    code, _, err = run(capsys, "arch", "--arch", "sm_8x6")
    assert code == 2 and "'sm_8x6'" in err and "Valid forms" in err


def test_arch_bad_spec_exits_2_and_quotes_it(capsys):
    code, _, err = run(capsys, "arch", "sm_8x6")
    assert code == 2 and "'sm_8x6'" in err and "Valid forms" in err and "Traceback" not in err


def test_arch_unknown_gpu_option_exits_2(capsys):
    code, _, err = run(capsys, "arch", "8.6", "--gpu", "eighty")
    assert code == 2 and "'eighty'" in err


def test_arch_refusal_exits_1_with_range(capsys, tmp_path):
    fake = tmp_path / "nvcc"
    fake.write_text("#!/bin/sh\n[ \"$1\" = --version ] && echo 'Cuda compilation tools, release 12.1, V12.1.105' && exit 0\nexit 1\n")
    fake.chmod(0o755)
    code, _, err = run(capsys, "arch", "12.0", "--nvcc", str(fake))
    assert code == 1 and "CUDA >= 12.8" in err and "12.1" in err


def test_env_eval_in_bash():
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("TORCH_CUDA_ARCH_LIST", None)
    script = f'eval "$({sys.executable} -m cudadoctor env --gpu 8.9)" && printf "%s|%s" "$TORCH_CUDA_ARCH_LIST" "$MAX_JOBS"'
    r = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    tcal, jobs = r.stdout.split("|")
    assert tcal == "8.9+PTX" and int(jobs) >= 1


def test_env_github_format(capsys):
    code, out, _ = run(capsys, "env", "--shell", "github", "--gpu", "8.6")
    assert code == 0
    lines = out.splitlines()
    assert "TORCH_CUDA_ARCH_LIST=8.6+PTX" in lines
    assert all("=" in ln and not ln.startswith("#") for ln in lines)


def test_env_bad_shell(capsys):
    code, _, err = run(capsys, "env", "--shell", "tcsh")
    assert code == 2 and "tcsh" in err


def test_inspect_json_and_exit_codes(capsys):
    code, out, _ = run(capsys, "inspect", str(FIX / "sm86_sm89_ptx89.o"), "--target", "8.6,8.9", "--json")
    assert code == 0
    j = json.loads(out)
    assert j["files"][0]["sass"] == ["sm_86", "sm_89"] and j["files"][0]["ptx"] == ["compute_89"]
    assert {(v["gpu"], v["runs"], v["via"]) for v in j["verdicts"]} == {("8.6", True, "sass"), ("8.9", True, "sass")}
    code, out, _ = run(capsys, "inspect", str(FIX / "sm86_sm89_ptx89.o"), "--gpu", "8.0", "--json")
    assert code == 1
    v = json.loads(out)["verdicts"][0]
    assert set(v) >= {"path", "gpu", "runs", "via", "needs_driver"} and v["runs"] is False


def test_inspect_ptx_jit_human(capsys):
    code, out, _ = run(capsys, "inspect", str(FIX / "ptx80_only.fatbin"), "--gpu", "9.0")
    assert code == 0 and "PTX JIT" in out and "needs driver >= 580" in out


def test_inspect_unreadable_exits_2(capsys):
    code, _, err = run(capsys, "inspect", str(FIX / "kern.cu"))
    assert code == 2 and "not an ELF" in err
