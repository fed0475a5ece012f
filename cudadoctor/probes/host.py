"""Host facts: OS, CPU arch, distro, glibc, kernel, WSL generation, container runtime."""

from __future__ import annotations

import os
import platform
import re
from typing import Mapping

from cudadoctor.runner import Runner

from ._fs import Root

_CGROUP_HINTS = (
    ("kubepods", "kubernetes"),
    ("docker", "docker"),
    ("libpod", "podman"),
    ("podman", "podman"),
    ("containerd", "other"),
    ("lxc", "other"),
    ("crio", "other"),
)


def probe_host(runner: Runner, root: Root, env: Mapping[str, str]) -> dict:
    proc_version = (root.read_text("/proc/version") or "").strip() or None
    kernel = (root.read_text("/proc/sys/kernel/osrelease") or "").strip() or None
    if kernel is None and root.is_host:
        kernel = platform.release() or None
    wsl, wsl_hints = detect_wsl(root, proc_version, kernel, env)
    container, container_hints = detect_container(root, env)
    distro_id, distro_version, distro = read_os_release(root)
    return {
        "os": platform.system().lower() or None,
        "arch": _normalise_arch(platform.machine()),
        "distro": distro,
        "distro_id": distro_id,
        "distro_version": distro_version,
        "glibc": glibc_version(runner, root),
        "kernel": kernel,
        "proc_version": proc_version,
        "wsl": wsl,
        "wsl_hints": wsl_hints,
        "container": container,
        "container_hints": container_hints,
        "dev_dxg": root.exists("/dev/dxg"),
        "cpus": usable_cpus() if root.is_host else None,
        "mem_available_gib": _round(mem_available_gib(root.read_text("/proc/meminfo"))) if root.is_host else None,
    }


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity), which is what parallel builds get."""
    try:
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    except OSError:
        return os.cpu_count() or 1


def mem_available_gib(meminfo: str | None) -> float | None:
    """MemAvailable of /proc/meminfo text in GiB: what a build can use without swapping."""
    for line in (meminfo or "").splitlines():
        if line.startswith("MemAvailable:"):
            try:
                return int(line.split()[1]) / (1024 * 1024)
            except (IndexError, ValueError):
                return None
    return None


def _round(gib: float | None) -> float | None:
    return round(gib, 1) if gib is not None else None


def _normalise_arch(machine: str) -> str | None:
    m = (machine or "").lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(m, m or None)


def read_os_release(root: Root) -> tuple[str | None, str | None, str | None]:
    text = root.read_text("/etc/os-release") or root.read_text("/usr/lib/os-release")
    if not text:
        return None, None, None
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if "=" not in line or line.lstrip().startswith("#"):
            continue
        k, v = line.split("=", 1)
        fields[k.strip()] = v.strip().strip('"').strip("'")
    name = fields.get("NAME")
    ver = fields.get("VERSION_ID")
    if name and ver:
        distro = f"{name} {ver}"
    else:
        distro = fields.get("PRETTY_NAME") or name
    return fields.get("ID"), ver, distro


def glibc_version(runner: Runner, root: Root) -> str | None:
    if root.is_host:
        try:
            val = os.confstr("CS_GNU_LIBC_VERSION")  # "glibc 2.36"
        except (AttributeError, ValueError, OSError):
            val = None
        if val and val.startswith("glibc"):
            return val.split()[-1]
    res = runner.run(["ldd", "--version"], timeout=5)
    text = res.stdout or res.stderr
    first = text.splitlines()[0] if text else ""
    if "musl" in text.lower():
        return None
    m = re.search(r"(\d+\.\d+)\s*$", first)
    return m.group(1) if m else None


def detect_wsl(
    root: Root, proc_version: str | None, kernel: str | None, env: Mapping[str, str]
) -> tuple[int | None, list[str]]:
    hints: list[str] = []
    text = f"{proc_version or ''} {kernel or ''}"
    low = text.lower()
    if "microsoft" in low:
        hints.append("/proc/version mentions Microsoft")
    if root.exists("/dev/dxg"):
        hints.append("/dev/dxg")
    if root.isdir("/usr/lib/wsl"):
        hints.append("/usr/lib/wsl")
    if env.get("WSL_DISTRO_NAME") or env.get("WSL_INTEROP"):
        hints.append("WSL_DISTRO_NAME/WSL_INTEROP set")
    if not hints:
        return None, hints
    if "wsl2" in low or "microsoft-standard" in low or root.exists("/dev/dxg"):
        return 2, hints
    if "microsoft" in low:
        return 1, hints
    # /usr/lib/wsl or the env vars alone: WSL userland without a WSL kernel signature
    # (e.g. the tree was copied); call it WSL2, the only generation with GPU support.
    return 2, hints


def detect_container(root: Root, env: Mapping[str, str]) -> tuple[str | None, list[str]]:
    hints: list[str] = []
    found: list[str] = []
    if env.get("KUBERNETES_SERVICE_HOST"):
        hints.append("KUBERNETES_SERVICE_HOST set")
        found.append("kubernetes")
    if root.exists("/.dockerenv"):
        hints.append("/.dockerenv")
        found.append("docker")
    if root.exists("/run/.containerenv"):
        hints.append("/run/.containerenv")
        found.append("podman")
    cenv = env.get("container")
    if cenv:
        hints.append(f"container={cenv}")
        found.append({"podman": "podman", "docker": "docker"}.get(cenv, "other"))
    for path in ("/proc/1/cgroup", "/proc/self/cgroup"):
        text = root.read_text(path) or ""
        for needle, kind in _CGROUP_HINTS:
            if needle in text:
                hints.append(f"{path} mentions {needle}")
                found.append(kind)
                break
    if not found:
        return None, hints
    # Kubernetes is the most specific answer; then the runtime-specific marker files.
    for kind in ("kubernetes", "podman", "docker", "other"):
        if kind in found:
            return kind, hints
    return found[0], hints
