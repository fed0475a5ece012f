"""Driver rules: no driver, kernel module / library mismatch, driver too old for torch or nvcc."""

from __future__ import annotations

import re

from cudadoctor.findings import Finding
from cudadoctor.rules import Facts, rule
from cudadoctor.rules._kb import (
    build_toolkit,
    driver_view,
    toolkits,
    error_texts,
    gpu_ccs,
    min_driver,
    minor_compat_floor,
    torch_cuda,
    wheel_fix,
)
from cudadoctor.rules.platform import container_without_gpu
from cudadoctor.versions import CudaVersion, parse

_NO_DRIVER_TEXT = (
    "found no nvidia driver",
    "couldn't communicate with the nvidia driver",
    "could not communicate with the nvidia driver",
    "nvidia driver is not loaded",
)
_MISMATCH_TEXT = "driver/library version mismatch"
_FOUND_VERSION = re.compile(r"found version (\d{4,5})")


def _wsl2(f: Facts) -> bool:
    return f.get("host.wsl") in (2, "2")


def _pasted_or_device(f: Facts) -> str:
    parts = [f.get("error_text"), f.get("torch.device_error"), f.get("torch.import_error")]
    return "\n".join(p for p in parts if isinstance(p, str)).lower()


def _mismatch(f: Facts) -> bool:
    user, kmod = f.get("driver.version"), f.get("driver.kernel_module")
    if isinstance(user, str) and isinstance(kmod, str):
        pu, pk = parse(user), parse(kmod)
        if pu is not None and pk is not None and pu != pk:
            return True
    return _MISMATCH_TEXT in error_texts(f)


@rule("DRIVER_LIBRARY_MISMATCH", severity="error", area="driver", priority=9,
      summary="kernel module version differs from the user-space driver (upgraded without reboot)")
def driver_library_mismatch(f: Facts):
    if _wsl2(f) or not _mismatch(f):
        return None
    user, kmod = f.get("driver.version"), f.get("driver.kernel_module")
    bits, paths = [], []
    if user and kmod:
        bits.append(f"the loaded kernel module is {kmod} (driver.kernel_module) but the user-space "
                    f"driver libraries are {user} (driver.version)")
        paths += ["driver.kernel_module", "driver.version"]
    err = f.get("driver.error")
    if isinstance(err, str) and _MISMATCH_TEXT in err.lower():
        bits.append(f"NVML says {err.strip()!r}")
        paths.append("driver.error")
    if not bits:
        bits.append("the error text reports 'Driver/library version mismatch'")
        paths.append("error_text")
    fix = [
        "sudo reboot",
        "or, with nothing using the GPU: sudo rmmod nvidia_uvm nvidia_drm nvidia_modeset nvidia && sudo modprobe nvidia",
        "to stop unattended upgrades doing it again: sudo apt-mark hold 'nvidia-driver-*' "
        "(unhold before a planned upgrade)",
    ]
    if f.get("host.container"):
        fix.insert(0, "this is a container: run the fix on the host, then restart the container")
    return Finding(
        id="DRIVER_LIBRARY_MISMATCH",
        severity="error",
        title="the NVIDIA kernel module and driver libraries are different versions",
        detail="; ".join(bits) + ". This happens when the driver package is upgraded without a reboot: "
        "NVML and CUDA refuse to talk to a kernel module of another version.",
        fix=fix,
        facts=paths,
        area="driver",
    )


@rule("NO_DRIVER", severity="error", area="driver", priority=10,
      summary="a GPU or its device nodes exist but no usable driver library (libcuda / NVML) loads")
def no_driver(f: Facts):
    if container_without_gpu(f) or _mismatch(f):
        return None
    if _wsl2(f) and isinstance(f.get("driver.libcuda"), list):
        return None  # WSL_LIBCUDA_MISSING / WSL_LINUX_DRIVER say it precisely
    if f.get("driver.version") or f.get("driver.cuda"):
        return None  # NVML / the driver answered
    if f.get("torch.cuda_available") is True:
        return None
    evidence, paths = [], []
    probed = isinstance(f.data.get("driver"), dict)  # a null driver section proves nothing
    gpus = f.list("gpus") if probed else []
    if gpus:
        names = ", ".join(str(g.get("name") or "?") for g in gpus if isinstance(g, dict))
        evidence.append(f"a GPU is present ({names})")
        paths.append("gpus")
    if f.get("driver.kernel_module"):
        evidence.append(f"the kernel module {f.get('driver.kernel_module')} is loaded")
        paths.append("driver.kernel_module")
    for node_path in ("host.devices", "host.device_nodes", "driver.device_nodes"):
        nodes = f.get(node_path)
        if isinstance(nodes, list) and nodes:
            evidence.append(f"device nodes exist ({', '.join(map(str, nodes[:3]))})")
            paths.append(node_path)
            break
    text = _pasted_or_device(f)
    said = next((t for t in _NO_DRIVER_TEXT if t in text), None)
    if said:
        evidence.append(f"the error says {said!r}")
        paths.append("error_text" if said in str(f.get("error_text") or "").lower() else "torch.device_error")
    if not evidence:
        return None
    err = f.get("driver.error")
    if isinstance(err, str) and err:
        evidence.append(f"the driver probe said {err.strip()[:160]!r}")
        paths.append("driver.error")
    need = torch_cuda(f)
    branch = None
    if need is not None:
        m = parse(min_driver(need, "linux"))
        branch = m.release[0] if m is not None else None
    pkg = f"nvidia-driver-{branch}" if branch else "nvidia-driver-<branch>"
    libs = [p for p in f.list("driver.libcuda") if isinstance(p, str)]
    fix = []
    if libs and not f.get("driver.kernel_module"):
        evidence.append(f"libcuda is installed ({libs[0]}) but no kernel module is loaded"
                        + (f" for kernel {f.get('host.kernel')}" if f.get("host.kernel") else ""))
        paths.append("driver.libcuda")
        fix.append("rebuild the module for the running kernel: sudo apt-get install -y linux-headers-$(uname -r) "
                   "&& sudo dkms autoinstall && sudo modprobe nvidia")
    if f.get("host.os") == "windows":
        fix.append("install the NVIDIA driver for this GPU from https://www.nvidia.com/Download/index.aspx and reboot")
    fix += [
        f"Ubuntu/Debian: sudo apt-get install -y {pkg} && sudo reboot   (or: sudo ubuntu-drivers install)",
        "if the driver is installed but not loaded: sudo modprobe nvidia   (check dmesg; with Secure Boot the module must be signed/enrolled)",
        "then check: nvidia-smi",
    ]
    return Finding(
        id="NO_DRIVER",
        severity="error",
        title="no usable NVIDIA driver: libcuda / NVML do not load",
        detail="; ".join(evidence) + ", but no user-space driver was found (driver.version and "
        "driver.version is empty: NVML / libcuda could not be used)." + (f" torch {f.get('torch.version')} needs a driver for CUDA {need} "
                                         f"or newer." if need else ""),
        fix=fix,
        facts=paths + ["driver.version", "driver.libcuda"],
        area="driver",
    )


@rule("DRIVER_TOO_OLD", severity="error", area="driver", priority=12,
      summary="the driver's CUDA is older than torch's CUDA and minor-version compatibility does not cover it")
def driver_too_old(f: Facts):
    need = torch_cuda(f)
    d = driver_view(f)
    text = _pasted_or_device(f) + "\n" + str(f.get("driver.error") or "").lower()
    found = _FOUND_VERSION.search(text)
    if d.cuda is None and found:
        d = type(d)(d.version, CudaVersion.parse(int(found.group(1))), d.os)
    said = "driver version is insufficient" in text or "driver on your system is too old" in text
    ok = d.supports(need)
    if ok is True:
        return None
    if ok is None and not said:
        return None
    paths = ["torch.cuda"]
    bits = []
    if d.cuda is not None:
        bits.append(f"the driver {d.version or ''} supports CUDA {d.cuda}".replace("  ", " "))
        paths += ["driver.version", "driver.cuda"]
    if need is not None:
        bits.append(f"torch {f.get('torch.version') or ''} was built with CUDA {need}".replace("  ", " "))
    if d.cuda is not None and need is not None and d.cuda.major == need.major:
        floor = minor_compat_floor(need.major, d.os)
        bits.append(f"minor-version compatibility for CUDA {need.major}.x needs driver >= {floor}")
    elif d.cuda is not None and need is not None:
        bits.append(f"minor-version compatibility does not cross from CUDA {d.cuda.major} to {need.major}")
    if said:
        bits.append("the error says the driver is too old / insufficient")
        paths.append("error_text")
    fix = []
    if need is not None:
        lin, win = min_driver(need, "linux"), min_driver(need, "windows")
        where = []
        if lin:
            where.append(f"Linux >= {lin}")
        if win:
            where.append(f"Windows >= {win}")
        if where:
            fix.append(f"upgrade the NVIDIA driver to one supporting CUDA {need} ({', '.join(where)})"
                       + ("; in a container or Kubernetes pod this is the host/node driver" if f.get("host.container") else ""))
        branch = parse(lin)
        if branch is not None and d.os != "windows" and not f.get("host.container"):
            fix.append(f"Ubuntu/Debian: sudo apt-get install -y nvidia-driver-{branch.release[0]} && sudo reboot"
                       "   (or any newer branch)")
    wf = wheel_fix(driver=d, ccs=[c for _, _, c in gpu_ccs(f)], current_torch=f.get("torch.version"))
    if wf:
        fix.append("or install a torch build this driver supports: " + wf[0])
    return Finding(
        id="DRIVER_TOO_OLD",
        severity="error",
        title=f"the NVIDIA driver is too old for this torch (CUDA {need or '?'} vs driver CUDA {d.cuda or '?'})",
        detail="; ".join(bits) + ".",
        fix=fix,
        facts=paths,
        area="driver",
    )


@rule("TOOLKIT_NEWER_THAN_DRIVER", severity="warning", area="driver", priority=40,
      summary="nvcc's CUDA is newer than the driver's: its PTX cannot be JIT-compiled, newer runtimes fail")
def toolkit_newer_than_driver(f: Facts):
    tk = build_toolkit(f)
    if tk is None:
        return None
    nvcc = CudaVersion.parse(tk.get("nvcc"))
    d = driver_view(f)
    if nvcc is None or d.cuda is None or nvcc <= d.cuda:
        return None
    ccs = sorted({c for _, _, c in gpu_ccs(f)})
    fix = []
    lin = min_driver(nvcc, d.os)
    if lin:
        fix.append(f"upgrade the driver to >= {lin} (supports CUDA {nvcc})")
    if ccs:
        fix.append(f'export TORCH_CUDA_ARCH_LIST="{";".join(ccs)}"   (build SASS for the GPU, so no PTX JIT is needed)')
    older = next((t for t in toolkits(f)[1:] if isinstance(t.get("root"), str)
                  and (CudaVersion.parse(t.get("nvcc")) or nvcc) <= d.cuda), None)
    if older is not None:
        r = older["root"].rstrip("/")
        fix.append(f"or build with the installed CUDA {CudaVersion.parse(older.get('nvcc'))} toolkit: "
                   f"export CUDA_HOME={r} PATH={r}/bin:$PATH")
    else:
        fix.append(f"or build with a CUDA {d.cuda} (or older) toolkit: sudo apt-get install -y "
                   f"cuda-toolkit-{d.cuda.major}-{d.cuda.minor} && export CUDA_HOME=/usr/local/cuda-{d.cuda}")
    return Finding(
        id="TOOLKIT_NEWER_THAN_DRIVER",
        severity="warning",
        title=f"nvcc {tk.get('nvcc')} is newer than the driver's CUDA {d.cuda}",
        detail=f"toolkits[0] ({tk.get('root') or 'nvcc'}) is CUDA {nvcc}; the driver {d.version or ''} "
        f"supports CUDA {d.cuda}. PTX from this nvcc cannot be JIT-compiled by the driver "
        "(CUDA_ERROR_UNSUPPORTED_PTX_VERSION) and binaries that need its runtime may fail.",
        fix=fix,
        facts=["toolkits[0].nvcc", "driver.cuda", "driver.version"],
        area="driver",
    )
