"""diagnose(facts) -> report: run every rule, rank the findings, attach the recommended arch list.

Pure: reads only the facts it is given (and the knowledge tables). A pasted error message
(``error_text``) re-ranks the findings so that the causes it implicates come first.
"""

from __future__ import annotations

import copy
import re
from typing import Any

from cudadoctor.findings import FACTS_SCHEMA, REPORT_SCHEMA, SEVERITY_ORDER, Finding, report_status
from cudadoctor.rules import Facts, evaluate

# Well-known error messages -> the findings that explain them, most likely first.
ERROR_SIGNATURES: tuple[tuple[str, tuple[str, ...]], ...] = (
    (r"no kernel image is available", ("EXT_NO_KERNEL_IMAGE", "TORCH_NO_KERNEL_IMAGE", "ARCH_LIST_EXCLUDES_GPU")),
    (r"is not compatible with the current pytorch installation|no longer supports this gpu",
     ("TORCH_NO_KERNEL_IMAGE",)),
    (r"cuda driver version is insufficient", ("DRIVER_TOO_OLD", "WSL_LIBCUDA_MISSING", "CONTAINER_CAPABILITIES")),
    (r"found version \d{4,5}|driver on your system is too old", ("DRIVER_TOO_OLD",)),
    (r"the detected cuda version \(.*\) mismatches the version that was used to compile pytorch",
     ("NVCC_TORCH_MAJOR_MISMATCH", "NVCC_TORCH_MINOR_MISMATCH", "TOOLKIT_CONFLICT")),
    (r"unsupported (gnu|clang) version", ("HOST_COMPILER_UNSUPPORTED",)),
    (r"undefined symbol", ("EXT_ABI_MISMATCH", "LD_LIBRARY_PATH_SHADOW")),
    (r"driver/library version mismatch", ("DRIVER_LIBRARY_MISMATCH",)),
    (r"(cusparse|cublas_v2|cublaslt|cusolverdn|curand|cufft)\.h: no such file", ("TOOLKIT_INCOMPLETE",)),
    (r"unsupported gpu architecture|is not defined for option 'gpu-architecture'|unknown cuda arch",
     ("ARCH_LIST_UNSUPPORTED",)),
    (r"nvidia-smi: (command )?not found", ("CONTAINER_NO_GPU", "NO_DRIVER", "WSL_LIBCUDA_MISSING")),
    (r"found no nvidia driver|couldn't communicate with the nvidia driver",
     ("NO_DRIVER", "CONTAINER_NO_GPU", "WSL_LINUX_DRIVER", "WSL_LIBCUDA_MISSING", "DRIVER_LIBRARY_MISMATCH")),
    (r"no cuda gpus are available|no cuda-capable device is detected",
     ("CUDA_VISIBLE_DEVICES_HIDES", "CONTAINER_NO_GPU", "NO_DRIVER", "CONTAINER_CAPABILITIES")),
    (r"torch not compiled with cuda enabled", ("TORCH_CPU_ONLY",)),
    (r"cuda_home environment variable is not set|nvcc: (command )?not found", ("NVCC_MISSING",)),
    (r"ninja is required|ninja: (command )?not found", ("NINJA_MISSING",)),
    (r"unsupported_ptx_version|unsupported \.version|ptx was compiled with an unsupported toolchain",
     ("TOOLKIT_NEWER_THAN_DRIVER",)),
    (r"cublas_status_|cudnn version incompatibility", ("LD_LIBRARY_PATH_SHADOW",)),
    (r"error 803|system has unsupported display driver / cuda driver combination",
     ("DRIVER_LIBRARY_MISMATCH", "DRIVER_TOO_OLD")),
    (r"no module named 'torch'", ("BUILD_ISOLATION_HIDES_TORCH", "TORCH_MISSING")),
    (r"segmentation fault|sigsegv", ("EXT_STATIC_CXX_RUNTIME", "TORCH_IMPORT_FAILED")),
    (r"lib(c10|torch)\w*\.so[\d.]*: cannot open shared object file", ("EXT_LOADED_BEFORE_TORCH", "TORCH_IMPORT_FAILED")),
    (r"version .(glibcxx|cxxabi)_[\d.]+. not found", ("LIBSTDCXX_TOO_OLD", "TORCH_IMPORT_FAILED")),
    (r"c\+\+\d\d or later compatible compiler is required|you need c\+\+\d\d to compile pytorch",
     ("CXX_STANDARD_TOO_OLD", "HOST_COMPILER_UNSUPPORTED")),
    (r"died due to signal 9|killed signal terminated program", ("BUILD_OUT_OF_MEMORY",)),
    (r"python\.h: no such (file or directory|file or folder|directory or file)|cannot open include file: 'python\.h'",
     ("PYTHON_HEADERS_MISSING",)),
)
_COMPILED = tuple((re.compile(p, re.IGNORECASE), ids) for p, ids in ERROR_SIGNATURES)


def implicated_ids(text: object) -> list[str]:
    """Finding ids an error message points at, most likely first (no duplicates)."""
    if not isinstance(text, str) or not text.strip():
        return []
    out: list[str] = []
    for rx, ids in _COMPILED:
        if rx.search(text):
            out.extend(i for i in ids if i not in out)
    return out


def rank(findings: list[Finding], implicated: list[str]) -> list[Finding]:
    """Findings implicated by the error text first within their severity, the rest keep their order."""
    pos = {fid: n for n, fid in enumerate(implicated)}
    indexed = list(enumerate(findings))
    indexed.sort(key=lambda t: (SEVERITY_ORDER.get(t[1].severity, 9), pos.get(t[1].id, len(pos)), t[0]))
    return [f for _, f in indexed]


def diagnose(facts: Any, *, error_text: str | None = None) -> dict[str, Any]:
    """The report (cudadoctor.report/1) for a facts snapshot; never raises on odd facts."""
    data: dict[str, Any] = copy.deepcopy(facts) if isinstance(facts, dict) else {}
    data.setdefault("schema", FACTS_SCHEMA)
    if isinstance(error_text, str) and error_text.strip():
        data["error_text"] = error_text
    findings = evaluate(data)
    if any(f.severity == "error" for f in findings):
        findings = [f for f in findings if f.id != "NO_GPU"]
    implicated = implicated_ids(data.get("error_text"))
    findings = rank(findings, implicated)
    from cudadoctor.rules.arch import recommended_arch_list

    try:
        arch_list = recommended_arch_list(Facts(data))
    except Exception:  # noqa: BLE001 - the recommendation is optional, the report is not
        arch_list = None
    report: dict[str, Any] = {
        "schema": REPORT_SCHEMA,
        "status": report_status(findings),
        "torch_cuda_arch_list": arch_list,
        "findings": [f.to_json() for f in findings],
        "facts": data,
    }
    if implicated:
        report["error_implicates"] = implicated
    return report
