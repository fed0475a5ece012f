"""Inspect compiled CUDA code: files, wheels and folders -> facts-v1 ``extensions[]`` entries, and
verdicts of which GPU can run them (natively, through PTX JIT, or not at all).

A wheel is read from the zip: each shared object inside is streamed to a temporary file and
memory-mapped, one at a time. A wheel built by cudadoctor carries a build manifest,
``<name>.dist-info/cudadoctor_build.json``; its ``torch``, ``cuda`` and ``cxx11_abi`` keys (top
level or under ``built_with``) fill the entry's ``built_with``. Without one, ``built_with.cuda``
is the major version of the libcudart the object links, and ``cxx11_abi`` comes from the C++
symbols it imports, when they tell.

Each entry also lists ``needed`` (DT_NEEDED) and ``cxx_runtime_defined``: which of __cxa_throw,
__gxx_personality_v0 and __cxa_begin_catch its dynamic symbol table defines. A torch extension that
defines them carries its own C++ runtime (it was linked against libstdc++.a), and every exception
thrown inside it (TORCH_CHECK) kills the process instead of reaching Python.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import zipfile
import zlib
from typing import Iterable

from cudadoctor.archs import Arch, ptx_runs_on, sass_runs_on
from cudadoctor.binary import BinaryFormatError, BinaryInfo, read_binary
from cudadoctor.binary.reader import arch_sort_key
from cudadoctor.versions import CudaVersion

MANIFEST_NAME = "cudadoctor_build.json"
BINARY_SUFFIXES = (".so", ".o", ".cubin", ".fatbin", ".pyd")
MAX_MEMBER_BYTES = 8 << 30


def _is_shared_object(name: str) -> bool:
    base = os.path.basename(name)
    return base.endswith(".so") or ".so." in base or base.endswith(".pyd")


def _is_binary_name(name: str) -> bool:
    return name.endswith(BINARY_SUFFIXES) or ".so." in os.path.basename(name)


# --- PTX ISA -> driver ------------------------------------------------------------------------


def ptx_cuda(isa: object) -> str | None:
    """CUDA release that introduced PTX ISA ``isa`` ("9.0" -> "13.0"), from data/ptx_isa.toml."""
    from cudadoctor.knowledge import load_table

    v = CudaVersion.parse(isa)
    if v is None:
        return None
    for row in load_table("ptx_isa"):
        if CudaVersion.parse(row.get("isa")) == v:
            return str(row["cuda"])
    return None


def driver_for_cuda(cuda: object) -> str | None:
    """Oldest Linux driver whose CUDA is at least ``cuda`` (data/driver_cuda.toml)."""
    from cudadoctor.knowledge import KnowledgeError, load_table

    want = CudaVersion.parse(cuda)
    if want is None:
        return None
    try:
        rows = load_table("driver_cuda")
    except KnowledgeError:
        return None
    best: tuple[CudaVersion, str] | None = None
    for row in rows:
        if row.get("kind") != "release" or not row.get("linux"):
            continue
        c = CudaVersion.parse(row.get("cuda"))
        if c is not None and c >= want and (best is None or c < best[0]):
            best = (c, str(row["linux"]))
    return best[1] if best else None


# --- entries ----------------------------------------------------------------------------------


def _built_with(info: BinaryInfo, manifest: dict | None) -> dict:
    bw: dict = {"torch": None, "cuda": info.cuda_major, "cxx11_abi": info.cxx11_abi}
    if isinstance(manifest, dict):
        src = manifest.get("built_with") if isinstance(manifest.get("built_with"), dict) else manifest
        for key, alts in (("torch", ("torch", "torch_version")), ("cuda", ("cuda", "cuda_version")),
                          ("cxx11_abi", ("cxx11_abi",))):
            for a in alts:
                if src.get(a) is not None:
                    bw[key] = src[a]
                    break
    return bw


def entry_from_info(info: BinaryInfo, *, path: str | None = None, manifest: dict | None = None,
                    size: int | None = None) -> dict:
    """A facts-v1 ``extensions[]`` entry for one parsed binary."""
    groups: dict[tuple[str, str], dict] = {}
    ptx_isa: dict[str, str] = {}
    compression: set[str] = set()
    for e in info.entries:
        g = groups.setdefault((e.kind, e.arch), {"kind": e.kind, "arch": e.arch, "count": 0, "size": 0,
                                                 "compression": None, "ptx_isa": None})
        g["count"] += 1
        g["size"] += e.size
        if e.compression:
            g["compression"] = e.compression
            compression.add(e.compression)
        if e.ptx_isa:
            if g["ptx_isa"] is None or CudaVersion.parse(e.ptx_isa) > CudaVersion.parse(g["ptx_isa"]):
                g["ptx_isa"] = e.ptx_isa
            ptx_isa[e.arch] = g["ptx_isa"]
    out = {
        "path": path or info.path,
        "format": info.format,
        "sass": info.sass,
        "ptx": info.ptx,
        "ptx_isa": ptx_isa,
        "lto": info.lto,
        "compression": sorted(compression),
        "entries": sorted(groups.values(), key=lambda g: (g["kind"], arch_sort_key(g["arch"]))),
        "needed": info.needed,
        "cxx_runtime_defined": info.cxx_runtime_defined,
        "built_with": _built_with(info, manifest),
        "load_error": None,
    }
    if size is not None:
        out["size"] = size
    if manifest is not None:
        out["manifest"] = manifest
    return out


def _read_manifest_bytes(data: bytes, where: str) -> dict:
    try:
        m = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        return {"error": f"{where}: not valid JSON ({exc})"}
    return m if isinstance(m, dict) else {"error": f"{where}: not a JSON object"}


def inspect_wheel(path: str) -> list[dict]:
    """Entries for every shared object inside a wheel, read member by member."""
    try:
        zf = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as exc:
        raise BinaryFormatError(f"{path} is not a readable wheel (zip): {exc}.") from exc
    out: list[dict] = []
    with zf:
        try:
            infos = zf.infolist()
            manifest = None
            for zi in infos:
                parts = zi.filename.split("/")
                if len(parts) == 2 and parts[0].endswith(".dist-info") and parts[1] == MANIFEST_NAME:
                    manifest = _read_manifest_bytes(zf.read(zi), f"{path}!{zi.filename}")
            members = [zi for zi in infos if not zi.is_dir() and _is_shared_object(zi.filename)]
            for zi in members:
                where = f"{path}!{zi.filename}"
                if zi.file_size > MAX_MEMBER_BYTES:
                    out.append({"path": where, "error": f"member is {zi.file_size} bytes; too large to inspect"})
                    continue
                with tempfile.NamedTemporaryFile(prefix="cudadoctor-", suffix=".so") as tmp:
                    with zf.open(zi) as src:
                        shutil.copyfileobj(src, tmp, 1 << 20)
                    tmp.flush()
                    try:
                        info = read_binary(tmp.name)
                    except BinaryFormatError as exc:
                        out.append({"path": where, "error": str(exc).replace(tmp.name, where)})
                        continue
                    info.path = where
                    out.append(entry_from_info(info, path=where, manifest=manifest, size=zi.file_size))
        except (zipfile.BadZipFile, zlib.error, EOFError, OSError, ValueError, NotImplementedError, KeyError) as exc:
            raise BinaryFormatError(f"{path}: damaged wheel: {exc}.") from exc
    if not out and manifest is not None:
        out.append({"path": path, "sass": [], "ptx": [], "manifest": manifest, "error": "no shared objects inside"})
    return out


def _walk(folder: str) -> Iterable[str]:
    for root, dirs, files in os.walk(folder, onerror=None, followlinks=False):
        dirs.sort()
        for f in sorted(files):
            p = os.path.join(root, f)
            if (_is_binary_name(f) or f.endswith(".whl")) and os.path.isfile(p):
                yield p


def _folder_manifest(path: str) -> dict | None:
    """The manifest of the installed distribution that owns ``path``: a
    <site>/<dist>.dist-info/cudadoctor_build.json whose RECORD lists the file."""
    here = os.path.dirname(os.path.abspath(path))
    site = here
    for _ in range(4):  # the file may sit a few packages deep below site-packages
        try:
            names = os.listdir(site)
        except OSError:
            names = []
        for n in names:
            cand = os.path.join(site, n, MANIFEST_NAME)
            if not (n.endswith(".dist-info") and os.path.isfile(cand)):
                continue
            rel = os.path.relpath(os.path.abspath(path), site).replace(os.sep, "/")
            try:
                with open(os.path.join(site, n, "RECORD"), encoding="utf-8", errors="replace") as fh:
                    owned = any(line.split(",", 1)[0] == rel for line in fh)
            except OSError:
                owned = False
            if owned:
                with open(cand, "rb") as fh:
                    return _read_manifest_bytes(fh.read(), cand)
        parent = os.path.dirname(site)
        if parent == site:
            break
        site = parent
    return None


def inspect_file(path: str, *, manifest: dict | None = None) -> list[dict]:
    if path.endswith(".whl") or (zipfile.is_zipfile(path) if os.path.isfile(path) else False):
        return inspect_wheel(path)
    info = read_binary(path)
    try:
        size = os.path.getsize(path)
    except OSError:
        size = None
    return [entry_from_info(info, path=path, manifest=manifest, size=size)]


def inspect_path(path: str | os.PathLike) -> list[dict]:
    """facts-v1 ``extensions[]`` entries for a file, wheel or folder.

    A file that cannot be read raises BinaryFormatError (exit 2). Inside a folder or wheel, a
    damaged member becomes an entry with an ``error`` string, and the rest is still read.
    """
    p = os.fspath(path)
    if not os.path.exists(p):
        raise BinaryFormatError(f"{p} does not exist.")
    if os.path.isdir(p):
        out: list[dict] = []
        for f in _walk(p):
            try:
                out.extend(inspect_file(f, manifest=_folder_manifest(f) if _is_shared_object(f) else None))
            except BinaryFormatError as exc:
                out.append({"path": f, "error": str(exc)})
        return out
    return inspect_file(p, manifest=_folder_manifest(p) if _is_shared_object(p) else None)


# --- installed packages -----------------------------------------------------------------------


def _package_dirs(package: str) -> list[str]:
    if "." in package:
        package = package.split(".", 1)[0]
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return []
    if spec is None:
        return []
    if spec.submodule_search_locations:
        return [d for d in spec.submodule_search_locations if os.path.isdir(d)]
    if spec.origin and os.path.isfile(spec.origin):
        return [spec.origin]
    return []


def _dist_manifest(package: str) -> dict | None:
    try:
        names = importlib.metadata.packages_distributions().get(package, [])
    except Exception:  # noqa: BLE001 - broken metadata of an unrelated dist must not stop us
        names = []
    for dist_name in list(names) + [package.replace("_", "-")]:
        try:
            dist = importlib.metadata.distribution(dist_name)
            text = dist.read_text(MANIFEST_NAME)
        except (importlib.metadata.PackageNotFoundError, OSError, ValueError):
            continue
        if text is not None:
            return _read_manifest_bytes(text.encode("utf-8"), f"{dist_name} {MANIFEST_NAME}")
    return None


def load_error(package: str, *, runner=None, python: str | None = None, timeout: float = 180.0) -> str | None:
    """Import ``package`` (after torch) in a child Python and return the error text, None when it loads."""
    from cudadoctor.runner import Runner

    r = (runner or Runner()).run(
        [python or sys.executable, "-c", f"import torch, importlib; importlib.import_module({package!r})"],
        timeout=timeout,
    )
    if r.ok:
        return None
    if r.error and r.returncode is None:
        return r.error
    lines = [ln for ln in (r.stderr or r.stdout or "").strip().splitlines() if ln.strip()]
    return lines[-1] if lines else (r.error or f"exit status {r.returncode}")


def installed_extension_entries(package: str = "cudadoctor_ops", *, load_check: bool = False,
                                runner=None) -> list[dict]:
    """Entries for the shared objects of an installed package, located without importing it.

    Empty when the package is not installed. ``load_check`` imports it in a child process (torch
    first) and puts the error text into ``load_error`` of each entry.
    """
    out: list[dict] = []
    manifest = _dist_manifest(package)
    for d in _package_dirs(package):
        files = [d] if os.path.isfile(d) else list(_walk(d))
        for f in files:
            if not _is_shared_object(f):
                continue
            try:
                info = read_binary(f)
            except BinaryFormatError as exc:
                out.append({"path": f, "sass": [], "ptx": [], "error": str(exc), "load_error": None})
                continue
            out.append(entry_from_info(info, path=f, manifest=manifest, size=os.path.getsize(f)))
    if out and load_check:
        err = load_error(package, runner=runner)
        for e in out:
            e["load_error"] = err
    return out


# --- verdicts ---------------------------------------------------------------------------------


def verdict(entry: dict, cc: object, *, driver_cuda: object = None) -> dict:
    """Whether ``entry`` runs on a device of capability ``cc``: natively (SASS), through PTX JIT
    (and the driver that needs), or not at all. ``driver_cuda``: the driver's CUDA, when known."""
    dev = Arch.parse(cc)
    gpu = dev.base.cc if dev is not None else str(cc)
    out = {"path": entry.get("path"), "gpu": gpu, "runs": False, "via": None, "needs_driver": None,
           "needs_driver_cuda": None, "code": None, "reason": None}
    sass = [s for s in entry.get("sass") or [] if isinstance(s, str)]
    ptx = [p for p in entry.get("ptx") or [] if isinstance(p, str)]
    if dev is None:
        out["reason"] = f"{cc!r} is not a compute capability"
        return out
    native = [s for s in sass if sass_runs_on(s, dev)]
    if native:
        out.update(runs=True, via="sass", code=max(native, key=arch_sort_key))
        return out
    jit = [p for p in ptx if ptx_runs_on(p, dev)]
    if not jit:
        have = ", ".join(sass + ptx) or "no device code"
        out["reason"] = f"no SASS that runs on {gpu} and no PTX it can JIT-compile (has: {have})"
        return out
    best = max(jit, key=arch_sort_key)
    isa = (entry.get("ptx_isa") or {}).get(best)
    need_cuda = ptx_cuda(isa) if isa else None
    out.update(runs=True, via="ptx", code=best, needs_driver_cuda=need_cuda,
               needs_driver=driver_for_cuda(need_cuda) if need_cuda else None)
    have = CudaVersion.parse(driver_cuda)
    if need_cuda and have is not None and have < CudaVersion.parse(need_cuda):
        out.update(runs=False, reason=f"PTX ISA {isa} needs a driver for CUDA >= {need_cuda}; this driver supports CUDA {have}")
    return out


def has_device_code(entry: dict) -> bool:
    return bool(entry.get("sass") or entry.get("ptx"))


def verdicts(entries: list[dict], ccs: list[str], *, driver_cuda: object = None) -> list[dict]:
    """One verdict per (entry with device code, device)."""
    return [verdict(e, cc, driver_cuda=driver_cuda) for e in entries if not e.get("error") and has_device_code(e)
            for cc in ccs]

