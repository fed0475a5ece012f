"""A healthy facts snapshot to start rule tests from, and a deep-merge helper to break one thing."""

from __future__ import annotations

import copy

HEALTHY = {
    "schema": "cudadoctor.facts/1",
    "host": {"os": "linux", "arch": "x86_64", "distro": "Ubuntu 22.04", "glibc": "2.35",
             "kernel": "6.5.0-35-generic", "wsl": None, "container": None},
    "driver": {"version": "550.54.15", "kernel_module": "550.54.15", "cuda": "12.4",
               "libcuda": ["/usr/lib/x86_64-linux-gnu/libcuda.so.1"], "error": None,
               "device_nodes": ["/dev/nvidia0", "/dev/nvidiactl"]},
    "gpus": [{"index": 0, "name": "NVIDIA GeForce RTX 4090", "cc": "8.9", "memory_mib": 24564}],
    "toolkits": [{"root": "/usr/local/cuda-12.4", "nvcc": "12.4.131", "via": ["CUDA_HOME", "PATH"],
                  "headers_missing": []}],
    "host_compiler": {"name": "gcc", "version": "11.4.0", "path": "/usr/bin/g++"},
    "python": {"version": "3.11.7", "executable": "/usr/bin/python3"},
    "torch": {"version": "2.5.1+cu124", "cuda": "12.4",
              "arch_list": ["sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90"],
              "cxx11_abi": False, "cudnn": "9.1.0", "cuda_available": True,
              "device_error": None, "import_error": None},
    "env": {"CUDA_HOME": "/usr/local/cuda-12.4", "PATH": "/usr/local/cuda-12.4/bin:/usr/bin"},
    "tools": {"ninja": "1.11.1", "compute_sanitizer": "2024.1.0", "docker": None},
    "extensions": [],
    "error_text": None,
}

_DELETE = object()
DELETE = _DELETE


def facts(**changes) -> dict:
    """HEALTHY with ``changes`` merged in: section=dict merges, section=value replaces, DELETE drops.

    ``facts(driver={"cuda": "11.4"}, gpus=[...], env={"TORCH_CUDA_ARCH_LIST": "7.0"})``
    """
    out = copy.deepcopy(HEALTHY)
    for key, val in changes.items():
        if val is DELETE:
            out.pop(key, None)
        elif isinstance(val, dict) and isinstance(out.get(key), dict):
            for k, v in val.items():
                if v is DELETE:
                    out[key].pop(k, None)
                else:
                    out[key][k] = v
        else:
            out[key] = val
    return out


def ids(facts_dict: dict, **kw) -> list[str]:
    from cudadoctor.doctor import diagnose

    return [f["id"] for f in diagnose(facts_dict, **kw)["findings"]]


def finding(facts_dict: dict, fid: str, **kw) -> dict:
    from cudadoctor.doctor import diagnose

    for f in diagnose(facts_dict, **kw)["findings"]:
        if f["id"] == fid:
            return f
    raise AssertionError(f"{fid} not reported; got {ids(facts_dict, **kw)}")
