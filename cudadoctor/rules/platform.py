"""Platform rules: containers started without GPUs, WSL driver layout, no GPU at all."""

from __future__ import annotations

import re

from cudadoctor.findings import Finding
from cudadoctor.rules import Facts, rule
from cudadoctor.rules._kb import gpus_present

WSL_LIB = "/usr/lib/wsl/lib/"
# messages of someone who expected a GPU to be usable here
_GPU_TROUBLE = re.compile(
    r"nvidia-smi|is_available|no cuda gpus|cuda-capable device|nvidia driver|cuda driver|libcuda|"
    r"cudagetdevicecount|cuda initialization|nvml|no gpu", re.IGNORECASE)
_VOID = ("void", "none", "")


def _container(f: Facts) -> str | None:
    c = f.get("host.container")
    return c if isinstance(c, str) and c else None


def _driver_seen(f: Facts) -> bool:
    if f.get("driver.version") or f.get("driver.kernel_module") or f.get("driver.cuda") or f.list("driver.libcuda"):
        return True
    # torch only reports "found version NNNNN" after talking to a driver
    text = " ".join(str(f.get(p) or "") for p in ("error_text", "torch.device_error")).lower()
    return "found version" in text or f.get("torch.cuda_available") is True


def _device_nodes(f: Facts) -> list | None:
    """/dev/nvidia* nodes if the probe recorded them (host.devices / driver.device_nodes), else None."""
    for path in ("host.devices", "host.device_nodes", "driver.device_nodes"):
        v = f.get(path)
        if isinstance(v, list):
            return v
    return None


def container_without_gpu(f: Facts) -> bool:
    """Inside a container that was given no GPU (no devices, no driver, or VISIBLE_DEVICES void)."""
    if not _container(f):
        return False
    nvd = f.env("NVIDIA_VISIBLE_DEVICES")
    if nvd is not None and nvd.strip().lower() in _VOID:
        return True
    if _device_nodes(f) or gpus_present(f) or _driver_seen(f):
        return False  # /dev/nvidia*, a GPU or the driver were injected
    if _caps_missing(f):
        return False  # GPUs were requested; the capability list keeps libcuda out (CONTAINER_CAPABILITIES)
    return _gpu_intended(f)


def _caps_missing(f: Facts) -> list[str]:
    caps = f.env("NVIDIA_DRIVER_CAPABILITIES")
    if caps is None:
        return []
    names = {c.strip().lower() for c in caps.replace(";", ",").split(",") if c.strip()}
    if "all" in names:
        return []
    return [c for c in ("compute", "utility") if c not in names]


def _gpu_intended(f: Facts) -> bool:
    """Signs that this container was meant to have a GPU: NVIDIA's images set NVIDIA_VISIBLE_DEVICES,
    or the user is diagnosing a GPU error. A plain CPU-only container gets NO_GPU instead."""
    if f.env("NVIDIA_VISIBLE_DEVICES") is not None:
        return True
    text = " ".join(str(f.get(p) or "") for p in ("error_text", "torch.device_error"))
    return bool(_GPU_TROUBLE.search(text))


def _run_hint(container: str) -> list[str]:
    if container == "kubernetes":
        return [
            "request the GPU in the pod spec: resources.limits: {nvidia.com/gpu: 1} "
            "(and runtimeClassName: nvidia where the cluster uses one)",
        ]
    if container == "podman":
        return ["podman run --device nvidia.com/gpu=all ...   (after: sudo nvidia-ctk cdi generate --output=/etc/cdi/nvidia.yaml)"]
    return [
        "docker run --gpus all -e NVIDIA_DRIVER_CAPABILITIES=compute,utility ...",
        "on the host, if --gpus is refused: sudo apt-get install -y nvidia-container-toolkit && "
        "sudo nvidia-ctk runtime configure --runtime=docker && sudo systemctl restart docker",
    ]


@rule("CONTAINER_NO_GPU", severity="error", area="platform", priority=5,
      summary="inside a container started without GPUs (no /dev/nvidia*, NVIDIA_VISIBLE_DEVICES void)")
def container_no_gpu(f: Facts):
    if not container_without_gpu(f):
        return None
    c = _container(f) or "container"
    nvd = f.env("NVIDIA_VISIBLE_DEVICES")
    why = [f"host.container is {c!r}"]
    paths = ["host.container"]
    if nvd is not None and nvd.strip().lower() in _VOID:
        why.append(f"NVIDIA_VISIBLE_DEVICES={nvd!r} hides every GPU")
        paths.append("env.NVIDIA_VISIBLE_DEVICES")
    else:
        why.append("no GPU is listed and no NVIDIA driver library or version is visible inside it")
        paths += ["gpus", "driver.libcuda", "driver.version"]
    err = f.get("driver.error")
    if isinstance(err, str) and err:
        why.append(f"driver probe said: {err.strip()[:120]}")
        paths.append("driver.error")
    return Finding(
        id="CONTAINER_NO_GPU",
        severity="error",
        title="this container was started without access to the GPUs",
        detail="; ".join(why) + ". The NVIDIA container runtime injects /dev/nvidia*, libcuda and "
        "nvidia-smi only when the container is started with GPUs; the host driver is not the problem.",
        fix=_run_hint(c),
        facts=paths,
        area="platform",
    )


@rule("CONTAINER_CAPABILITIES", severity="error", area="platform", priority=6,
      summary="NVIDIA_DRIVER_CAPABILITIES lacks compute (CUDA) or utility (NVML/nvidia-smi)")
def container_capabilities(f: Facts):
    caps = f.env("NVIDIA_DRIVER_CAPABILITIES")
    if caps is None or not _container(f) or container_without_gpu(f):
        return None
    missing = _caps_missing(f)
    if not missing:
        return None
    effect = []
    if "compute" in missing:
        effect.append("without compute the runtime does not mount libcuda, so CUDA cannot initialise")
    if "utility" in missing:
        effect.append("without utility there is no nvidia-smi / NVML")
    return Finding(
        id="CONTAINER_CAPABILITIES",
        severity="error",
        title=f"NVIDIA_DRIVER_CAPABILITIES={caps!r} lacks {' and '.join(missing)}",
        detail=f"env.NVIDIA_DRIVER_CAPABILITIES is {caps!r} inside a {_container(f)} container; "
        + "; ".join(effect) + ".",
        fix=[
            "docker run --gpus all -e NVIDIA_DRIVER_CAPABILITIES=compute,utility ...",
            "or in the Dockerfile: ENV NVIDIA_DRIVER_CAPABILITIES=compute,utility",
        ],
        facts=["env.NVIDIA_DRIVER_CAPABILITIES", "host.container"],
        area="platform",
    )


def _wsl2(f: Facts) -> bool:
    w = f.get("host.wsl")
    return w == 2 or w == "2"


@rule("WSL_LINUX_DRIVER", severity="error", area="platform", priority=7,
      summary="under WSL2 libcuda resolves outside /usr/lib/wsl/lib (a Linux driver installed inside WSL)")
def wsl_linux_driver(f: Facts):
    if not _wsl2(f):
        return None
    libs = [p for p in f.list("driver.libcuda") if isinstance(p, str)]
    if not libs or libs[0].startswith(WSL_LIB):
        return None
    foreign = [p for p in libs if not p.startswith(WSL_LIB)]
    fix = [
        "sudo apt-get purge 'nvidia-*' 'libnvidia-*' && sudo apt-get autoremove -y   (inside WSL; keep the Windows driver)",
    ]
    fix += [f"sudo rm -f {p}   (if no package owns it: dpkg -S {p})" for p in foreign]
    fix.append("sudo ldconfig && ls -l /usr/lib/wsl/lib/libcuda.so.1")
    return Finding(
        id="WSL_LINUX_DRIVER",
        severity="error",
        title="a Linux NVIDIA driver inside WSL2 shadows the Windows driver's libcuda",
        detail=f"host.wsl is 2 and the loader finds libcuda first at {libs[0]} (driver.libcuda: "
        f"{', '.join(libs)}). Under WSL2 only /usr/lib/wsl/lib/libcuda.so.1, provided by the Windows "
        "driver, can talk to the GPU; a Linux driver's libcuda fails to initialise.",
        fix=fix,
        facts=["host.wsl", "driver.libcuda"],
        area="platform",
    )


@rule("WSL_LIBCUDA_MISSING", severity="error", area="platform", priority=8,
      summary="under WSL2 /usr/lib/wsl/lib/libcuda.so.1 is absent (Windows driver missing or too old)")
def wsl_libcuda_missing(f: Facts):
    if not _wsl2(f):
        return None
    libs = f.get("driver.libcuda")
    if not isinstance(libs, list):
        return None
    if any(isinstance(p, str) and p.startswith(WSL_LIB) for p in libs):
        return None
    return Finding(
        id="WSL_LIBCUDA_MISSING",
        severity="error",
        title="WSL2 has no /usr/lib/wsl/lib/libcuda.so.1: the Windows NVIDIA driver is missing or too old",
        detail=f"host.wsl is 2 and driver.libcuda lists {libs or 'nothing'}; the Windows driver (R470 or "
        "newer with WSL support) provides /usr/lib/wsl/lib/libcuda.so.1 to every WSL2 distribution.",
        fix=[
            "install or update the NVIDIA driver on Windows (not inside WSL): https://www.nvidia.com/Download/index.aspx",
            "then in PowerShell: wsl --update; wsl --shutdown",
            "do not install a Linux NVIDIA driver inside WSL (sudo apt-get purge 'nvidia-*' if one is there)",
        ],
        facts=["host.wsl", "driver.libcuda"],
        area="platform",
    )


@rule("NO_GPU", severity="info", area="gpus", priority=90,
      summary="no NVIDIA GPU visible and nothing else is wrong")
def no_gpu(f: Facts):
    gpus = f.get("gpus")
    if not isinstance(gpus, list) or gpus:
        return None
    if _driver_seen(f) or _wsl2(f) or container_without_gpu(f) or _device_nodes(f):
        return None
    if f.get("torch.cuda_available") is True:
        return None
    c = _container(f)
    return Finding(
        id="NO_GPU",
        severity="info",
        title="no NVIDIA GPU is visible " + (f"in this {c} container" if c else "on this machine"),
        detail="gpus is empty and no NVIDIA driver is visible; CUDA code can be built here "
        "(with nvcc) but not run.",
        fix=_run_hint(c) if c else [],
        facts=["gpus", "driver.version"],
        area="gpus",
    )
