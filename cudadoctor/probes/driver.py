"""Driver facts: NVML (in a child process), nvidia-smi fallback, kernel module, libcuda copies.

NVML can hang or crash inside a broken driver install, so it is queried by a child Python with a
timeout; ``nvidia-smi`` runs through the runner with a timeout. Neither may take the doctor down.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import Mapping

from cudadoctor.runner import Runner

from ._fs import Root, split_path, unique

NVML_TAG = "cudadoctor-nvml-probe"
SMI_FIELDS = "index,name,compute_cap,memory.total,uuid,pci.bus_id,driver_version"
_STANDARD_LIB_DIRS = {
    "x86_64": ["/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/lib64", "/usr/lib64"],
    "aarch64": ["/lib/aarch64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/lib64", "/usr/lib64"],
}
_LDCONFIG_ARCH = {"x86_64": "x86-64", "aarch64": "AArch64"}


def nvml_script() -> str:
    return (Path(__file__).with_name("nvml_child.py")).read_text(encoding="utf-8")


def query_nvml(runner: Runner, python: str, timeout: float, env: Mapping[str, str] | None = None) -> dict:
    """NVML answer from the child: {"driver", "cuda", "gpus", "error"}; ``error`` on any failure."""
    res = runner.run([python, "-c", nvml_script(), NVML_TAG], timeout=timeout,
                     env=dict(env) if env is not None else None)
    data = _last_marked(res.stdout, "CUDADOCTOR_NVML ")
    if data is not None:
        return data
    if res.error:
        err = res.error.replace(f"{python}: ", "", 1)
    else:
        tail = (res.stderr or res.stdout or "").strip().splitlines()
        err = tail[-1] if tail else f"NVML probe exited with status {res.returncode}"
    return {"driver": None, "cuda": None, "gpus": [], "error": f"NVML probe failed: {err}"}


def _last_marked(stdout: str, mark: str) -> dict | None:
    for line in reversed((stdout or "").splitlines()):
        if line.startswith(mark):
            try:
                val = json.loads(line[len(mark):])
            except ValueError:
                return None
            return val if isinstance(val, dict) else None
    return None


def query_smi(runner: Runner, root: Root, env: Mapping[str, str], timeout: float) -> dict:
    """GPUs, driver version and driver CUDA from nvidia-smi; ``error`` holds its message verbatim."""
    smi = root.which("nvidia-smi", env.get("PATH")) or _first_existing(
        root, ["/usr/lib/wsl/lib/nvidia-smi", "/usr/bin/nvidia-smi"]
    )
    if smi is None:
        return {"path": None, "gpus": [], "driver": None, "cuda": None, "error": "nvidia-smi not found"}
    exe = root.host(smi)
    out: dict = {"path": smi, "gpus": [], "driver": None, "cuda": None, "error": None}
    res = runner.run([exe, f"--query-gpu={SMI_FIELDS}", "--format=csv,noheader"], timeout=timeout)
    if not res.ok and not res.error and "compute_cap" in (res.stdout + res.stderr):
        # drivers before 510 do not know the compute_cap field
        res = runner.run(
            [exe, f"--query-gpu={SMI_FIELDS.replace('compute_cap,', '')}", "--format=csv,noheader"],
            timeout=timeout,
        )
    if res.error:
        out["error"] = res.error.replace(f"{exe}: ", "nvidia-smi: ", 1)
        return out
    if res.returncode != 0:
        out["error"] = (res.stdout.strip() or res.stderr.strip() or f"nvidia-smi exited {res.returncode}")
        return out
    out["gpus"] = parse_smi_csv(res.stdout)
    drivers = [g.pop("driver_version") for g in out["gpus"] if g.get("driver_version")]
    out["driver"] = drivers[0] if drivers else None
    plain = runner.run([exe], timeout=timeout)
    m = re.search(r"CUDA Version:\s*([0-9.]+)", plain.stdout or "")
    out["cuda"] = m.group(1) if m else None
    return out


def parse_smi_csv(text: str) -> list[dict]:
    gpus: list[dict] = []
    for line in (text or "").splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) < 2 or not cells[0].isdigit():
            continue
        g: dict = {"index": int(cells[0]), "name": cells[1], "source": "nvidia-smi"}
        rest = cells[2:]
        if rest and re.fullmatch(r"\d+\.\d+", rest[0]):
            g["cc"] = rest.pop(0)
        elif rest and rest[0].startswith("[") :  # "[N/A]"
            rest.pop(0)
        if rest:
            m = re.match(r"(\d+)", rest.pop(0))
            g["memory_mib"] = int(m.group(1)) if m else None
        if rest:
            g["uuid"] = rest.pop(0)
        if rest:
            g["pci_bus_id"] = rest.pop(0)
        if rest:
            g["driver_version"] = rest.pop(0)
        gpus.append(g)
    return gpus


def _first_existing(root: Root, paths: list[str]) -> str | None:
    for p in paths:
        if root.is_executable(p):
            return p
    return None


def kernel_module_version(root: Root) -> tuple[str | None, str | None]:
    text = root.read_text("/proc/driver/nvidia/version")
    if not text:
        return None, None
    first = text.strip().splitlines()[0] if text.strip() else ""
    m = re.search(r"Kernel Module(?:\s+for\s+\S+)?\s+(\d+\.\d+(?:\.\d+)?)", first)
    if not m:
        m = re.search(r"\b(\d{3}\.\d+(?:\.\d+)?)\b", first)
    return (m.group(1) if m else None), first or None


def ldconfig_libs(runner: Runner, root: Root, env: Mapping[str, str], name: str, arch: str | None) -> tuple[list[str], str | None]:
    """Paths ld.so.cache maps ``name`` to, in cache order, for this CPU arch; and an error text."""
    ldconfig = root.which("ldconfig", (env.get("PATH") or "") + ":/sbin:/usr/sbin") or "/sbin/ldconfig"
    argv = [root.host(ldconfig) if root.is_host else "ldconfig"]
    if not root.is_host:
        argv += ["-C", root.host("/etc/ld.so.cache")]
    argv.append("-p")
    res = runner.run(argv, timeout=5)
    if not res.ok:
        return [], (res.error or res.stderr.strip() or f"ldconfig exited {res.returncode}")
    tag = _LDCONFIG_ARCH.get(arch or "")
    found = []
    for line in res.stdout.splitlines():
        line = line.strip()
        if not line.startswith(name + " ") or "=>" not in line:
            continue
        head, path = line.split("=>", 1)
        if tag and "(" in head and tag not in head:
            continue
        found.append(path.strip())
    return found, None


def find_libcuda(runner: Runner, root: Root, env: Mapping[str, str], arch: str | None) -> tuple[list[str], list[dict], str | None]:
    """Every libcuda.so.1 the dynamic loader can see, in its search order, deduplicated by realpath."""
    candidates: list[tuple[str, str]] = []
    for d in split_path(env.get("LD_LIBRARY_PATH")):
        candidates.append((os.path.join(d, "libcuda.so.1"), "LD_LIBRARY_PATH"))
    cached, err = ldconfig_libs(runner, root, env, "libcuda.so.1", arch)
    candidates += [(p, "ld.so.cache") for p in cached]
    candidates.append(("/usr/lib/wsl/lib/libcuda.so.1", "wsl"))
    for d in _STANDARD_LIB_DIRS.get(arch or "", []) + ["/lib", "/usr/lib"]:
        candidates.append((os.path.join(d, "libcuda.so.1"), "default"))
    paths: list[str] = []
    details: list[dict] = []
    seen: set[str] = set()
    for path, via in candidates:
        if not path.startswith("/") or not root.exists(path):
            continue
        real = root.realpath(path)
        if real in seen:
            continue
        seen.add(real)
        paths.append(path)
        details.append({"path": path, "realpath": real, "via": via, "version": _libcuda_version(real)})
    return paths, details, err


def _libcuda_version(real: str) -> str | None:
    m = re.search(r"libcuda\.so\.(\d+\.\d+(?:\.\d+)?)$", real)
    return m.group(1) if m else None


def device_nodes(root: Root) -> list[str]:
    return unique(root.glob("/dev/nvidia*"))


def probe_driver(
    runner: Runner,
    root: Root,
    env: Mapping[str, str],
    *,
    arch: str | None,
    python: str = sys.executable,
    nvml_timeout: float = 6.0,
    smi_timeout: float = 5.0,
) -> tuple[dict, list[dict]]:
    """The driver section and the GPU list (NVML first, nvidia-smi when NVML gives none)."""
    nvml = query_nvml(runner, python, nvml_timeout, env)
    smi: dict | None = None
    if nvml.get("error") or not nvml.get("driver"):
        smi = query_smi(runner, root, env, smi_timeout)
    kmod, kmod_line = kernel_module_version(root)
    libcuda, libcuda_details, ldconfig_error = find_libcuda(runner, root, env, arch)
    version = nvml.get("driver") or (smi or {}).get("driver")
    cuda = nvml.get("cuda") or (smi or {}).get("cuda")
    nodes = device_nodes(root)
    driver_signs = bool(nodes or kmod or libcuda or root.exists("/dev/dxg") or (smi and smi.get("path")))
    error = None
    if not version and driver_signs:
        # with no trace of a driver at all (a CPU machine) there is nothing to report as an error;
        # nvml_error/smi_error still say what was tried
        if nvml.get("error"):
            error = f"NVML: {nvml['error']}"
        elif smi and smi.get("error"):
            error = smi["error"]
    driver = {
        "version": version,
        "kernel_module": kmod,
        "kernel_module_line": kmod_line,
        "cuda": cuda,
        "libcuda": libcuda,
        "libcuda_details": libcuda_details,
        "device_nodes": nodes,
        "error": error,
        "nvml_error": nvml.get("error"),
        "smi_error": smi.get("error") if smi else None,
        "smi_path": smi.get("path") if smi else None,
        "source": "nvml" if nvml.get("driver") else ("nvidia-smi" if smi and smi.get("driver") else None),
    }
    if ldconfig_error:
        driver["ldconfig_error"] = ldconfig_error
    gpus = nvml.get("gpus") or []
    if not gpus and smi:
        gpus = smi.get("gpus") or []
    return driver, gpus
