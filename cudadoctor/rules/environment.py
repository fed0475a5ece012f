"""Environment-variable and tool rules: CUDA_VISIBLE_DEVICES, LD_LIBRARY_PATH, ninja."""

from __future__ import annotations

import re

from cudadoctor.findings import Finding
from cudadoctor.rules import Facts, rule
from cudadoctor.rules._kb import pypi_default_cuda, toolkits, torch_cuda
from cudadoctor.versions import CudaVersion


def _hidden_reason(value: str, gpus: list) -> str | None:
    """Why CUDA_VISIBLE_DEVICES=value leaves CUDA no device, or None when it leaves some."""
    v = value.strip()
    if not v:
        return "it is set but empty"
    first = v.split(",")[0].strip()
    if re.fullmatch(r"-?\d+", first):
        n = int(first)
        if n < 0:
            return f"its first entry {first} is negative"
        if gpus and n >= len(gpus):
            return f"index {n} does not exist (there are {len(gpus)} GPU(s), indices 0-{len(gpus) - 1})"
        return None
    low = first.lower()
    if low.startswith(("gpu-", "mig-")):
        uuids = [str(g.get("uuid")).lower() for g in gpus if isinstance(g, dict) and g.get("uuid")]
        if uuids and not any(u.startswith(low) for u in uuids) and low.startswith("gpu-"):
            return f"UUID {first} matches no GPU (present: {', '.join(uuids)})"
        return None
    return f"its first entry {first!r} is neither an index nor a GPU-/MIG- UUID"


@rule("CUDA_VISIBLE_DEVICES_HIDES", severity="error", area="gpus", priority=25,
      summary="CUDA_VISIBLE_DEVICES hides every GPU (empty, -1, bad index or UUID)")
def cuda_visible_devices_hides(f: Facts):
    env = f.section("env")
    if "CUDA_VISIBLE_DEVICES" not in env or not isinstance(env.get("CUDA_VISIBLE_DEVICES"), str):
        return None
    value = env["CUDA_VISIBLE_DEVICES"]
    gpus = [g for g in f.list("gpus") if isinstance(g, dict)]
    why = _hidden_reason(value, gpus)
    if why is None:
        return None
    good = ",".join(str(g.get("index", n)) for n, g in enumerate(gpus)) if gpus else "0"
    return Finding(
        id="CUDA_VISIBLE_DEVICES_HIDES",
        severity="error",
        title=f"CUDA_VISIBLE_DEVICES={value!r} hides every GPU from CUDA",
        detail=f"env.CUDA_VISIBLE_DEVICES is {value!r}: {why}. CUDA reads the list up to the first invalid "
        "entry, so no device is visible and torch.cuda.is_available() is False (nvidia-smi still shows the GPUs).",
        fix=(["PowerShell: Remove-Item Env:CUDA_VISIBLE_DEVICES   (cmd: set CUDA_VISIBLE_DEVICES=)",
              f"or select existing GPUs: $env:CUDA_VISIBLE_DEVICES=\"{good}\""]
             if f.get("host.os") == "windows" else
             ["unset CUDA_VISIBLE_DEVICES", f"or select existing GPUs: export CUDA_VISIBLE_DEVICES={good}"])
        + ["and remove it where it is set (shell profile, launch script, job file)"],
        facts=["env.CUDA_VISIBLE_DEVICES", "gpus"],
        area="gpus",
    )


_CUDA_DIR = re.compile(r"cuda[-_]?(\d+\.\d+)", re.IGNORECASE)
_LIB_NAMES = ("cudnn", "cublas", "cusparse", "nccl")


def _entry_cuda(entry: str, f: Facts) -> CudaVersion | None:
    m = _CUDA_DIR.search(entry)
    if m:
        return CudaVersion.parse(m.group(1))
    for tk in toolkits(f):
        root = tk.get("root")
        if isinstance(root, str) and root and entry.rstrip("/").startswith(root.rstrip("/") + "/"):
            return CudaVersion.parse(tk.get("nvcc"))
    return None


@rule("LD_LIBRARY_PATH_SHADOW", severity="warning", area="torch", priority=60,
      summary="LD_LIBRARY_PATH puts another CUDA runtime / cuDNN / cuBLAS ahead of torch's own")
def ld_library_path_shadow(f: Facts):
    ldp = f.env("LD_LIBRARY_PATH")
    need = torch_cuda(f)
    import_err = f.get("torch.import_error")
    if need is None and isinstance(import_err, str) and import_err:
        # torch did not import, so torch.cuda is unknown: a pip wheel without +cuXYZ is PyPI's default
        need = pypi_default_cuda(f.get("torch.version"))
    if not ldp or need is None:
        return None
    entries = [e for e in ldp.split(":") if e]
    shadow = []
    for e in entries:
        low = e.lower()
        if "/usr/lib/wsl/lib" in low:
            continue
        v = _entry_cuda(e, f)
        if v is not None and (v.major, v.minor) != (need.major, need.minor):
            shadow.append((e, f"CUDA {v} libraries"))
        elif v is None and any(n in low for n in _LIB_NAMES):
            shadow.append((e, "a separately installed " + next(n for n in _LIB_NAMES if n in low)))
    if not shadow:
        return None
    bad = {e for e, _ in shadow}
    keep = [e for e in entries if e not in bad]
    fix = [f"export LD_LIBRARY_PATH={':'.join(keep)}" if keep else "unset LD_LIBRARY_PATH"]
    fix.append("and remove the entry where it is set (~/.bashrc, the module file or the Dockerfile ENV)")
    return Finding(
        id="LD_LIBRARY_PATH_SHADOW",
        severity="warning",
        title="LD_LIBRARY_PATH loads CUDA libraries other than the ones torch was built with",
        detail=f"torch was built with CUDA {need}, but env.LD_LIBRARY_PATH lists "
        + "; ".join(f"{e} ({why})" for e, why in shadow)
        + ". LD_LIBRARY_PATH wins over torch's own RUNPATH, so those libraries load first and give "
        "'undefined symbol' / CUBLAS_STATUS_* / cuDNN version errors.",
        fix=fix,
        facts=["env.LD_LIBRARY_PATH", "torch.cuda"],
        area="torch",
    )


@rule("NINJA_MISSING", severity="warning", area="tools", priority=80,
      summary="ninja is absent: extension builds fall back to slow serial compiles")
def ninja_missing(f: Facts):
    tools = f.section("tools")
    if not tools or tools.get("ninja"):
        return None
    if "ninja" not in tools and not any(v for v in tools.values()):
        return None  # nothing probed
    return Finding(
        id="NINJA_MISSING",
        severity="warning",
        title="ninja is not on PATH: torch extension builds are serial and slow",
        detail="tools.ninja is empty; torch.utils.cpp_extension then falls back to distutils, compiling one "
        "file at a time (and load() refuses to JIT-build at all).",
        fix=["pip install ninja   (then check: ninja --version; the venv's bin/ must be on PATH)"],
        facts=["tools.ninja"],
        area="tools",
    )
