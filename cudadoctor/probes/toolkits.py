"""CUDA toolkits: every install a build could pick up, the one torch's cpp_extension uses first.

torch's order (torch.utils.cpp_extension._find_cuda_home): CUDA_HOME or CUDA_PATH, else the
directory above the ``nvcc`` found on PATH, else /usr/local/cuda if it exists. Other installs
(/usr/local/cuda-*, /opt/cuda*, $CONDA_PREFIX, pip ``nvidia/cu13`` and ``nvidia/cuda_nvcc``
wheels) follow, deduplicated by real path.
"""

from __future__ import annotations

import os
import re
from typing import Mapping, Sequence

from cudadoctor.runner import Runner

from ._fs import Root, split_path, unique

# Headers that torch's own CUDA headers (ATen/cuda/CUDAContext.h and friends) include.
TORCH_CUDA_HEADERS = (
    "cuda_runtime_api.h",
    "cusparse.h",
    "cublas_v2.h",
    "cublasLt.h",
    "cusolverDn.h",
    "cufft.h",
    "curand.h",
)

_NVCC_RE = re.compile(r"release\s+(\d+\.\d+),\s*V(\d+\.\d+\.\d+)")
_NVCC_SHORT_RE = re.compile(r"release\s+(\d+\.\d+)")
_WRAPPER_RE = re.compile(r"""exec\s+["']?(/[^"'\s]+/nvcc)\b""")


def parse_nvcc_version(text: str) -> str | None:
    m = _NVCC_RE.search(text or "")
    if m:
        return m.group(2)
    m = _NVCC_SHORT_RE.search(text or "")
    return m.group(1) if m else None


def parse_gpu_archs(text: str) -> list[str]:
    return [t for t in (text or "").split() if re.fullmatch(r"(compute|sm|lto)_\d+[a-z]?", t)]


def discover(root: Root, env: Mapping[str, str], site_dirs: Sequence[str]) -> tuple[list[dict], str | None]:
    """Candidate toolkit roots in order, merged by real path; and the root torch would use."""
    cands: list[tuple[str, str]] = []
    torch_home: str | None = None
    cuda_home = env.get("CUDA_HOME") or None
    cuda_path = env.get("CUDA_PATH") or None
    if cuda_home:
        cands.append((cuda_home, "CUDA_HOME"))
    if cuda_path:
        cands.append((cuda_path, "CUDA_PATH"))
    nvcc = root.which("nvcc", env.get("PATH"))
    if nvcc:
        cands.append((os.path.dirname(os.path.dirname(nvcc)), "PATH"))
    if root.exists("/usr/local/cuda"):
        cands.append(("/usr/local/cuda", "/usr/local/cuda"))
    if nvcc:
        target = wrapper_target(root, nvcc)
        if target:
            cands.append((os.path.dirname(os.path.dirname(target)), "PATH (nvcc wrapper target)"))
    torch_home = cuda_home or cuda_path or (os.path.dirname(os.path.dirname(nvcc)) if nvcc else None)
    if torch_home is None and root.exists("/usr/local/cuda"):
        torch_home = "/usr/local/cuda"
    for pattern in ("/usr/local/cuda-*", "/opt/cuda*", "/opt/nvidia/cuda*", "/usr/lib/cuda"):
        for p in root.glob(pattern):
            if root.isdir(p):
                cands.append((p, "/usr/local/cuda-*" if pattern == "/usr/local/cuda-*" else pattern))
    conda = env.get("CONDA_PREFIX")
    if conda and _looks_like_toolkit(root, conda):
        cands.append((conda, "CONDA_PREFIX"))
    for site in site_dirs:
        for sub in sorted(root.glob(os.path.join(site, "nvidia", "cu[0-9]*"))) + [os.path.join(site, "nvidia", "cuda_nvcc")]:
            if root.isdir(sub) and _looks_like_toolkit(root, sub):
                cands.append((sub, "pip"))

    merged: dict[str, dict] = {}
    for path, via in cands:
        path = os.path.normpath(path) if path.startswith("/") else path
        real = root.realpath(path) if path.startswith("/") else path
        entry = merged.get(real)
        if entry is None:
            merged[real] = {"root": path, "realpath": real, "via": [via]}
        elif via not in entry["via"]:
            entry["via"].append(via)
    return list(merged.values()), torch_home


def _looks_like_toolkit(root: Root, path: str) -> bool:
    return (
        root.exists(os.path.join(path, "bin", "nvcc"))
        or root.exists(os.path.join(path, "include", "cuda_runtime_api.h"))
        or bool(root.glob(os.path.join(path, "targets", "*", "include", "cuda_runtime_api.h")))
    )


def wrapper_target(root: Root, nvcc: str) -> str | None:
    """When ``nvcc`` is a small shell script that execs another nvcc, that nvcc's path."""
    host = root.host(nvcc)
    try:
        if os.path.getsize(host) > 8192:
            return None
        with open(host, "rb") as fh:
            head = fh.read(8192)
    except OSError:
        return None
    if not head.startswith(b"#!"):
        return None
    m = _WRAPPER_RE.search(head.decode("utf-8", "replace"))
    return m.group(1) if m else None


def include_dirs(root: Root, tk_root: str) -> list[str]:
    dirs = [os.path.join(tk_root, "include")] + root.glob(os.path.join(tk_root, "targets", "*", "include"))
    return [d for d in unique(dirs) if root.isdir(d)]


def nvcc_include_dirs(root: Root, nvcc_path: str) -> list[str]:
    """The include dirs nvcc adds itself (nvcc.profile: $(TOP)/targets/<arch>/include, $(TOP)/include)."""
    top = os.path.dirname(os.path.dirname(nvcc_path))
    return include_dirs(root, top)


def find_header(root: Root, header: str, dirs: Sequence[str]) -> str | None:
    for d in dirs:
        p = os.path.join(d, header)
        if root.isfile(p):
            return p
    return None


def probe_nvcc(runner: Runner, root: Root, nvcc_path: str, timeout: float) -> dict:
    out: dict = {"nvcc": None, "nvcc_output": None, "nvcc_error": None, "targets": None}
    exe = root.host(nvcc_path)
    res = runner.run([exe, "--version"], timeout=timeout)
    text = (res.stdout or "") + (res.stderr or "")
    if res.ok or _NVCC_SHORT_RE.search(text):
        out["nvcc"] = parse_nvcc_version(text)
        lines = [ln for ln in text.strip().splitlines() if ln.strip()]
        out["nvcc_output"] = lines[-2] if len(lines) >= 2 else (lines[0] if lines else None)
    if out["nvcc"] is None:
        out["nvcc_error"] = (res.error or text.strip() or f"nvcc exited {res.returncode}").replace(f"{exe}: ", "nvcc: ", 1)
        return out
    res = runner.run([exe, "--list-gpu-arch"], timeout=timeout)
    if res.ok:
        archs = parse_gpu_archs(res.stdout)
        out["targets"] = archs or None
    return out


def probe_toolkits(
    runner: Runner,
    root: Root,
    env: Mapping[str, str],
    site_dirs: Sequence[str],
    *,
    nvcc_timeout: float = 10.0,
    map_fn=map,
) -> list[dict]:
    """Every toolkit with nvcc version, targets and torch-header coverage; builds' choice first."""
    entries, torch_home = discover(root, env, site_dirs)
    torch_real = root.realpath(torch_home) if torch_home and torch_home.startswith("/") else torch_home
    if torch_home is not None and not any(e["realpath"] == torch_real for e in entries):
        entries.insert(0, {"root": torch_home, "realpath": torch_real, "via": ["CUDA_HOME"]})
    entries.sort(key=lambda e: 0 if e["realpath"] == torch_real else 1)

    for e in entries:
        tk = e["root"]
        e["exists"] = root.isdir(tk) if tk.startswith("/") else False
        e["torch_would_use"] = torch_real is not None and e["realpath"] == torch_real
        nvcc_path = os.path.join(tk, "bin", "nvcc")
        e["nvcc_path"] = nvcc_path if root.is_executable(nvcc_path) else None
        e["nvcc_wrapper_of"] = wrapper_target(root, nvcc_path) if e["nvcc_path"] else None
        e["include_dirs"] = include_dirs(root, tk) if e["exists"] else []
        vj = root.read_text(os.path.join(tk, "version.json"))
        m = re.search(r'"cuda"\s*:\s*\{[^}]*"version"\s*:\s*"([^"]+)"', vj or "")
        if not m:
            m = re.search(r"CUDA Version\s+(\S+)", root.read_text(os.path.join(tk, "version.txt")) or "")
        e["version_file"] = m.group(1) if m else None

    def _nvcc(e: dict) -> dict:
        if not e["nvcc_path"]:
            return {"nvcc": None, "nvcc_output": None, "nvcc_error": None, "targets": None}
        return probe_nvcc(runner, root, e["nvcc_path"], nvcc_timeout)

    for e, res in zip(entries, list(map_fn(_nvcc, entries))):
        e.update(res)
        if not e["exists"]:
            e["error"] = f"{e['root']} does not exist"

    search_extra = _header_search_dirs(root, env, site_dirs)
    for e in entries:
        missing = [h for h in TORCH_CUDA_HEADERS if find_header(root, h, e["include_dirs"]) is None]
        e["headers_missing"] = missing
        elsewhere: dict[str, list[str]] = {}
        others = [d for o in entries if o is not e for d in o["include_dirs"]]
        for h in missing:
            hits = [os.path.join(d, h) for d in unique(others + search_extra)
                    if d not in e["include_dirs"] and root.isfile(os.path.join(d, h))]
            if hits:
                elsewhere[h] = hits
        e["headers_elsewhere"] = elsewhere

    if entries and entries[0]["torch_would_use"]:
        first = entries[0]
        path = build_include_path(root, env, first)
        first["build_include_path"] = path
        first["headers_unresolved"] = [h for h in TORCH_CUDA_HEADERS if find_header(root, h, path) is None]
    return entries


def build_include_path(root: Root, env: Mapping[str, str], tk: dict) -> list[str]:
    """Directories an nvcc compile of a torch extension searches, in order."""
    dirs: list[str] = []
    inc = os.path.join(tk["root"], "include")
    if inc != "/usr/include":
        dirs.append(inc)
    if env.get("CUDA_INC_PATH"):
        dirs.append(env["CUDA_INC_PATH"])
    cudnn_home = env.get("CUDNN_HOME") or env.get("CUDNN_PATH")
    if cudnn_home:
        dirs.append(os.path.join(cudnn_home, "include"))
    if tk.get("nvcc_path"):
        real_nvcc = tk.get("nvcc_wrapper_of") or root.realpath(tk["nvcc_path"])
        dirs += nvcc_include_dirs(root, real_nvcc)
    for var in ("CPATH", "CPLUS_INCLUDE_PATH"):
        dirs += split_path(env.get(var))
    dirs += ["/usr/local/include", "/usr/include"]
    return [d for d in unique(dirs) if root.isdir(d)]


def _header_search_dirs(root: Root, env: Mapping[str, str], site_dirs: Sequence[str]) -> list[str]:
    dirs: list[str] = []
    for site in site_dirs:
        dirs += root.glob(os.path.join(site, "nvidia", "*", "include"))
    conda = env.get("CONDA_PREFIX")
    if conda:
        dirs += [os.path.join(conda, "include")] + root.glob(os.path.join(conda, "targets", "*", "include"))
    dirs += ["/usr/include", "/usr/local/include"]
    return [d for d in unique(dirs) if root.isdir(d)]
