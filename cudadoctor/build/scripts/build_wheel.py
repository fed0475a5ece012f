"""Builds one wheel of a torch extension project; runs inside a build container or on the host.

Standard library only (it runs under the build venv's python). Copies the read-only source into a
persistent work folder (only changed files, so ninja and ccache see an unchanged tree on a rebuild),
runs `pip wheel --no-build-isolation` there, copies the wheel out and writes build-info JSON.
The build settings (TORCH_CUDA_ARCH_LIST, MAX_JOBS, NVCC_APPEND_FLAGS, CUDA_HOME) come from the
environment. Exit status: pip's, or 3 when no wheel came out.
"""

import argparse
import filecmp
import glob
import json
import os
import platform
import shutil
import subprocess
import sys
import time

SKIP_DIRS = {".git", "build", "dist", "__pycache__", ".eggs", ".cudadoctor", ".tox", ".venv", ".pytest_cache"}


def sync(src, dst):
    """Mirror src into dst, copying only files whose size or mtime changed; remove vanished files
    (build outputs in dst are kept)."""
    seen = set()
    copied = 0
    for dirpath, dirnames, filenames in os.walk(src):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS and not d.endswith(".egg-info")]
        rel = os.path.relpath(dirpath, src)
        os.makedirs(os.path.join(dst, rel), exist_ok=True)
        seen.add(os.path.normpath(rel))
        for f in filenames:
            if f.endswith((".pyc", ".so", ".o")):
                continue
            s, d = os.path.join(dirpath, f), os.path.join(dst, rel, f)
            seen.add(os.path.normpath(os.path.join(rel, f)))
            if os.path.exists(d) and filecmp.cmp(s, d, shallow=True):
                continue
            shutil.copy2(s, d)
            os.chmod(d, os.stat(d).st_mode | 0o200)
            copied += 1
    for dirpath, dirnames, filenames in os.walk(dst, topdown=True):
        rel = os.path.relpath(dirpath, dst)
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS and not d.endswith(".egg-info")]
        for f in filenames:
            r = os.path.normpath(os.path.join(rel, f))
            if r not in seen and not f.endswith((".pyc", ".so", ".o")):
                os.remove(os.path.join(dirpath, f))
    return copied


def first_line(argv):
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = [l for l in (out.stdout or out.stderr).splitlines() if l.strip()]
    return lines[0].strip() if lines else None


def build_info():
    info = {
        "python": platform.python_version(),
        "python_tag": "cp%d%d" % sys.version_info[:2],
        "glibc": "-".join(platform.libc_ver()) or None,
        "platform": platform.machine(),
    }
    try:
        libc = os.confstr("CS_GNU_LIBC_VERSION")
        if libc:
            info["glibc"] = libc.split()[-1]
    except (ValueError, OSError):
        pass
    code = (
        "import json, torch; print(json.dumps({'torch': torch.__version__, 'torch_cuda': torch.version.cuda,"
        " 'cxx11_abi': bool(torch._C._GLIBCXX_USE_CXX11_ABI)}))"
    )
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
        info.update(json.loads(out.stdout.strip().splitlines()[-1]))
    except Exception as exc:  # noqa: BLE001 - reported, not fatal
        info["torch_error"] = str(exc)
    cuda_home = os.environ.get("CUDA_HOME") or "/usr/local/cuda"
    nvcc = os.path.join(cuda_home, "bin", "nvcc")
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60).stdout
        line = [l for l in out.splitlines() if "release" in l][0]
        info["nvcc"] = line.rsplit("V", 1)[-1].strip() if ", V" in line else line.split("release")[-1].strip()
    except Exception:  # noqa: BLE001
        info["nvcc"] = None
    info["cuda_home"] = cuda_home
    cxx = os.environ.get("CXX") or "c++"
    info["host_compiler"] = first_line([cxx, "--version"])
    info["cudahostcxx"] = os.environ.get("CUDAHOSTCXX")
    info["compiler_cache"] = next((w for w in ("ccache", "sccache") if shutil.which(w)), None)
    for k in ("TORCH_CUDA_ARCH_LIST", "MAX_JOBS", "NVCC_APPEND_FLAGS"):
        info[k] = os.environ.get(k)
    return info


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--src", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--info", required=True)
    a = ap.parse_args()
    t0 = time.time()
    work_src = os.path.join(a.work, "src")
    wheelhouse = os.path.join(a.work, "wheelhouse")
    os.makedirs(work_src, exist_ok=True)
    n = sync(a.src, work_src)
    print("[cudadoctor] source synced to %s (%d file(s) changed)" % (work_src, n), flush=True)
    shutil.rmtree(wheelhouse, ignore_errors=True)
    os.makedirs(wheelhouse)
    os.makedirs(a.out, exist_ok=True)
    for k in ("TORCH_CUDA_ARCH_LIST", "MAX_JOBS", "NVCC_APPEND_FLAGS", "CUDA_HOME"):
        print("[cudadoctor] %s=%s" % (k, os.environ.get(k, "")), flush=True)
    argv = [sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "--no-input",
            "--progress-bar", "off", "-v", "-w", wheelhouse, work_src]
    print("[cudadoctor] $ " + " ".join(argv), flush=True)
    rc = subprocess.call(argv, stdin=subprocess.DEVNULL)
    if rc != 0:
        print("[cudadoctor] pip wheel failed with exit status %d" % rc, flush=True)
        return rc
    wheels = sorted(glob.glob(os.path.join(wheelhouse, "*.whl")))
    if not wheels:
        print("[cudadoctor] pip wheel produced no wheel", flush=True)
        return 3
    info = build_info()
    info["wheel"] = os.path.basename(wheels[0])
    info["build_seconds"] = round(time.time() - t0, 1)
    shutil.copy2(wheels[0], os.path.join(a.out, os.path.basename(wheels[0])))
    with open(a.info, "w") as fh:
        json.dump(info, fh, indent=2)
    print("[cudadoctor] wheel %s (%.0f s)" % (os.path.basename(wheels[0]), time.time() - t0), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
