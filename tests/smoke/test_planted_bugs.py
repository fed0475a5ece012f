"""The planted-bug extension (tests/fixtures/planted_bugs) proves the harness can fail.

- built with the other C++11 ABI (no GPU needed): smoke reports the import failure and
  EXT_ABI_MISMATCH before anything runs;
- on a GPU: memcheck flags the out-of-bounds write, racecheck the shared-memory race;
- on a GPU with cudadoctor_ops installed: every bundled op passes all four tools.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from cudadoctor.cli import main
from cudadoctor.smoke.sanitizer import find_sanitizer

REPO = pathlib.Path(__file__).resolve().parents[2]
PLANTED = REPO / "tests" / "fixtures" / "planted_bugs"


def _cuda_home() -> str | None:
    for cand in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if cand and os.path.exists(os.path.join(cand, "bin", "nvcc")):
            return cand
    nvcc = shutil.which("nvcc")
    return os.path.dirname(os.path.dirname(os.path.realpath(nvcc))) if nvcc else None


def _gpu_cc() -> str | None:
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability(0)
    return f"{major}.{minor}"


def build_planted(tmp: pathlib.Path, arch: str, *, old_abi: bool = False) -> pathlib.Path:
    pytest.importorskip("torch", reason="building the extension needs torch")
    cuda_home = _cuda_home()
    if cuda_home is None:
        pytest.skip("no nvcc found (CUDA_HOME, /usr/local/cuda, PATH)")
    src = tmp / "src"
    shutil.copytree(PLANTED, src, ignore=shutil.ignore_patterns("build", "*.so", "__pycache__", "*.egg-info"))
    env = dict(os.environ, TORCH_CUDA_ARCH_LIST=arch, CUDA_HOME=cuda_home, MAX_JOBS="1")
    if old_abi:
        env["PLANTED_BUGS_CXX11_ABI"] = "0"
    dist = tmp / "dist"
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "-w", str(dist),
                           str(src)], env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, f"building planted_bugs failed:\n{(proc.stdout + proc.stderr)[-4000:]}"
    (wheel,) = dist.glob("planted_bugs-*.whl")
    return wheel


def smoke_json(capsys, *args) -> tuple[int, dict]:
    code = main(["smoke", *map(str, args), "--json"])
    return code, json.loads(capsys.readouterr().out)


@pytest.mark.compile
def test_other_cxx11_abi_is_reported_before_running(tmp_path, capsys):
    wheel = build_planted(tmp_path, _gpu_cc() or "9.0", old_abi=True)
    code, rep = smoke_json(capsys, wheel, "--tools", "none")
    assert code == 1 and rep["status"] == "fail"
    imp = next(c for c in rep["checks"] if c["name"] == "import")
    assert imp["ok"] is False and "undefined symbol" in imp["detail"]
    abi = [f for f in rep["findings"] if f["id"] == "EXT_ABI_MISMATCH"]
    assert abi, rep["findings"]
    assert "undefined symbol" in abi[0]["detail"] or "_GLIBCXX_USE_CXX11_ABI" in abi[0]["detail"]
    assert rep["results"] == []  # nothing ran


@pytest.mark.gpu
@pytest.mark.compile
def test_memcheck_and_racecheck_flag_the_planted_bugs(tmp_path, capsys):
    cc = _gpu_cc()
    if cc is None:
        pytest.skip("no CUDA GPU")
    if find_sanitizer() is None:
        pytest.skip("compute-sanitizer not found")
    wheel = build_planted(tmp_path, cc)
    code, rep = smoke_json(capsys, wheel, "--tools", "memcheck,racecheck", "--timeout", "300")
    assert code == 1, rep
    cells = {(r["op"], r["tool"]): r for r in rep["results"]}
    oob = cells[("oob_write", "memcheck")]
    assert oob["status"] == "fail" and oob["errors"] >= 1
    assert any("Invalid __global__ write" in h for h in oob["reports"]), oob["reports"]
    race = cells[("smem_race", "racecheck")]
    assert race["status"] == "fail" and race["errors"] >= 1
    assert any("Race reported" in h for h in race["reports"]), race["reports"]
    assert [f["id"] for f in rep["findings"]] == []  # built for this GPU and this torch


@pytest.mark.gpu
def test_bundled_ops_pass_all_four_tools(capsys):
    if _gpu_cc() is None:
        pytest.skip("no CUDA GPU")
    if importlib.util.find_spec("cudadoctor_ops") is None:
        pytest.skip("cudadoctor_ops is not installed (pip install a wheel from cudadoctor build)")
    if find_sanitizer() is None:
        pytest.skip("compute-sanitizer not found")
    code, rep = smoke_json(capsys, "--installed", "cudadoctor_ops", "--timeout", "600")
    bad = [(r["op"], r["tool"], r["detail"]) for r in rep["results"] if r["status"] != "pass"]
    assert code == 0 and not bad, bad
    assert {r["tool"] for r in rep["results"]} == {"run", "memcheck", "racecheck", "initcheck", "synccheck"}
    assert all(r["errors"] == 0 for r in rep["results"] if r["tool"] != "run")
