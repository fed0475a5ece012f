"""Build script of the cudadoctor-ops wheel.

Compiles every csrc/*.cpp and csrc/*.cu into one extension, ``cudadoctor_ops._C``, with torch's
BuildExtension (ninja). Where the arch list holds 9.0, csrc_sm90a/*.cu (Hopper-only code: wgmma)
become a second extension, ``cudadoctor_ops._C_sm90a``, compiled for sm_90a alone. Arches come from TORCH_CUDA_ARCH_LIST (torch's rule). How many device
targets nvcc compiles at once is the build machine's choice, not the source's: ``cudadoctor build``
sizes ``nvcc --threads`` and ninja's jobs to the cores and memory (NVCC_APPEND_FLAGS, MAX_JOBS).
Build it against the installed torch:

    pip install --no-build-isolation --no-deps ./opsrc
"""

from __future__ import annotations

import glob
import os
import sys

from setuptools import find_packages, setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension

HERE = os.path.dirname(os.path.abspath(__file__))
os.chdir(HERE)  # setuptools wants source paths relative to this directory


def _sources() -> list[str]:
    found = glob.glob(os.path.join("csrc", "*.cpp")) + glob.glob(os.path.join("csrc", "*.cu"))
    return sorted(found)


def _extra_cuda_includes(wanted: tuple[str, ...] = ("cusparse.h", "cublas_v2.h")) -> list[str]:
    """Library headers that the sources pull in (ATen/cuda/CUDAContext.h: cusparse.h, cublas_v2.h;
    the cuDNN frontend: nvrtc.h).

    Some toolkits ship without them while the pip wheels of torch carry them under
    site-packages/nvidia/<pkg>/include; add those dirs only when the toolkit lacks the headers.
    """
    cuda_inc = os.path.join(CUDA_HOME or "", "include")
    missing = [h for h in wanted if not os.path.exists(os.path.join(cuda_inc, h))]
    if not missing:
        return []
    dirs: list[str] = []
    for entry in sys.path:
        base = os.path.join(entry, "nvidia")
        if not os.path.isdir(base):
            continue
        for inc in sorted(glob.glob(os.path.join(base, "*", "include"))):
            if any(os.path.exists(os.path.join(inc, h)) for h in missing) and inc not in dirs:
                dirs.append(inc)
    return dirs


def _frontend_include() -> str | None:
    """The directory holding cudnn_frontend.h: $CUDNN_FRONTEND_INCLUDE (a checkout's include/ of
    the header-only library) or the nvidia-cudnn-frontend pip package's include/."""
    env = os.environ.get("CUDNN_FRONTEND_INCLUDE", "")
    if env:
        return env if os.path.isfile(os.path.join(env, "cudnn_frontend.h")) else None
    try:
        import importlib.metadata as md

        files = md.files("nvidia-cudnn-frontend") or []
    except Exception:  # noqa: BLE001 - not installed
        return None
    for f in files:
        if str(f).replace("\\", "/").endswith("include/cudnn_frontend.h"):
            inc = os.path.dirname(str(f.locate()))
            return inc if os.path.isfile(os.path.join(inc, "cudnn_frontend.h")) else None
    return None


def _cudnn_frontend() -> tuple[dict | None, str]:
    """Build settings of csrc/cudnn_conv_stats.cpp and why: the C++ headers of the cuDNN frontend
    (header-only, see _frontend_include), cuDNN's headers and library from the nvidia-cudnn package
    torch depends on, and nvrtc.h (newer frontends include it) from the toolkit or torch's
    nvidia/* packages. Without them, or with CUDADOCTOR_OPS_CUDNN_FE=0, the op is built without a
    kernel (the Python layer falls back to the frontend's Python API, if installed, or to the
    usual forward)."""
    if os.environ.get("CUDADOCTOR_OPS_CUDNN_FE", "") == "0":
        return None, "CUDADOCTOR_OPS_CUDNN_FE=0"
    fe_inc = _frontend_include()
    if fe_inc is None:
        where = os.environ.get("CUDNN_FRONTEND_INCLUDE", "")
        return None, (f"no cudnn_frontend.h in CUDNN_FRONTEND_INCLUDE={where}" if where
                      else "nvidia-cudnn-frontend not installed and CUDNN_FRONTEND_INCLUDE unset")
    for entry in sys.path:
        base = os.path.join(entry, "nvidia", "cudnn")
        inc, lib = os.path.join(base, "include"), os.path.join(base, "lib")
        if os.path.isfile(os.path.join(inc, "cudnn.h")) and os.path.isfile(os.path.join(lib, "libcudnn.so.9")):
            fe = {"include_dirs": [fe_inc, inc], "library_dirs": [lib], "libraries": [":libcudnn.so.9"],
                  "extra_link_args": []}
            if os.path.isfile(os.path.join(fe_inc, "cudnn_frontend", "experimental", "nvrtc_shim.h")):
                # newer frontends call NVRTC directly (their run-time-compiled engines)
                nvrtc = _nvrtc_library()
                if nvrtc is None:
                    return None, f"the frontend in {fe_inc} needs NVRTC and no libnvrtc.so was found"
                fe["include_dirs"] += _extra_cuda_includes(("nvrtc.h",))
                fe["library_dirs"].append(nvrtc[0])
                fe["libraries"].append(nvrtc[1])
                fe["extra_link_args"].append("-Wl,-rpath," + nvrtc[2])
            return fe, f"frontend headers in {fe_inc}"
    return None, "cuDNN headers or libcudnn.so.9 (the nvidia-cudnn package) not found"


def _nvrtc_library() -> tuple[str, str, str] | None:
    """(directory, linker name, run-time search path) of libnvrtc: torch's nvidia/<pkg>/lib first
    (found at run time relative to this package, as torch finds it), else the toolkit's lib64."""
    for entry in sys.path:
        for so in sorted(glob.glob(os.path.join(entry, "nvidia", "*", "lib", "libnvrtc.so.[0-9]*"))):
            d = os.path.dirname(so)
            rel = os.path.relpath(d, entry)
            return d, ":" + os.path.basename(so), "$ORIGIN/../" + rel
    lib64 = os.path.join(CUDA_HOME or "", "lib64")
    if os.path.isfile(os.path.join(lib64, "libnvrtc.so")):
        return lib64, "nvrtc", lib64
    return None


def _nvcc_flags() -> list[str]:
    return [
        "-O3",
        "-lineinfo",
        "-Xfatbin",
        "-compress-all",
        "-DNDEBUG",
    ]


def _arch_list() -> list[str]:
    """TORCH_CUDA_ARCH_LIST's entries (torch's separators: spaces or semicolons), else the
    capabilities of the visible GPUs (what torch builds for when the list is unset)."""
    env = os.environ.get("TORCH_CUDA_ARCH_LIST", "").replace(";", " ").split()
    if env:
        return env
    try:
        import torch

        return [f"{a}.{b}" for a, b in {torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}]
    except Exception:  # noqa: BLE001 - no GPU, or none usable: nothing to add
        return []


def _sm90a() -> tuple[bool, str]:
    """Whether to build cudadoctor_ops._C_sm90a, and why: the arch list holds 9.0 (with or without
    +PTX or the a suffix) and CUDADOCTOR_OPS_SM90A is not 0."""
    if os.environ.get("CUDADOCTOR_OPS_SM90A", "") == "0":
        return False, "CUDADOCTOR_OPS_SM90A=0"
    archs = _arch_list()
    for a in archs:
        if a.split("+")[0].rstrip("a").strip() in ("9.0", "90"):
            return True, f"9.0 in the arch list {' '.join(archs)}"
    return False, f"no 9.0 in the arch list {' '.join(archs) or '(empty)'}"


_FE, _FE_WHY = _cudnn_frontend()
_SM90A, _SM90A_WHY = _sm90a()
print(f"cudadoctor-ops: _C_sm90a {'built' if _SM90A else 'not built'}: {_SM90A_WHY}", file=sys.stderr)
print(f"cudadoctor-ops: cudnn_conv_stats {'with' if _FE else 'without a kernel:'} {_FE_WHY}", file=sys.stderr)

ext = CUDAExtension(
    name="cudadoctor_ops._C",
    sources=_sources(),
    include_dirs=[os.path.join(HERE, "csrc")] + _extra_cuda_includes() + (_FE["include_dirs"] if _FE else []),
    define_macros=[("CUDADOCTOR_OPS_CUDNN_FE", "1")] if _FE else [],
    library_dirs=_FE["library_dirs"] if _FE else [],
    # libcudnn.so.9: the soname torch already loads (libtorch_cuda needs it), no search path at
    # run time; libnvrtc (newer frontends) with one
    libraries=_FE["libraries"] if _FE else [],
    extra_link_args=_FE["extra_link_args"] if _FE else [],
    extra_compile_args={"cxx": ["-O3", "-DNDEBUG"], "nvcc": _nvcc_flags()},
)

ext_modules = [ext]
if _SM90A:
    # its own -gencode: torch then adds no arch flags of its own to this extension
    ext_modules.append(CUDAExtension(
        name="cudadoctor_ops._C_sm90a",
        sources=sorted(glob.glob(os.path.join("csrc_sm90a", "*.cu"))),
        include_dirs=[os.path.join(HERE, "csrc_sm90a")] + _extra_cuda_includes(),
        extra_compile_args={"cxx": ["-O3", "-DNDEBUG"],
                            "nvcc": _nvcc_flags() + ["-gencode=arch=compute_90a,code=sm_90a"]},
    ))

setup(
    packages=find_packages(include=["cudadoctor_ops*"]),
    ext_modules=ext_modules,
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
