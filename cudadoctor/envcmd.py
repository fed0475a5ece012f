"""`cudadoctor env`: the environment variables that make torch extension builds work here.

- TORCH_CUDA_ARCH_LIST: the arch plan (present GPUs, PTX for the newest; a suggestion without GPU).
- CUDA_HOME: when torch's guess (CUDA_HOME/CUDA_PATH, else `which nvcc`/.., else /usr/local/cuda)
  is not a toolkit root (no include/cuda_runtime.h, e.g. /usr/local for a /usr/local/bin/nvcc
  wrapper) and the real nvcc's root is.
- CPATH: when the toolkit lacks headers torch's CUDA headers include (cusparse.h, cublas_v2.h)
  and a pip-installed nvidia/*/include folder has them.
- CUDAHOSTCXX: when the default g++ is newer than the nvcc accepts (data/host_compilers.toml)
  and an older g++-N is installed.
- CXX, LDSHARED (and CC / CUDAHOSTCXX when they name the same compiler): when the compiler extensions
  would be linked with has only libstdc++.a (a private C++ runtime in every extension: exceptions
  thrown inside it crash the process) and another compiler here links libstdc++.so.
- MAX_JOBS: min(cores, available memory / 3 GiB), since one nvcc job needs GBs.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import site
import sys
from dataclasses import dataclass, field
from typing import Mapping

from cudadoctor.archplan import ArchPlan, Nvcc, make_plan, present_gpus, probe_nvcc
from cudadoctor.errors import CudadoctorError, InputError
from cudadoctor.runner import Runner
from cudadoctor.versions import CudaVersion

SHELLS = ("bash", "zsh", "fish", "pwsh", "cmd", "github", "dotenv")
NEEDED_HEADERS = ("cusparse.h", "cublas_v2.h")
GIB_PER_JOB = 3


@dataclass
class EnvVar:
    name: str
    value: str
    why: str


@dataclass
class EnvPlan:
    vars: list[EnvVar] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def torch_cuda_home_guess(env: Mapping[str, str]) -> str | None:
    """The CUDA_HOME torch.utils.cpp_extension would pick."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if env.get(var):
            return env[var]
    nvcc = shutil.which("nvcc", path=env.get("PATH"))
    if nvcc:
        return os.path.dirname(os.path.dirname(nvcc))
    return "/usr/local/cuda" if os.path.exists("/usr/local/cuda") else None


def is_toolkit_root(path: str | None) -> bool:
    return bool(path) and os.path.isfile(os.path.join(path, "include", "cuda_runtime.h")) and os.path.exists(
        os.path.join(path, "bin", "nvcc")
    )


def site_dirs() -> list[str]:
    dirs = []
    try:
        dirs.extend(site.getsitepackages())
    except AttributeError:
        pass
    try:
        dirs.append(site.getusersitepackages())
    except AttributeError:
        pass
    dirs.extend(p for p in sys.path if p.endswith(("site-packages", "dist-packages")))
    out = []
    for d in dirs:
        if d and os.path.isdir(d) and d not in out:
            out.append(d)
    return out


def header_fix_dirs(cuda_home: str | None, sites: list[str], cuda: CudaVersion | None = None) -> list[str]:
    """Include folders that supply NEEDED_HEADERS missing from ``cuda_home``/include."""
    inc = os.path.join(cuda_home or "", "include")
    missing = [h for h in NEEDED_HEADERS if not os.path.exists(os.path.join(inc, h))]
    if not cuda_home or not missing:
        return []
    found: list[str] = []
    for sdir in sites:
        cands = sorted(glob.glob(os.path.join(sdir, "nvidia", "*", "include")))
        if cuda is not None:  # prefer the folder of the same CUDA major (nvidia/cu13 for 13.x)
            cands.sort(key=lambda p: 0 if os.path.basename(os.path.dirname(p)) == f"cu{cuda.major}" else 1)
        for c in cands:
            if any(os.path.exists(os.path.join(c, h)) for h in missing) and c not in found:
                found.append(c)
                missing = [h for h in missing if not os.path.exists(os.path.join(c, h))]
            if not missing:
                return found
    return found


def _compiler_major(runner: Runner, cxx: str) -> int | None:
    r = runner.run([cxx, "-dumpversion"], timeout=10)
    if not r.ok:
        return None
    m = re.match(r"(\d+)", r.stdout.strip())
    return int(m.group(1)) if m else None


def gcc_max_for(cuda: CudaVersion | None) -> int | None:
    from cudadoctor.knowledge import KnowledgeError, load_table

    if cuda is None:
        return None
    try:
        rows = load_table("host_compilers")
    except KnowledgeError:
        return None
    best = None
    for row in rows:
        c = CudaVersion.parse(row.get("cuda"))
        if c is not None and c <= cuda and (best is None or c > best[0]) and row.get("gcc_max") is not None:
            best = (c, int(row["gcc_max"]))
    return best[1] if best else None


def host_compiler_fix(runner: Runner, env: Mapping[str, str], cuda: CudaVersion | None) -> tuple[str | None, str | None]:
    """(CUDAHOSTCXX value, note) when the default g++ is too new for this nvcc."""
    if env.get("CUDAHOSTCXX"):
        return None, None
    limit = gcc_max_for(cuda)
    cxx = env.get("CXX") or shutil.which("g++", path=env.get("PATH"))
    if limit is None or not cxx:
        return None, None
    major = _compiler_major(runner, cxx)
    if major is None or major <= limit:
        return None, None
    for n in range(limit, 4, -1):
        cand = shutil.which(f"g++-{n}", path=env.get("PATH"))
        if cand:
            return cand, f"g++ {major} is newer than nvcc {cuda} accepts (<= {limit})"
    return None, (f"g++ {major} is newer than nvcc {cuda} accepts (<= {limit}) and no g++-{limit} or older is "
                  f"installed; install one (e.g. apt-get install g++-{limit}) and set CUDAHOSTCXX to it.")


def cxx_runtime_fix(runner: Runner, env: Mapping[str, str], root: str = "/") -> tuple[list[EnvVar], str | None]:
    """(CXX/LDSHARED/CC/CUDAHOSTCXX variables, note) when extensions would be linked by a compiler with
    only libstdc++.a; the replacement is the best compiler the probe found with libstdc++.so."""
    from cudadoctor.cxx_runtime import describe, fix_env, linking_static, shared_alternative
    from cudadoctor.probes._fs import Root
    from cudadoctor.probes.compiler import probe_host_compiler

    hc = probe_host_compiler(runner, Root(root), env) or {}
    bad = linking_static(hc, env)
    if not bad:
        return [], None
    who = "; ".join(describe(c) for c in bad)
    why = (f"{who} links libstdc++ statically (no libstdc++.so on its library path): every extension it links "
           "carries its own C++ runtime, and an exception thrown inside one (TORCH_CHECK) crashes the process")
    values = fix_env(hc, env)
    alt = shared_alternative(hc)
    if not values or alt is None:
        return [], (why + "; no other compiler with the shared libstdc++ was found: install one "
                    "(apt-get install g++) and set CXX and LDSHARED=\"<that g++> -shared\".")
    whys = {
        "CXX": f"{why}; {alt['path']} links {alt.get('shared_libstdcxx') or 'libstdc++.so'}",
        "LDSHARED": "setuptools links extensions with LDSHARED when it is set: keep the link on " + alt["path"],
        "CC": "CC named the static-runtime compiler (torch passes it to nvcc as -ccbin; LDSHARED defaults to it)",
        "CUDAHOSTCXX": "CUDAHOSTCXX named the static-runtime compiler",
    }
    return [EnvVar(k, v, whys[k]) for k, v in values.items()], None


def mem_available_gib(meminfo: str = "/proc/meminfo") -> float | None:
    try:
        with open(meminfo, encoding="ascii", errors="replace") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / (1024 * 1024)
    except (OSError, ValueError, IndexError):
        return None
    return None


def max_jobs(cores: int | None, avail_gib: float | None) -> int:
    c = max(1, cores or 1)
    if avail_gib is None:
        return c
    return max(1, min(c, int(avail_gib // GIB_PER_JOB)))


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def make_env_plan(
    *,
    runner: Runner | None = None,
    env: Mapping[str, str] | None = None,
    spec: str | None = None,
    nvcc_path: str | None = None,
    gpus: list[dict] | None = None,
    sites: list[str] | None = None,
    root: str = "/",
) -> EnvPlan:
    runner = runner or Runner()
    env = dict(os.environ if env is None else env)
    plan = EnvPlan()
    nvcc: Nvcc = probe_nvcc(runner, nvcc_path, env)
    driver = None
    if gpus is None:
        gpus, driver, _err = present_gpus(runner)
    current = env.get("TORCH_CUDA_ARCH_LIST")
    arch: ArchPlan | None = None
    replaced = ""
    if spec is None and current and current.strip():
        try:
            arch = make_plan(current, nvcc=nvcc, gpus=gpus, driver=driver)
        except CudadoctorError as exc:
            replaced = f"replaces {current!r}: {exc.message}"
        else:
            if gpus and not any(g.get("runs") for g in arch.gpus):
                replaced = f"replaces {current!r}: it covers none of the GPUs present"
                arch = None
    if arch is None:
        arch = make_plan(spec, nvcc=nvcc, gpus=gpus, driver=driver)
        why = "suggested: no GPU found and no spec given" if arch.suggested else (
            f"from spec {spec!r}" if spec else "the GPUs present, PTX for the newest")
        if replaced:
            why = f"{why}; {replaced}"
    else:
        why = "kept: already set, and this nvcc can target it"
    if arch.items:
        plan.vars.append(EnvVar("TORCH_CUDA_ARCH_LIST", arch.torch_cuda_arch_list, why))
    plan.notes.extend(arch.notes)

    guess = torch_cuda_home_guess(env)
    cuda_home = guess
    real_root = nvcc.root
    if not is_toolkit_root(guess) and is_toolkit_root(real_root):
        cuda_home = real_root
        plan.vars.append(EnvVar("CUDA_HOME", real_root, f"torch would guess {guess!r}, which is not a toolkit root"))
    elif guess is None and real_root:
        cuda_home = real_root
    if nvcc.path is None:
        plan.notes.append("No nvcc found: install a CUDA toolkit (or pip install nvidia-cuda-nvcc) to build extensions.")

    fix = header_fix_dirs(cuda_home, site_dirs() if sites is None else sites, nvcc.cuda)
    if fix:
        cur = env.get("CPATH")
        value = os.pathsep.join(fix + ([cur] if cur else []))
        plan.vars.append(EnvVar("CPATH", value, f"{cuda_home}/include lacks " + ", ".join(
            h for h in NEEDED_HEADERS if not os.path.exists(os.path.join(cuda_home or "", "include", h)))))

    hostcxx, note = host_compiler_fix(runner, env, nvcc.cuda)
    if hostcxx:
        plan.vars.append(EnvVar("CUDAHOSTCXX", hostcxx, note or ""))
    elif note:
        plan.notes.append(note)

    cxx_vars, cxx_note = cxx_runtime_fix(runner, env, root)
    have = {v.name for v in plan.vars}
    plan.vars.extend(v for v in cxx_vars if v.name not in have)
    if cxx_note:
        plan.notes.append(cxx_note)

    if not env.get("MAX_JOBS"):
        avail = mem_available_gib()
        jobs = max_jobs(_cores(), avail)
        mem = f"{avail:.0f} GiB available" if avail is not None else "memory unknown"
        plan.vars.append(EnvVar("MAX_JOBS", str(jobs), f"{_cores()} cores, {mem}, ~{GIB_PER_JOB} GiB per nvcc job"))
    return plan


# --- rendering --------------------------------------------------------------------------------


def _sq(value: str) -> str:
    return "'" + value.replace("'", "'\"'\"'") + "'"


def _pwsh(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


def render(plan: EnvPlan, shell: str = "bash") -> str:
    if shell not in SHELLS:
        raise InputError(f"unknown shell {shell!r}.", hint="Use one of: " + ", ".join(SHELLS) + ".")
    lines: list[str] = []
    comment = {"cmd": "REM "}.get(shell, "# ")
    for note in plan.notes:
        if shell not in ("github",):
            lines.append(comment + note)
    for v in plan.vars:
        if v.why and shell not in ("github",):
            lines.append(f"{comment}{v.name}: {v.why}")
        if shell in ("bash", "zsh"):
            lines.append(f"export {v.name}={_sq(v.value)}")
        elif shell == "fish":
            val = v.value.replace("\\", "\\\\").replace("'", "\\'")
            lines.append(f"set -gx {v.name} '{val}'")
        elif shell == "pwsh":
            lines.append(f"$env:{v.name} = {_pwsh(v.value)}")
        elif shell == "cmd":
            lines.append(f'set "{v.name}={v.value}"')
        elif shell == "github":
            lines.append(f"{v.name}={v.value}")
        elif shell == "dotenv":
            val = v.value.replace("\\", "\\\\").replace('"', '\\"')
            lines.append(f'{v.name}="{val}"')
    return "\n".join(lines) + ("\n" if lines else "")
