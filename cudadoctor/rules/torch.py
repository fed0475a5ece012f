"""torch rules: a CPU-only build on a GPU machine; a build without code for the GPU."""

from __future__ import annotations

from cudadoctor import archs
from cudadoctor.findings import Finding
from cudadoctor.rules import Facts, rule
from cudadoctor.rules._kb import driver_view, error_texts, gpu_ccs, gpus_present, torch_cuda, wheel_fix

_NO_KERNEL_TEXT = ("no kernel image is available", "is not compatible with the current pytorch installation")


def _torch_version(f: Facts) -> str | None:
    v = f.get("torch.version")
    return v if isinstance(v, str) and v else None


def _says_cpu(f: Facts) -> bool:
    return "torch not compiled with cuda enabled" in error_texts(f)


def is_cpu_build(f: Facts) -> bool:
    v = _torch_version(f)
    if v is None:
        # torch's own assertion is proof enough when the version was not captured
        return _says_cpu(f) and torch_cuda(f) is None
    if "+cpu" in v.lower():
        return True
    if torch_cuda(f) is not None:
        return False
    t = f.section("torch")
    # torch.version.cuda explicitly null and CUDA not available: a CPU build.
    return "cuda" in t and t.get("cuda") is None and t.get("cuda_available") is False


@rule("TORCH_CPU_ONLY", severity="error", area="torch", priority=20,
      summary="a GPU is present but torch is a CPU build")
def torch_cpu_only(f: Facts):
    if not is_cpu_build(f):
        return None
    if not (gpus_present(f) or f.get("driver.version")):
        return None
    ccs = [c for _, _, c in gpu_ccs(f)]
    wf = wheel_fix(driver=driver_view(f), ccs=ccs, current_torch=_torch_version(f))
    fix = ["pip uninstall -y torch"] + (wf or ["pip install torch --index-url https://download.pytorch.org/whl/cu126"])
    fix.append("conda: remove the cpuonly package (conda remove cpuonly) before reinstalling pytorch")
    gpu_txt = ", ".join(n or "GPU" for _, n, _ in gpu_ccs(f)) or f"driver {f.get('driver.version')}"
    return Finding(
        id="TORCH_CPU_ONLY",
        severity="error",
        title=f"torch {_torch_version(f) or ''} is a CPU-only build".replace("  ", " "),
        detail=(f"torch.version is {_torch_version(f)!r} and torch.cuda is {f.get('torch.cuda')!r}"
                if _torch_version(f) else "torch says 'Torch not compiled with CUDA enabled'")
        + f", while an NVIDIA GPU is present ({gpu_txt}); torch.cuda.is_available() is False for every CPU build.",
        fix=fix,
        facts=["torch.version", "torch.cuda", "gpus"],
        area="torch",
    )


def _arch_lists(f: Facts) -> tuple[list[str], list[str]]:
    sass, ptx = [], []
    for a in f.list("torch.arch_list"):
        if not isinstance(a, str):
            continue
        s = a.strip().lower()
        if s.startswith("compute_"):
            ptx.append(s)
        elif s.startswith("sm_"):
            sass.append(s)
        else:  # "8.6" / "8.6+PTX"
            arch = archs.Arch.parse(s.replace("+ptx", ""))
            if arch is not None:
                sass.append(arch.sm)
                if "+ptx" in s:
                    ptx.append(arch.compute)
    return sass, ptx


@rule("TORCH_NO_KERNEL_IMAGE", severity="error", area="torch", priority=22,
      summary="torch's arch list has no SASS for the GPU's family and no PTX at or below its capability")
def torch_no_kernel_image(f: Facts):
    if is_cpu_build(f) or _torch_version(f) is None and not f.list("torch.arch_list"):
        return None
    sass, ptx = _arch_lists(f)
    gpus = gpu_ccs(f)
    bad = []
    if sass or ptx:
        bad = [(i, n, c) for i, n, c in gpus if not archs.runs_on(sass, ptx, c)[0]]
    dev_err = f.get("torch.device_error")
    said = isinstance(dev_err, str) and "no kernel image is available" in dev_err.lower()
    warned = [w for w in f.list("torch.warnings") if isinstance(w, str) and _NO_KERNEL_TEXT[1] in w.lower()]
    if warned and not said:
        said, dev_err = True, warned[0]
    if not bad and not (said and not (sass or ptx)):
        return None
    if not bad and said:
        bad = gpus
    cur = _torch_version(f)
    ccs = [c for _, _, c in gpus]
    wf = wheel_fix(driver=driver_view(f), ccs=ccs, current_torch=cur)
    listing = " ".join(sass + ptx) or "unknown"
    if bad and (sass or ptx):
        who = ", ".join(f"gpus[{i}] {n or 'GPU'} (cc {c})" for i, n, c in bad)
        detail = (f"{who} cannot run torch {cur or ''}: torch.arch_list is {listing}, with no SASS of "
                  "that family at or below the GPU's capability and no PTX it could JIT-compile.")
    else:
        detail = f"torch reported {dev_err.strip()[:200]!r} (torch.device_error / torch.warnings)."
    fix = wf or ["no official torch wheel covers this GPU with the installed driver: build torch from "
                 f'source with TORCH_CUDA_ARCH_LIST="{";".join(sorted(set(ccs))) or "<cc>"}"']
    return Finding(
        id="TORCH_NO_KERNEL_IMAGE",
        severity="error",
        title="this torch build has no kernels for " + (", ".join(f"cc {c}" for _, _, c in bad) or "the GPU"),
        detail=detail,
        fix=fix,
        facts=[f"gpus[{i}].cc" for i, _, _ in bad] + ["torch.arch_list", "torch.version"],
        area="torch",
    )


_SHARED_LIB_ERRORS = ("undefined symbol", "cannot open shared object file", "version `")


def _import_error(f: Facts) -> str | None:
    err = f.get("torch.import_error")
    return err.strip() if isinstance(err, str) and err.strip() else None


def _not_installed(err: str) -> bool:
    return "no module named 'torch'" in err.lower()


@rule("TORCH_IMPORT_FAILED", severity="error", area="torch", priority=23,
      summary="torch is installed but importing it fails, crashes or hangs")
def torch_import_failed(f: Facts):
    err = _import_error(f)
    if err is None or _not_installed(err):
        return None
    low = err.lower()
    ldp = f.env("LD_LIBRARY_PATH")
    if ldp and any(s in low for s in _SHARED_LIB_ERRORS):
        # a library torch needs resolved elsewhere: LD_LIBRARY_PATH_SHADOW names the entry to drop
        return None
    from cudadoctor.rules.messages import libstdcxx_match

    if libstdcxx_match(err):
        return None  # an old libstdc++.so.6 loaded first: LIBSTDCXX_TOO_OLD says which and what to do
    python = f.get("python.executable") or "python3"
    version = _torch_version(f)
    fix: list[str] = []
    timed_out = "timed out" in low
    if timed_out:
        fix.append("cudadoctor check --torch-timeout 180   (waits longer: if torch then imports, the import "
                   "was only slow, e.g. a cold disk cache after installing torch or a network filesystem)")
    if "killed by signal" in low or timed_out:
        fix.append(f"{python} -X faulthandler -c 'import torch'   (shows where the import crashes or hangs)")
    if any(s in low for s in _SHARED_LIB_ERRORS):
        fix.append(f"{python} -m pip install --force-reinstall --no-deps torch{'==' + version if version else ''}"
                   "   (a torch file or one of its nvidia-* libraries is missing or from another release)")
    if not fix:
        fix.append(f"{python} -m pip install --force-reinstall torch{'==' + version if version else ''}")
    last = err.splitlines()[-1][:300]
    if timed_out:
        title = "importing torch did not finish in time"
        detail = (f"`import torch` in {python} did not finish: {last}. A hang (a lock held by another process, "
                  "a deadlocked CUDA initialisation) never finishes; a slow import (the first one from a cold "
                  "disk cache, a network filesystem) does, given longer. Until torch imports in time, the "
                  "other findings were judged without torch's own view of the GPU.")
    else:
        title = "importing torch fails"
        detail = (f"`import torch` in {python} failed: {last}. Nothing that needs torch (building or loading "
                  "extensions, running CUDA ops) can work until it imports; the other findings were judged "
                  "without torch's own view of the GPU.")
    return Finding(
        id="TORCH_IMPORT_FAILED", severity="error", area="torch",
        title=title,
        detail=detail,
        fix=fix, facts=["torch.import_error", "python.executable"],
    )


@rule("TORCH_MISSING", severity="info", area="torch", priority=95,
      summary="torch is not installed for the probed Python")
def torch_missing(f: Facts):
    err = _import_error(f)
    if err is None or not _not_installed(err):
        return None
    python = f.get("python.executable") or "python3"
    return Finding(
        id="TORCH_MISSING", severity="info", area="torch",
        title="torch is not installed",
        detail=(f"{python} has no torch, so torch's CUDA version, arch list and ABI were not checked; the "
                "other verdicts stand on their own."),
        fix=[f"{python} -m pip install torch   (pick the CUDA variant your driver supports: "
             "https://download.pytorch.org/whl/cuXYZ)"],
        facts=["torch.import_error"],
    )


# What pip/uv print when a setup.py that imports torch runs in an isolated build environment.
_ISOLATION_MARKERS = ("pip-build-env", "getting requirements to build wheel", "build_meta.py",
                      "--no-build-isolation", "build-system.requires", "build dependency")


@rule("BUILD_ISOLATION_HIDES_TORCH", severity="error", area="torch", priority=22,
      summary="pip/uv built an extension in an isolated environment without torch, although torch is installed")
def build_isolation_hides_torch(f: Facts):
    text = error_texts(f)
    if "no module named 'torch'" not in text or not any(m in text for m in _ISOLATION_MARKERS):
        return None
    err = _import_error(f)
    if err is not None and _not_installed(err):
        return None  # torch really is missing here: TORCH_MISSING says so
    python = f.get("python.executable") or "python3"
    version = _torch_version(f)
    have = f"torch {version} is installed" if version else "torch is installed in the target environment"
    return Finding(
        id="BUILD_ISOLATION_HIDES_TORCH", severity="error", area="torch",
        title="the extension was built in an isolated environment that has no torch",
        detail=(f"The pasted error shows `No module named 'torch'` inside pip's isolated build environment "
                f"(build requirements, pip-build-env), while {have}. The project's setup.py imports torch "
                "but does not list it in [build-system] requires, so pip builds it without torch. Build "
                "against the installed torch instead, which is also the only way to match its version, "
                "CUDA and C++ ABI."),
        fix=[f"{python} -m pip install setuptools wheel ninja packaging",
             f"{python} -m pip install --no-build-isolation <package>   (uv: uv pip install --no-build-isolation <package>)"],
        facts=["error_text", "torch.version"],
    )
