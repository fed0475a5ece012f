"""Probes: look at the machine and return the facts snapshot of docs/facts-v1.md.

``collect_facts(runner, root, env)`` never raises: every section that could not be probed is
``None`` or carries an ``"error"`` string. Anything that can hang or crash (importing torch,
NVML, nvidia-smi) runs in a child process with a timeout. Sections run concurrently in threads;
the torch child starts first because importing torch dominates the wall time.

Fields beyond docs/facts-v1.md (all optional for readers):
  host        distro_id, distro_version, proc_version, wsl_hints, container_hints, dev_dxg, cpus,
              mem_available_gib (both null when probing a tree other than the live root)
  driver      nvml_error, smi_error (verbatim texts), smi_path, source ("nvml"/"nvidia-smi"),
              kernel_module_line, libcuda_details [{path, realpath, via, version}],
              device_nodes (/dev/nvidia*), ldconfig_error. ``error`` is set only when some trace
              of a driver exists (device node, kernel module, libcuda, /dev/dxg, nvidia-smi).
  gpus[]      uuid, pci_bus_id, source ("nvml", "nvidia-smi" or "torch")
  toolkits[]  realpath, exists, torch_would_use, nvcc_path, nvcc_wrapper_of, nvcc_output,
              nvcc_error, targets (nvcc --list-gpu-arch), version_file, include_dirs,
              headers_missing, headers_elsewhere {header: [paths]}; on the toolkit torch would use:
              build_include_path and headers_unresolved (missing on that whole include path)
  host_compiler  via, version_line, nvcc_ccbin (when CC is set), skipped; C++ runtime: shared_libstdcxx,
              static_libstdcxx, links_static_libstdcxx, wrapper_of (also on nvcc_ccbin and link_compiler,
              CXX when CUDAHOSTCXX differs); candidates (other compilers, only when one links
              libstdc++ statically); see probes/compiler.py
  torch       probe_mode ("core"/"full"), probe_stage, probe_seconds, path, include_dirs,
              cuda_include_dirs (torch's include dirs + the build toolkit's include path), lib_dir,
              library_paths (CUDA libraries the process mapped), device_count, devices
              [{index, name, cc, kernel_ok, launch_error}], warnings, import_error_type,
              import_traceback, site_dirs, hip, git_version
  python      include_dir (sysconfig's include folder, a venv's base installation's), has_python_h
              (Python.h is in it: torch's extension builds include it), libstdcxx (the libstdc++.so.6
              the interpreter mapped once torch._C loaded) and libstdcxx_glibcxx (its newest
              GLIBCXX_3.4.N); host_compiler.shared_libstdcxx_glibcxx: the same for the compiler's
  tools       paths
  probe       seconds, root, errors (a probe that raised)

Time bound, whatever the probed programs do: max(torch_timeout + 2, nvml_timeout + 3 * smi_timeout
+ 7, 2 * nvcc_timeout + 2) seconds, 28 s with the defaults (22 s when only torch hangs). On a
machine without a GPU the torch child loads only torch._C and the whole snapshot takes well under
a second on a warm cache.
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import sys
import time
import traceback
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Mapping

from cudadoctor.runner import Runner

from ._fs import Root
from .compiler import probe_host_compiler
from .driver import probe_driver
from .host import probe_host
from .toolkits import probe_toolkits
from .tools import probe_tools
from .torch_probe import interpret, run_child

SCHEMA = "cudadoctor.facts/1"

ENV_NAMES = (
    # docs/facts-v1.md
    "TORCH_CUDA_ARCH_LIST", "CUDA_HOME", "CUDA_PATH", "CUDA_VISIBLE_DEVICES", "LD_LIBRARY_PATH",
    "PATH", "NVIDIA_VISIBLE_DEVICES", "NVIDIA_DRIVER_CAPABILITIES", "CC", "CXX", "CUDAHOSTCXX",
    "MAX_JOBS",
    # also read by the probes or by torch's extension builder
    "CONDA_PREFIX", "VIRTUAL_ENV", "KUBERNETES_SERVICE_HOST", "WSL_DISTRO_NAME", "PYTHONPATH",
    "CUDA_INC_PATH", "CUDNN_HOME", "CPATH", "CPLUS_INCLUDE_PATH", "NVCC_CCBIN",
    "NVCC_PREPEND_FLAGS", "NVCC_APPEND_FLAGS", "PYTORCH_NVML_BASED_CUDA_CHECK",
    "CUDA_MODULE_LOADING", "TORCH_EXTENSIONS_DIR", "LDSHARED",
)


def now_utc() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _guard(name: str, fn: Callable[[], Any], errors: dict) -> Any:
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - a crashing probe becomes a result, not a traceback
        errors[name] = f"{type(exc).__name__}: {exc}"
        errors.setdefault("_tracebacks", {})[name] = traceback.format_exc().splitlines()[-6:]
        return None


def _result(fut: Future, name: str, errors: dict, timeout: float | None = None) -> Any:
    try:
        return fut.result(timeout=timeout)
    except Exception as exc:  # noqa: BLE001
        errors[name] = f"{type(exc).__name__}: {exc}"
        return None


def _local_site_dirs() -> list[str]:
    from .torch_child import site_dirs

    return site_dirs()


def collect_facts(
    runner: Runner | None = None,
    root: str = "/",
    env: Mapping[str, str] | None = None,
    *,
    torch_timeout: float = 20.0,
    python: str = sys.executable,
    torch_mode: str = "auto",
    nvml_timeout: float = 6.0,
    smi_timeout: float = 5.0,
    nvcc_timeout: float = 10.0,
    extra: Mapping[str, Callable[[], Any]] | None = None,
) -> dict:
    """The facts snapshot of this machine (or of the tree at ``root``). Never raises.

    ``torch_mode``: "auto" (load torch._C only unless a GPU is present), "full" (always a real
    ``import torch`` and kernel launch) or "skip" (no torch child; the torch section is None).
    ``extra``: more probes to run concurrently with these, {facts key: callable}; each result is
    stored under its key (e.g. {"extensions": lambda: inspect_installed()}); one that raises leaves
    the key as it was and is named in ``facts["probe"]["errors"]``.

    Bound: see the module docstring (28 s with the defaults, whatever the probed programs do).
    """
    started = time.monotonic()
    try:
        return _collect(runner, root, env, torch_timeout=torch_timeout, python=python, torch_mode=torch_mode,
                        nvml_timeout=nvml_timeout, smi_timeout=smi_timeout, nvcc_timeout=nvcc_timeout,
                        extra=extra, started=started)
    except Exception as exc:  # noqa: BLE001 - a bug in the orchestration still gives a snapshot
        text = f"{type(exc).__name__}: {exc}"
        return {
            "schema": SCHEMA, "collected_at": now_utc(), "host": None, "driver": None, "gpus": [],
            "toolkits": [], "host_compiler": None, "python": None, "torch": None, "env": None,
            "tools": None, "extensions": [], "error_text": None,
            "probe": {"seconds": round(time.monotonic() - started, 3), "root": root, "errors": {"collect": text}},
        }


def _collect(runner, root, env, *, torch_timeout, python, torch_mode, nvml_timeout, smi_timeout, nvcc_timeout,
             extra, started) -> dict:
    runner = runner if runner is not None else Runner()
    # a real process environment holds only str without NUL bytes; drop anything else up front
    env = {k: v for k, v in (os.environ if env is None else env).items()
           if isinstance(k, str) and isinstance(v, str) and "\x00" not in k and "\x00" not in v}
    fs = Root(root)
    errors: dict = {}
    facts: dict = {
        "schema": SCHEMA,
        "collected_at": now_utc(),
        "host": None, "driver": None, "gpus": [], "toolkits": [], "host_compiler": None,
        "python": None, "torch": None,
        "env": {k: env.get(k) for k in ENV_NAMES},
        "tools": None, "extensions": [], "error_text": None,
    }
    pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="cudadoctor-probe")
    torch = None
    try:
        torch_fut = None
        if torch_mode != "skip":
            torch_fut = pool.submit(run_child, runner, python, env, torch_timeout, torch_mode)
        host_fut = pool.submit(_guard, "host", lambda: probe_host(runner, fs, env), errors)
        arch = _normalise_arch()
        driver_fut = pool.submit(
            _guard, "driver",
            lambda: probe_driver(runner, fs, env, arch=arch, python=sys.executable,
                                 nvml_timeout=nvml_timeout, smi_timeout=smi_timeout),
            errors,
        )
        cxx_fut = pool.submit(_guard, "host_compiler", lambda: probe_host_compiler(runner, fs, env), errors)

        if os.path.realpath(python) == os.path.realpath(sys.executable) or torch_fut is None:
            site = _guard("site_dirs", _local_site_dirs, errors) or []
        else:
            site = None  # the probed interpreter's site-packages come from its child

        def _toolkits(site_dirs):
            return probe_toolkits(runner, fs, env, site_dirs, nvcc_timeout=nvcc_timeout,
                                  map_fn=lambda f, xs: list(pool.map(f, xs)) if len(xs) > 1 else list(map(f, xs)))

        tk_fut = pool.submit(_guard, "toolkits", lambda: _toolkits(site), errors) if site is not None else None
        tools_fut = pool.submit(_guard, "tools", lambda: probe_tools(runner, fs, env), errors)
        extra_futs = {key: pool.submit(fn) for key, fn in (extra or {}).items() if callable(fn)}

        facts["host"] = _result(host_fut, "host", errors)
        drv = _result(driver_fut, "driver", errors)
        if drv:
            facts["driver"], facts["gpus"] = drv[0], list(drv[1])
        facts["host_compiler"] = _result(cxx_fut, "host_compiler", errors)
        facts["tools"] = _result(tools_fut, "tools", errors)
        for key, fut in extra_futs.items():
            value = _result(fut, key, errors)
            if key not in errors:
                facts[key] = value

        py, torch = None, None
        if torch_fut is not None:
            res = _result(torch_fut, "torch", errors)
            if res is not None:
                py, torch = interpret(res, python, torch_timeout)
        facts["torch"] = torch
        facts["python"] = _python_section(py, python)
        if tk_fut is None:
            site = (torch or {}).get("site_dirs") or []
            facts["toolkits"] = _guard("toolkits", lambda: _toolkits(site), errors) or []
        else:
            facts["toolkits"] = _result(tk_fut, "toolkits", errors) or []
    finally:
        pool.shutdown(wait=False)

    if torch and torch.get("include_dirs"):
        # what torch.utils.cpp_extension.include_paths("cuda") plus nvcc's own dirs give a build
        build = facts["toolkits"][0].get("build_include_path") if facts["toolkits"] else None
        torch["cuda_include_dirs"] = list(torch["include_dirs"]) + list(build or [])
    if not facts["gpus"] and torch and torch.get("devices"):
        facts["gpus"] = [dict(d, source="torch") for d in torch["devices"] if d.get("name")]
    for name in ("host", "host_compiler", "tools"):
        if facts[name] is None and name in errors:
            facts[name] = {"error": errors[name]}
    if facts["driver"] is None and "driver" in errors:
        facts["driver"] = {"version": None, "kernel_module": None, "cuda": None, "libcuda": [], "error": errors["driver"]}
    facts["probe"] = {
        "seconds": round(time.monotonic() - started, 3),
        "root": root,
        "errors": {k: v for k, v in errors.items() if not k.startswith("_")} or None,
    }
    return facts


def _normalise_arch() -> str | None:
    m = (platform.machine() or "").lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(m, m or None)


def _python_section(py: dict | None, python: str) -> dict:
    if py and py.get("version"):
        out = {"version": py.get("version"), "executable": py.get("executable") or python,
               "implementation": py.get("implementation")}
        if "has_python_h" in py:
            out["include_dir"], out["has_python_h"] = py.get("include_dir"), py.get("has_python_h")
        if py.get("libstdcxx"):
            from .compiler import glibcxx_max

            out["libstdcxx"], out["libstdcxx_glibcxx"] = py["libstdcxx"], glibcxx_max(py["libstdcxx"])
        return out
    if os.path.realpath(python) == os.path.realpath(sys.executable):
        from .torch_child import python_headers

        inc, has = python_headers()
        return {"version": platform.python_version(), "executable": sys.executable,
                "implementation": sys.implementation.name, "include_dir": inc, "has_python_h": has}
    out = {"version": None, "executable": python}
    if py and py.get("error"):
        out["error"] = py["error"]
    return out


__all__ = ["collect_facts", "SCHEMA", "ENV_NAMES"]
