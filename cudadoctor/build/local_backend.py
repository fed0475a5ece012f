"""The local backend: the host's toolchain, after the doctor's checks.

A blocking finding (an error in the toolkit or compiler areas, or a CPU-only torch) refuses the build
and prints the finding; TOOLKIT_INCOMPLETE is fixed instead of refused: the include folder of torch's
nvidia wheels (site-packages/nvidia/cuXY/include) is added to CPATH.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from cudadoctor.build import cxx_runtime
from cudadoctor.build.docker_backend import SCRIPTS, built_wheel
from cudadoctor.build.plan import BuildPlan
from cudadoctor.build.progress import BuildProgress
from cudadoctor.errors import RefusedError
from cudadoctor.versions import CudaVersion

BLOCKING_AREAS = {"toolkit", "compiler"}
BLOCKING_IDS = {"TORCH_CPU_ONLY", "TORCH_IMPORT_FAILED", "TORCH_MISSING"}
AUTO_FIXED = {"TOOLKIT_INCOMPLETE"}


# The build imports torch itself, so the host check waits as long as a slow first import can take (a
# cold disk cache right after installing torch takes well over the doctor's default 20 s on some disks).
HOST_TORCH_TIMEOUT = 300.0


def host_facts() -> dict:
    from cudadoctor.probes import collect_facts

    return collect_facts(torch_mode="auto", torch_timeout=HOST_TORCH_TIMEOUT)


def blocking_findings(report: dict) -> list[dict]:
    out = []
    for f in report.get("findings") or []:
        if f.get("severity") != "error" or f.get("id") in AUTO_FIXED or cxx_runtime.auto_fixed(f, report):
            continue
        if f.get("area") in BLOCKING_AREAS or f.get("id") in BLOCKING_IDS:
            out.append(f)
    return out


def refuse_findings(findings: list[dict]) -> RefusedError:
    parts = []
    fixes = []
    for f in findings:
        parts.append(f"{f.get('id')}: {f.get('title')}")
        fixes.extend(f.get("fix") or [])
    return RefusedError(
        "the host toolchain cannot build this: " + "; ".join(parts) + ".",
        hint=("Fix: " + "; ".join(fixes[:4]) + ". " if fixes else "")
        + "Run `cudadoctor check` for the details, or build in a container with --backend docker.",
    )


def nvidia_include_dirs(cuda: str | None, paths: list[str] | None = None) -> list[str]:
    """Include folders of the nvidia-* pip wheels next to torch (CUDA 13: nvidia/cu13/include; CUDA 12:
    one folder per library)."""
    v = CudaVersion.parse(cuda) if cuda else None
    out: list[str] = []
    for base in paths if paths is not None else sys.path:
        nv = os.path.join(base or ".", "nvidia")
        if not os.path.isdir(nv):
            continue
        cands = [os.path.join(nv, f"cu{v.major}", "include")] if v is not None and v.major >= 13 else []
        cands += [os.path.join(nv, lib, "include") for lib in ("cusparse", "cublas", "cusolver", "curand", "cufft")]
        for c in cands:
            if os.path.isdir(c) and c not in out:
                out.append(c)
        if out:
            break
    return out


def toolkit_root(facts: dict) -> str | None:
    """The toolkit to build with: the first one the probe found, seen through an nvcc wrapper script
    (/usr/local/bin/nvcc calling /usr/local/cuda-13.0/bin/nvcc: torch would guess /usr/local), and
    preferring one whose include folder has cuda_runtime_api.h."""
    tks = facts.get("toolkits") if isinstance(facts, dict) else None
    roots: list[str] = []
    for tk in tks if isinstance(tks, list) else []:
        if not isinstance(tk, dict):
            continue
        wrapped = tk.get("nvcc_wrapper_of")
        if isinstance(wrapped, str) and wrapped:
            roots.append(os.path.dirname(os.path.dirname(os.path.realpath(wrapped))))
        if tk.get("root"):
            roots.append(str(tk["root"]))
    for r in roots:
        if os.path.isfile(os.path.join(r, "include", "cuda_runtime_api.h")):
            return r
    return roots[0] if roots else None


def local_env(plan: BuildPlan, facts: dict, report: dict, base_env: dict[str, str]) -> tuple[dict[str, str], list[str]]:
    """The build environment and the notes about what was adjusted."""
    env = dict(base_env)
    env.update(dict(plan.env))
    notes: list[str] = []
    if not env.get("CUDA_HOME"):
        root = toolkit_root(facts)
        if root:
            env["CUDA_HOME"] = root
            notes.append(f"CUDA_HOME={root}")
    ids = {f.get("id") for f in report.get("findings") or []}
    cuda_home = env.get("CUDA_HOME") or "/usr/local/cuda"
    header_missing = not os.path.isfile(os.path.join(cuda_home, "include", "cusparse.h"))
    if "TOOLKIT_INCOMPLETE" in ids or header_missing:
        dirs = nvidia_include_dirs(plan.target.cuda)
        if dirs:
            old = env.get("CPATH")
            env["CPATH"] = ":".join(dirs + ([old] if old else []))
            notes.append(f"TOOLKIT_INCOMPLETE fixed: CPATH={env['CPATH']}")
    notes += cxx_runtime.apply(env, facts)  # HOST_COMPILER_STATIC_LIBSTDCXX: link with a shared-runtime compiler
    return env, notes


def build(plan: BuildPlan, *, work_dir: Path, staging: Path, progress: BuildProgress, env: dict[str, str],
          python: str | None = None) -> Path:
    work_dir.mkdir(parents=True, exist_ok=True)
    staging.mkdir(parents=True, exist_ok=True)
    env = dict(env)
    env.setdefault("CCACHE_DIR", str(work_dir / "ccache"))
    env["PYTHONUNBUFFERED"] = "1"
    argv = [python or sys.executable, str(SCRIPTS / "build_wheel.py"), "--src", plan.source, "--work", str(work_dir),
            "--out", str(staging), "--info", str(staging / "build-info.json")]
    for line in cxx_runtime.log_lines(env):
        progress.write(line)
    progress.set_stage(f"building on this host (TORCH_CUDA_ARCH_LIST={plan.target.arch_list}, {plan.jobs} job(s), "
                       f"nvcc --threads={plan.threads})")
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            env=env, text=True, errors="replace", start_new_session=True)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            progress.line(line.rstrip("\n"))
        rc = proc.wait()
    except BaseException:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=10)
        except Exception:  # noqa: BLE001
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except OSError:
                pass
        raise
    return built_wheel(rc, staging)


def facts_summary(facts: dict[str, Any]) -> tuple[str | None, int | None, str | None]:
    """(torch version, g++ major, nvcc version) from a facts snapshot."""
    torch = (facts.get("torch") or {}).get("version") if isinstance(facts.get("torch"), dict) else None
    hc = facts.get("host_compiler") if isinstance(facts.get("host_compiler"), dict) else {}
    gcc = None
    if hc and hc.get("name") in ("gcc", "g++", None) and hc.get("version"):
        try:
            gcc = int(str(hc["version"]).split(".")[0])
        except ValueError:
            gcc = None
    tks = facts.get("toolkits") if isinstance(facts.get("toolkits"), list) else []
    nvcc = tks[0].get("nvcc") if tks and isinstance(tks[0], dict) else None
    return torch, gcc, nvcc
