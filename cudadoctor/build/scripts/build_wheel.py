"""Builds one wheel of a torch extension project; runs inside a build container or on the host.

Standard library only (it runs under the build venv's python). Copies the read-only source into a
persistent work folder (only changed files, so ninja and ccache see an unchanged tree on a rebuild),
runs `pip wheel --no-build-isolation` there, copies the wheel out and writes build-info JSON,
with the result of loading every shared object of the wheel next to the torch it was built against
(``load_check``: an undefined symbol or a missing library shows here, not at the user's import).
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


# Run in a child: import torch (which loads the CUDA libraries an extension resolves by soname), lay
# the wheel's shared objects out as installed, next to everything in torch's site-packages (so that
# $ORIGIN/../nvidia/... run paths resolve), then dlopen each with RTLD_NOW as Python's import does
# (and RTLD_GLOBAL, as a package that preloads a library of its own would).
# Driver libraries (libcuda, libnvidia-*) are not part of a build environment: their absence is a
# note, not an error. Prints one JSON object.
LOAD_CHECK = r"""
import ctypes, json, os, re, shutil, sys, tempfile, zipfile

res = {"checked": [], "errors": [], "notes": []}
try:
    import torch
except BaseException as exc:  # noqa: BLE001
    res["notes"].append("torch does not import in the build environment (%s); not checked" % str(exc).splitlines()[0][:200])
    print(json.dumps(res))
    sys.exit(0)
site = os.path.dirname(os.path.dirname(os.path.abspath(torch.__file__)))
root = tempfile.mkdtemp(prefix="cudadoctor-load-")
try:
    with zipfile.ZipFile(sys.argv[1]) as z:
        members = [n for n in z.namelist() if re.search(r"\.so(\.[0-9]+)*$", n)]
        for n in members:
            z.extract(n, root)
    for entry in os.listdir(site):
        if not os.path.lexists(os.path.join(root, entry)):
            os.symlink(os.path.join(site, entry), os.path.join(root, entry))
    # in passes: a member may need another one (by soname) that a package preloads before its
    # import; whatever loads in some order passes
    pending, failed = list(members), {}
    while pending:
        left = []
        for n in pending:
            try:
                ctypes.CDLL(os.path.join(root, n), mode=os.RTLD_NOW | os.RTLD_GLOBAL)
                res["checked"].append(n)
            except OSError as exc:
                failed[n] = str(exc).replace(root + os.sep, "")
                left.append(n)
        if len(left) == len(pending):
            break
        pending = left
    for n in pending:
        msg = failed[n]
        lib = re.search(r"(\S+): cannot open shared object file", msg)
        if lib and re.match(r"lib(cuda|nvidia-[\w-]+)\.so", os.path.basename(lib.group(1))):
            res["notes"].append("%s needs the driver's %s, absent here (a build environment has no driver)" % (n, lib.group(1)))
            res["checked"].append(n)
        else:
            res["errors"].append({"member": n, "error": msg})
finally:
    shutil.rmtree(root, ignore_errors=True)
res["torch"] = torch.__version__
print(json.dumps(res))
"""


def load_check(wheel):
    """{"checked": [members], "errors": [{"member", "error"}], "notes": [...]}: every shared object
    of the wheel dlopen'ed next to the build environment's torch (LOAD_CHECK). A child that dies
    (a crashing static initializer) is an error of the wheel too."""
    try:
        out = subprocess.run([sys.executable, "-c", LOAD_CHECK, wheel], capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        return {"checked": [], "errors": [], "notes": ["the load check did not finish in 600 s; not checked"]}
    lines = out.stdout.strip().splitlines()
    if out.returncode == 0 and lines:
        try:
            return json.loads(lines[-1])
        except ValueError:
            pass
    tail = " ".join((out.stderr or out.stdout).strip().splitlines()[-3:])[:500]
    how = "killed by signal %d" % -out.returncode if out.returncode < 0 else "exit status %d" % out.returncode
    return {"checked": [], "errors": [{"member": "(loading the wheel's shared objects)",
                                       "error": "the process loading them ended with %s: %s" % (how, tail)}],
            "notes": []}


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
    info["load_check"] = lc = load_check(wheels[0])
    for e in lc["errors"]:
        print("[cudadoctor] load check: %s does not load: %s" % (e["member"], e["error"]), flush=True)
    for note in lc["notes"]:
        print("[cudadoctor] load check: %s" % note, flush=True)
    if lc["checked"] and not lc["errors"]:
        print("[cudadoctor] load check: %d shared object(s) load next to torch %s"
              % (len(lc["checked"]), lc.get("torch", "?")), flush=True)
    info["build_seconds"] = round(time.time() - t0, 1)
    shutil.copy2(wheels[0], os.path.join(a.out, os.path.basename(wheels[0])))
    with open(a.info, "w") as fh:
        json.dump(info, fh, indent=2)
    print("[cudadoctor] wheel %s (%.0f s)" % (os.path.basename(wheels[0]), time.time() - t0), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
