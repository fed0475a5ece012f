"""Run in a child process (``python -c``) by the torch probe; prints JSON lines to the parent.

Standard library only, compatible with old interpreters: it runs under whatever Python is probed.

Protocol: every line starting with ``CUDADOCTOR_TORCH `` is the complete result so far; the last
one wins. ``stage`` says what the child was doing, so when it dies (segfault, hang, kill) the
parent knows whether importing torch or launching a kernel killed it.

Two depths:
- core: load only the ``torch._C`` extension (under a bare ``torch`` package object) and read
  version, CUDA, arch list, C++11 ABI, cuDNN and device count from it. This skips the Python half
  of ``import torch`` (about two thirds of its time) and is enough when there is no GPU to test.
- full: a real ``import torch`` and a tiny kernel launch on every visible device, recording the
  exception text verbatim. Used when a GPU device node exists or torch sees a device, when the
  core load fails (to report the real import error), or when the parent asks for it.
"""

import json
import os
import sys
import time

MARK = "CUDADOCTOR_TORCH "
LIB_NAMES = (
    "libcudart.so", "libcudnn.so", "libcudnn_", "libcublas.so", "libcublasLt.so", "libcuda.so",
    "libnvrtc.so", "libcusparse.so", "libnvidia-ml.so", "libtorch_cuda.so", "libnccl.so",
)

_saved_fd = None
_caught = None
_start = time.time()
result = {
    "stage": "start",
    "python": {
        "version": "%d.%d.%d" % tuple(sys.version_info[:3]),
        "executable": sys.executable,
        "implementation": getattr(sys, "implementation", None) and sys.implementation.name,
    },
    "torch": None,
}


def emit():
    result["torch_seconds"] = round(time.time() - _start, 3)
    line = MARK + json.dumps(result, default=str) + "\n"
    try:
        os.write(_saved_fd if _saved_fd is not None else 1, line.encode("utf-8", "replace"))
    except OSError:
        pass


def stage(name):
    result["stage"] = name
    emit()


def exc_text(exc):
    text = str(exc)
    return text if text else type(exc).__name__


def loaded_libraries():
    found = []
    try:
        with open("/proc/self/maps") as fh:
            for line in fh:
                parts = line.split(None, 5)
                if len(parts) < 6:
                    continue
                path = parts[5].strip()
                base = os.path.basename(path)
                if any(base.startswith(n) for n in LIB_NAMES) and path not in found:
                    found.append(path)
    except (OSError, ValueError):
        return None
    return found


def mapped_libstdcxx():
    """The libstdc++.so.6 this process has mapped (torch._C loads it), or None."""
    try:
        with open("/proc/self/maps") as fh:
            for line in fh:
                parts = line.split(None, 5)
                if len(parts) == 6 and os.path.basename(parts[5].strip()).startswith("libstdc++.so"):
                    return parts[5].strip()
    except (OSError, ValueError):
        pass
    return None


def site_dirs():
    dirs = []
    try:
        import site
        for d in list(getattr(site, "getsitepackages", lambda: [])()) + [site.getusersitepackages()]:
            if d and os.path.isdir(d) and d not in dirs:
                dirs.append(d)
    except Exception:  # noqa: BLE001
        pass
    for d in sys.path:
        if d and os.path.isdir(d) and ("site-packages" in d or "dist-packages" in d) and d not in dirs:
            dirs.append(d)
    return dirs


def python_headers():
    """(include folder, whether Python.h is in it) of this interpreter: what torch's extension builds
    put on the compiler's include path (a venv reports its base installation's folder)."""
    try:
        import sysconfig
        inc = sysconfig.get_paths().get("include") or sysconfig.get_config_var("INCLUDEPY")
    except Exception:  # noqa: BLE001
        return None, None
    if not inc:
        return None, None
    return inc, os.path.isfile(os.path.join(inc, "Python.h"))


def cudnn_string(v):
    try:
        v = int(v)
    except (TypeError, ValueError):
        return None
    if v >= 90000 or (v >= 10000 and v < 20000):  # cuDNN 9: MMmmpp; cuDNN 1.x never existed
        return "%d.%d.%d" % (v // 10000, (v % 10000) // 100, v % 100)
    return "%d.%d.%d" % (v // 1000, (v % 1000) // 100, v % 100)  # cuDNN 8: Mmpp


def read_version_py(torch_dir):
    path = os.path.join(torch_dir, "version.py")
    ns = {}
    try:
        with open(path) as fh:
            code = fh.read()
        exec(compile(code, path, "exec"), ns)
    except Exception:  # noqa: BLE001
        return {}
    return {k: ns.get(k) for k in ("__version__", "cuda", "hip", "git_version") if isinstance(ns.get(k), (str, type(None)))}


def gpu_nodes_present():
    for p in ("/dev/nvidiactl", "/dev/nvidia0", "/dev/dxg"):
        if os.path.exists(p):
            return True
    return False


def core(t, torch_dir, spec):
    """Load torch._C alone under a bare torch package object; fill ``t``; return the module."""
    import types

    pkg = types.ModuleType("torch")
    pkg.__path__ = [torch_dir]
    pkg.__file__ = spec.origin
    pkg.__spec__ = spec
    pkg.__loader__ = spec.loader
    pkg.__package__ = "torch"
    sys.modules["torch"] = pkg
    import torch._C as C  # noqa: F401  (may raise; caller handles it)

    if hasattr(C, "_cuda_getArchFlags"):
        flags = C._cuda_getArchFlags()
        t["arch_list"] = flags.split() if flags else []
    else:
        t["arch_list"] = []
    t["cxx11_abi"] = bool(getattr(C, "_GLIBCXX_USE_CXX11_ABI", False))
    if getattr(C, "_has_cudnn", False) and hasattr(C, "_cudnn"):
        try:
            t["cudnn"] = cudnn_string(C._cudnn.getVersionInt())
        except Exception as exc:  # noqa: BLE001
            t["cudnn_error"] = exc_text(exc)
    if hasattr(C, "_cuda_getDeviceCount"):
        try:
            n = int(C._cuda_getDeviceCount())
        except Exception as exc:  # noqa: BLE001
            n = 0
            t["cuda_init_error"] = exc_text(exc)
        t["device_count"] = n
        t["cuda_available"] = n > 0
    else:
        t["device_count"] = 0
        t["cuda_available"] = False
    return pkg


def full(t, pkg, spec):
    """A real ``import torch`` (reusing an already loaded torch._C), then a kernel per device."""
    import warnings

    global _caught
    with warnings.catch_warnings(record=True) as caught:
        _caught = caught  # kept for main() when an exception ends this early
        warnings.simplefilter("always")
        stage("import")
        if pkg is not None:
            spec.loader.exec_module(pkg)  # run torch/__init__.py in the package object
            torch = pkg
        else:
            for name in [m for m in sys.modules if m == "torch" or m.startswith("torch.")]:
                del sys.modules[name]
            import torch  # noqa: F811
        t["version"] = getattr(torch, "__version__", t.get("version"))
        t["version"] = str(t["version"]) if t["version"] is not None else None
        ver = getattr(torch, "version", None)
        t["cuda"] = getattr(ver, "cuda", t.get("cuda"))
        try:
            t["arch_list"] = list(torch.cuda.get_arch_list())
        except Exception as exc:  # noqa: BLE001
            t["arch_list_error"] = exc_text(exc)
        t["cxx11_abi"] = bool(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", False))
        try:
            v = torch.backends.cudnn.version()
            t["cudnn"] = cudnn_string(v) if v is not None else None
        except Exception as exc:  # noqa: BLE001
            t["cudnn_error"] = exc_text(exc)
        stage("cuda-init")  # a wedged driver can hang or crash right here
        t["cuda_available"] = bool(torch.cuda.is_available())
        n = torch.cuda.device_count() if t["cuda_available"] else 0
        t["device_count"] = n
        devices = []
        for i in range(n):
            d = {"index": i}
            try:
                d["name"] = torch.cuda.get_device_name(i)
                cap = torch.cuda.get_device_capability(i)
                d["cc"] = "%d.%d" % (cap[0], cap[1])
            except Exception as exc:  # noqa: BLE001
                d["error"] = exc_text(exc)
            devices.append(d)
        t["devices"] = devices
        stage("launch")
        tested = {}
        for d in devices:
            model = (d.get("name"), d.get("cc"))
            if model in tested and "error" not in d:
                # one launch per GPU model: the same kernel image decides for identical devices
                d["kernel_ok"] = devices[tested[model]].get("kernel_ok")
                d["same_as"] = tested[model]
                continue
            tested[model] = d["index"]
            try:
                x = torch.ones(1, device="cuda:%d" % d["index"]) + 1
                torch.cuda.synchronize(d["index"])
                ok = float(x.item()) == 2.0
                d["kernel_ok"] = ok
                if not ok:
                    d["launch_error"] = "kernel returned a wrong value"
            except Exception as exc:  # noqa: BLE001
                d["kernel_ok"] = False
                d["launch_error"] = exc_text(exc)
            if d.get("launch_error") and t.get("device_error") is None:
                t["device_error"] = d["launch_error"]
        if not devices and gpu_nodes_present():
            # a GPU device node exists but torch sees no device: the launch error says why
            # ("Found no NVIDIA driver", "driver version is insufficient", "no CUDA GPUs are available")
            try:
                torch.ones(1, device="cuda") + 1
                torch.cuda.synchronize()
            except Exception as exc:  # noqa: BLE001
                t["device_error"] = exc_text(exc)
        stage("after-launch")
    t["warnings"] = [str(w.message) for w in caught][:20]


def main():
    global _saved_fd
    # torch and CUDA libraries may print to stdout; keep stdout for the JSON lines only
    try:
        _saved_fd = os.dup(1)
        os.dup2(2, 1)
    except OSError:
        _saved_fd = None
    cwd = os.getcwd()
    sys.path[:] = [p for p in sys.path if p not in ("", ".", cwd)]
    mode = sys.argv[1] if len(sys.argv) > 1 else "auto"
    result["site_dirs"] = site_dirs()
    result["python"]["include_dir"], result["python"]["has_python_h"] = python_headers()
    t = {
        "version": None, "cuda": None, "arch_list": None, "cxx11_abi": None, "cudnn": None,
        "cuda_available": None, "device_error": None, "import_error": None, "probe_mode": None,
    }
    result["torch"] = t
    import importlib.util

    try:
        spec = importlib.util.find_spec("torch")
    except Exception as exc:  # noqa: BLE001
        spec = None
        t["import_error"] = exc_text(exc)
    if spec is None or not spec.origin:
        t["import_error"] = t["import_error"] or "No module named 'torch'"
        stage("done")
        return
    torch_dir = os.path.dirname(spec.origin)
    t["path"] = torch_dir
    t["include_dirs"] = [os.path.join(torch_dir, "include"), os.path.join(torch_dir, "include", "torch", "csrc", "api", "include")]
    t["lib_dir"] = os.path.join(torch_dir, "lib")
    vp = read_version_py(torch_dir)
    t["version"] = vp.get("__version__")
    t["cuda"] = vp.get("cuda")
    t["hip"] = vp.get("hip")
    t["git_version"] = vp.get("git_version")
    pkg = None
    full_first = mode == "full" or gpu_nodes_present()
    if not full_first:
        stage("core")
        blocked = "numpy" not in sys.modules
        if blocked:
            sys.modules["numpy"] = None  # torch._C imports numpy if it can; the core facts never need it
        import warnings

        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                pkg = core(t, torch_dir, spec)
            t["probe_mode"] = "core"
            t["warnings"] = [str(w.message) for w in caught][:20]
        except BaseException as exc:  # noqa: BLE001 - includes SystemExit from odd packages
            t["core_error"] = exc_text(exc)
            pkg = None
            for name in [m for m in sys.modules if m == "torch" or m.startswith("torch.")]:
                del sys.modules[name]
        if blocked and sys.modules.get("numpy", 0) is None:
            del sys.modules["numpy"]
        t["library_paths"] = loaded_libraries()
        result["python"]["libstdcxx"] = mapped_libstdcxx()
        emit()
    need_full = full_first or pkg is None or bool(t.get("device_count"))
    if need_full:
        try:
            full(t, pkg, spec)
            t["probe_mode"] = "full"
            t.pop("core_error", None)
        except BaseException as exc:  # noqa: BLE001
            if result["stage"] == "import":  # an exception while importing; later stages are device errors
                t["import_error"] = exc_text(exc)
                t["import_error_type"] = type(exc).__name__
                import traceback
                t["import_traceback"] = traceback.format_exc().splitlines()[-12:]
            else:
                t["device_error"] = t.get("device_error") or exc_text(exc)
            if _caught:
                t["warnings"] = [str(w.message) for w in _caught][:20]
        t["library_paths"] = loaded_libraries()
        result["python"]["libstdcxx"] = mapped_libstdcxx()
    stage("done")


if __name__ == "__main__":
    main()
