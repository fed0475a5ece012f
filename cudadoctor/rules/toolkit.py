"""Toolkit rules: nvcc present, matching torch's CUDA, consistent, complete; host compiler accepted."""

from __future__ import annotations

from cudadoctor.findings import Finding
from cudadoctor.knowledge import load_table
from cudadoctor.rules import Facts, rule
from cudadoctor.rules._kb import (
    build_toolkit,
    compiler_max,
    driver_view,
    error_texts,
    gpu_ccs,
    gpus_present,
    toolkits,
    torch_cuda,
    wheel_fix,
)
from cudadoctor.versions import CudaVersion, parse

_NVCC_MISSING_TEXT = ("cuda_home environment variable is not set", "nvcc: not found", "nvcc: command not found",
                      "no such file or directory: '/usr/local/cuda/bin/nvcc'")
PURELIB = "$(python -c 'import sysconfig; print(sysconfig.get_paths()[\"purelib\"])')"


def _root(tk: dict) -> str | None:
    r = tk.get("root")
    return r.rstrip("/") if isinstance(r, str) and r else None


def _nvcc(tk: dict | None) -> CudaVersion | None:
    return CudaVersion.parse(tk.get("nvcc")) if isinstance(tk, dict) else None


def _via(tk: dict) -> list[str]:
    v = tk.get("via")
    return [str(x) for x in v] if isinstance(v, list) else []


def _install_toolkit(cuda: CudaVersion) -> list[str]:
    dash = f"{cuda.major}-{cuda.minor}"
    return [
        f"sudo apt-get install -y cuda-toolkit-{dash}   (NVIDIA's apt repository), then "
        f"export CUDA_HOME=/usr/local/cuda-{cuda} PATH=/usr/local/cuda-{cuda}/bin:$PATH",
        f"or: conda install -c nvidia cuda-toolkit={cuda}",
    ]


def _matching_toolkit(f: Facts, cuda: CudaVersion, *, same_minor: bool) -> dict | None:
    for tk in toolkits(f)[1:]:
        v = _nvcc(tk)
        if v is None or _root(tk) is None:
            continue
        if v.major == cuda.major and (not same_minor or v.minor == cuda.minor):
            return tk
    return None


def _use_toolkit(tk: dict) -> str:
    r = _root(tk)
    return f"export CUDA_HOME={r} PATH={r}/bin:$PATH   (CUDA {_nvcc(tk)}, already installed)"


@rule("NVCC_MISSING", severity="warning", area="toolkit", priority=50,
      summary="no nvcc / CUDA_HOME, so extensions cannot be built here")
def nvcc_missing(f: Facts):
    tks = f.get("toolkits")
    need = torch_cuda(f)
    said = next((t for t in _NVCC_MISSING_TEXT if t in error_texts(f)), None)
    if isinstance(tks, list):
        if any(isinstance(t, dict) and t.get("nvcc") for t in tks):
            return None
        if need is None and not gpus_present(f) and not said:
            return None
    elif not said:
        return None  # toolkits not probed and nothing says nvcc is missing
    fix = _install_toolkit(need) if need else [
        "find torch's CUDA: python -c 'import torch; print(torch.version.cuda)'; install that toolkit "
        "(e.g. sudo apt-get install -y cuda-toolkit-12-4) and export CUDA_HOME=/usr/local/cuda-12.4"]
    return Finding(
        id="NVCC_MISSING",
        severity="warning",
        title="no CUDA compiler (nvcc) found: CUDA extensions cannot be built here",
        detail="toolkits lists no nvcc (looked at CUDA_HOME, CUDA_PATH, PATH, /usr/local/cuda*, conda and "
        "pip nvidia-* wheels)" + (f"; torch was built with CUDA {need}, so a CUDA {need} toolkit matches it" if need else "")
        + ". Prebuilt wheels still work." + (f" The error says {said!r}." if said else ""),
        fix=fix,
        facts=["toolkits", "torch.cuda", "env.CUDA_HOME"],
        area="toolkit",
    )


def _mismatch(f: Facts, major: bool):
    tk = build_toolkit(f)
    nvcc, need = _nvcc(tk), torch_cuda(f)
    if nvcc is None or need is None:
        return None
    if major and nvcc.major == need.major:
        return None
    if not major and (nvcc.major != need.major or nvcc.minor == need.minor):
        return None
    fix = []
    other = _matching_toolkit(f, need, same_minor=True)
    if other is None and major:
        other = _matching_toolkit(f, need, same_minor=False)
    if other is not None:
        fix.append(_use_toolkit(other))
    wf = wheel_fix(driver=driver_view(f), ccs=[c for _, _, c in gpu_ccs(f)], current_torch=f.get("torch.version"), cuda=nvcc)
    if other is None:
        fix += _install_toolkit(need)
    if wf:
        fix.append(f"or install the torch build for this nvcc's CUDA {nvcc}: {wf[0]}")
    where = _root(tk) or "nvcc on PATH"
    if major:
        detail = (f"toolkits[0] ({where}) is nvcc {tk.get('nvcc')} (CUDA {nvcc}) but torch.cuda is {need}; "
                  "torch.utils.cpp_extension refuses to build: 'The detected CUDA version "
                  f"({nvcc}) mismatches the version that was used to compile PyTorch ({need})'.")
    else:
        detail = (f"toolkits[0] ({where}) is nvcc {tk.get('nvcc')} (CUDA {nvcc}) while torch.cuda is {need}; "
                  "torch only warns, and the build usually works, but the extension then links against a "
                  "different CUDA runtime minor than torch.")
    return Finding(
        id="NVCC_TORCH_MAJOR_MISMATCH" if major else "NVCC_TORCH_MINOR_MISMATCH",
        severity="error" if major else "warning",
        title=f"nvcc is CUDA {nvcc} but torch was built with CUDA {need}",
        detail=detail,
        fix=fix,
        facts=["toolkits[0].nvcc", "torch.cuda"],
        area="toolkit",
    )


@rule("NVCC_TORCH_MAJOR_MISMATCH", severity="error", area="toolkit", priority=30,
      summary="nvcc major version differs from torch.version.cuda major (torch refuses to build)")
def nvcc_torch_major_mismatch(f: Facts):
    return _mismatch(f, major=True)


@rule("NVCC_TORCH_MINOR_MISMATCH", severity="warning", area="toolkit", priority=52,
      summary="nvcc and torch.version.cuda have the same major but a different minor version")
def nvcc_torch_minor_mismatch(f: Facts):
    return _mismatch(f, major=False)


@rule("TOOLKIT_CONFLICT", severity="warning", area="toolkit", priority=45,
      summary="nvcc on PATH and CUDA_HOME point at different toolkits")
def toolkit_conflict(f: Facts):
    tks = toolkits(f)
    home = next((t for t in tks if {"CUDA_HOME", "CUDA_PATH"} & set(_via(t))), None)
    onpath = next((t for t in tks if "PATH" in _via(t)), None)
    if home is None or onpath is None or home is onpath:
        return None
    if _root(home) is None or _root(onpath) is None or _root(home) == _root(onpath):
        return None
    vh, vp = _nvcc(home), _nvcc(onpath)
    if vh is not None and vp is not None and vh == vp:
        return None  # two paths to the same release (e.g. /usr/local/cuda -> cuda-12.1)
    need = torch_cuda(f)
    keep = home
    if need is not None and vp is not None and (vp.major, vp.minor) == (need.major, need.minor):
        keep = onpath
    r = _root(keep)
    return Finding(
        id="TOOLKIT_CONFLICT",
        severity="warning",
        title="CUDA_HOME and the nvcc on PATH are different toolkits",
        detail=f"CUDA_HOME/CUDA_PATH selects {_root(home)} (nvcc {home.get('nvcc') or '?'}) but PATH finds nvcc in "
        f"{_root(onpath)} (nvcc {onpath.get('nvcc') or '?'}); torch builds use CUDA_HOME's headers and "
        "libraries while other tools call the PATH nvcc, mixing two CUDA versions.",
        fix=[f"export CUDA_HOME={r} PATH={r}/bin:$PATH"
             + (f"   (matches torch's CUDA {need})" if need is not None and _nvcc(keep) == need else "")],
        facts=["toolkits", "env.CUDA_HOME", "env.PATH"],
        area="toolkit",
    )


def _missing_headers(tk: dict) -> list[str]:
    """Headers a build with this toolkit would not find. ``headers_unresolved`` (the probe's check of
    the whole include path: toolkit, nvcc's own dirs, CPATH, ...) wins over ``headers_missing``
    (the toolkit's include dirs alone)."""
    for key in ("headers_unresolved", "missing_headers", "headers_missing"):
        v = tk.get(key)
        if isinstance(v, list):
            return [str(x) for x in v if x]
    h = tk.get("headers")
    if isinstance(h, dict):
        return sorted(str(k) for k, ok in h.items() if ok is False)
    return []


@rule("TOOLKIT_INCOMPLETE", severity="error", area="toolkit", priority=34,
      summary="the build toolkit lacks headers torch's CUDA headers include (cusparse.h, cublas_v2.h, ...)")
def toolkit_incomplete(f: Facts):
    tk = build_toolkit(f)
    missing = _missing_headers(tk) if tk else []
    if tk and any(tk.get(k) is True for k in ("headers_supplied", "include_supplied")):
        return None
    text = error_texts(f)
    said = [h for h in ("cusparse.h", "cublas_v2.h", "cusolverdn.h", "curand.h", "cufft.h", "cublaslt.h")
            if f"{h}: no such file" in text]
    if not missing and not said:
        return None
    names = missing or said
    where = _root(tk) if tk else None
    fix = []
    elsewhere = tk.get("headers_elsewhere") if tk else None
    if isinstance(elsewhere, dict):
        dirs = []
        for h in names:
            for hit in elsewhere.get(h) or []:
                d = str(hit).rsplit("/", 1)[0] if "/" in str(hit) else None
                if d and d not in dirs:
                    dirs.append(d)
                    break
        if dirs:
            fix.append(f"export CPATH={':'.join(dirs)}:$CPATH   (where the probe found {', '.join(names)})")
    for other in toolkits(f):
        r = _root(other)
        if other is tk or r is None or _missing_headers(other):
            continue
        if "site-packages" in r or "dist-packages" in r:
            if any(x.startswith("export CPATH") for x in fix):
                continue
            fix.append(f"export CPATH={r}/include:$CPATH   (headers from the pip nvidia wheels)")
        elif other.get("nvcc"):
            fix.append(f"or export CUDA_HOME={r}   (a toolkit that has them)")
    need = torch_cuda(f) or _nvcc(tk)
    if not any(x.startswith("export CPATH") for x in fix):
        if need is not None and need.major >= 13:
            fix.insert(0, f"export CPATH={PURELIB}/nvidia/cu{need.major}/include:$CPATH")
        else:
            fix.insert(0, f"export CPATH={PURELIB}/nvidia/cusparse/include:{PURELIB}/nvidia/cublas/include:$CPATH")
    if need is not None:
        fix.append(f"or install the library headers: sudo apt-get install -y cuda-libraries-dev-{need.major}-{need.minor}")
    return Finding(
        id="TOOLKIT_INCOMPLETE",
        severity="error",
        title=f"the CUDA toolkit builds use lacks {', '.join(names)}",
        detail=(f"toolkits[0] ({where}) has no {', '.join(names)}" if missing else
                f"the build failed with '{said[0]}: No such file or directory'")
        + "; ATen/cuda/CUDAContext.h includes them, so every torch CUDA extension fails to compile until "
        "another include directory supplies them.",
        fix=fix,
        facts=["toolkits[0].root", "toolkits[0].headers_missing", "toolkits[0].headers_unresolved"]
        + (["error_text"] if said else []),
        area="toolkit",
    )


def _first_cuda_accepting(family: str, major: int) -> str | None:
    key = "clang_max" if family == "clang" else "gcc_max"
    best = None
    for row in load_table("host_compilers"):
        c = CudaVersion.parse(row.get("cuda"))
        if c is not None and int(row.get(key, 0)) >= major and (best is None or c < best):
            best = c
    return str(best) if best else None


@rule("HOST_COMPILER_UNSUPPORTED", severity="error", area="compiler", priority=36,
      summary="the host g++/clang version is outside what this nvcc accepts")
def host_compiler_unsupported(f: Facts):
    hc = f.section("host_compiler")
    tk = build_toolkit(f)
    nvcc = _nvcc(tk)
    v = parse(hc.get("version"))
    if nvcc is None or v is None:
        return None
    name = str(hc.get("name") or "gcc").lower()
    path = str(hc.get("path") or "")
    family = "clang" if "clang" in name or "clang" in path.rsplit("/", 1)[-1] else "gcc"
    top = compiler_max(nvcc, family)
    have = v.release[0]
    if top is None or have <= top:
        return None
    if family == "clang":
        fix = [f"sudo apt-get install -y clang-{top} && export CUDAHOSTCXX=/usr/bin/clang++-{top}"]
    else:
        fix = [f"sudo apt-get install -y g++-{top} && export CUDAHOSTCXX=/usr/bin/g++-{top}",
               f"(CMake builds: -DCMAKE_CUDA_HOST_COMPILER=/usr/bin/g++-{top})"]
    newer = _first_cuda_accepting(family, have)
    if newer:
        fix.append(f"or use a CUDA {newer} or newer toolkit, which accepts {family} {have}")
    return Finding(
        id="HOST_COMPILER_UNSUPPORTED",
        severity="error",
        title=f"{family} {have} is newer than nvcc {nvcc} accepts (at most {family} {top})",
        detail=f"host_compiler is {family} {hc.get('version')} and toolkits[0] is nvcc {tk.get('nvcc')}; "
        f"CUDA {nvcc}'s host_config.h stops with '#error -- unsupported "
        f"{'clang' if family == 'clang' else 'GNU'} version' above {family} {top}. "
        "-allow-unsupported-compiler only moves the failure into libstdc++ headers.",
        fix=fix,
        facts=["host_compiler.version", "host_compiler.name", "toolkits[0].nvcc"],
        area="compiler",
    )


_PYTHON_H_TEXT = ("python.h: no such file or directory", "python.h: no such file or folder",
                  "python.h: no such directory or file", "cannot open include file: 'python.h'")
_APT = ("debian", "ubuntu", "mint", "pop", "raspbian", "kali")
_DNF = ("fedora", "rhel", "centos", "rocky", "alma", "amzn", "amazon", "ol", "oracle", "red hat")


def _distro_family(f: Facts) -> str | None:
    names = " ".join(str(f.get(k) or "") for k in ("host.distro_id", "host.distro")).lower()
    if any(n in names.split() or names.startswith(n) for n in _APT):
        return "apt"
    if any(n in names.split() or names.startswith(n) for n in _DNF):
        return "dnf"
    if "alpine" in names:
        return "apk"
    if "suse" in names:
        return "zypper"
    return None


def _python_headers_fix(f: Facts, mm: str | None, inc: str | None) -> list[str]:
    ver = f"python{mm}" if mm else "python3"
    system = inc is None or inc.startswith("/usr/include/")
    family = _distro_family(f)
    fix: list[str] = []
    if system:
        apt = f"sudo apt-get install -y {ver}-dev   (Debian, Ubuntu: the headers of the distribution's {ver})"
        dnf = (f"sudo dnf install -y {ver}-devel   (Fedora, RHEL and derivatives; python3-devel for the "
               "distribution's default python3)")
        by = {"apt": [apt], "dnf": [dnf], "apk": ["apk add python3-dev   (Alpine)"],
              "zypper": [f"sudo zypper install -y {ver.replace('.', '')}-devel   (openSUSE)"]}
        fix += by.get(family or "", [apt, dnf])
    else:
        fix.append(f"the Python at {inc.rsplit('/include', 1)[0]} was installed without its headers: install a "
                   "build that ships them (pyenv install, uv python install, conda, the python.org installers "
                   "all do) and recreate the virtual environment from it")
    fix.append("or build in a container that has them: cudadoctor build --backend docker")
    return fix


@rule("PYTHON_HEADERS_MISSING", severity="error", area="compiler", priority=37,
      summary="the probed Python has no Python.h, which every torch C++/CUDA extension build includes")
def python_headers_missing(f: Facts):
    has = f.get("python.has_python_h")
    said = next((t for t in _PYTHON_H_TEXT if t in error_texts(f)), None)
    if has is True or (has is None and not said):
        return None
    inc = f.get("python.include_dir") if isinstance(f.get("python.include_dir"), str) else None
    v = parse(f.get("python.version"))
    mm = f"{v.release[0]}.{v.release[1]}" if v is not None and len(v.release) >= 2 else None
    python = f.get("python.executable") or "python3"
    can_build = any(isinstance(t, dict) and t.get("nvcc") for t in toolkits(f)) or said is not None
    where = f"{inc} has no Python.h" if inc else "Python.h was not found"
    return Finding(
        id="PYTHON_HEADERS_MISSING",
        severity="error" if can_build else "warning",
        title=f"{'Python ' + mm if mm else 'this Python'}'s C headers (Python.h) are not installed",
        detail=(f"{python}: {where}. torch/extension.h includes it (torch/csrc/python_headers.h), so every "
                "C++/CUDA extension build for this interpreter stops with 'fatal error: Python.h: No such file "
                "or directory'; running prebuilt wheels is unaffected."
                + (" Distribution Pythons ship the headers in a separate -dev / -devel package."
                   if inc is None or inc.startswith("/usr/include/") else "")
                + (f" The error says {said!r}." if said else "")
                + ("" if can_build else " No nvcc was found either, so nothing is built here yet.")),
        fix=_python_headers_fix(f, mm, inc),
        facts=["python.has_python_h", "python.include_dir", "python.version"],
        area="compiler",
    )
