"""The finished wheel: a PEP 440 local label in its version and file name, and a build manifest
(cudadoctor_build.json) inside its .dist-info. RECORD is rewritten to match.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shutil
import tempfile
import zipfile
from pathlib import Path
from typing import Iterable

from cudadoctor.build.plan import SKIP_DIRS, BuildPlan, relabel_version
from cudadoctor.errors import CudadoctorError

MANIFEST_NAME = "cudadoctor_build.json"
MANIFEST_SCHEMA = "cudadoctor.build/1"

_WHEEL_RE = re.compile(r"^(?P<dist>[^-]+)-(?P<ver>[^-]+)(?P<rest>(-\d[^-]*)?-[^-]+-[^-]+-[^-]+)\.whl$")


def split_wheel_name(name: str) -> tuple[str, str, str]:
    m = _WHEEL_RE.match(os.path.basename(name))
    if not m:
        raise CudadoctorError(f"{name!r} is not a wheel file name (dist-version-tags.whl).")
    return m.group("dist"), m.group("ver"), m.group("rest")


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def make_manifest(plan: BuildPlan, info: dict, so_archs: dict[str, dict], src_hash: str) -> dict:
    t = plan.target
    return {
        "schema": MANIFEST_SCHEMA,
        "target": t.name,
        "local_label": t.local_label,
        "arch_list": t.arch_list,
        "requested": {"sass": t.sass, "ptx": t.ptx},
        "shared_objects": so_archs,
        "torch": info.get("torch"),
        "cuda": info.get("torch_cuda") or t.cuda,
        "nvcc": info.get("nvcc"),
        "host_compiler": info.get("host_compiler"),
        "glibc": info.get("glibc"),
        "cxx11_abi": info.get("cxx11_abi"),
        "python": info.get("python"),
        "source_hash": "sha256:" + src_hash,
        "backend": plan.backend,
        "toolkit": t.toolkit if plan.backend == "docker" else "host",
        "image": plan.image.tag if plan.image else None,
        "nvcc_flags": list(plan.nvcc_flags),
        "compressed": plan.compress,
        "compiler_cache": info.get("compiler_cache"),
        # which shared objects loaded next to the build's torch, and what could not be checked
        "load_check": {k: (info.get("load_check") or {}).get(k, []) for k in ("checked", "notes")},
    }


def finish_wheel(wheel: str | Path, out_dir: str | Path, label: str, manifest: dict) -> Path:
    """Write ``wheel`` into ``out_dir`` with ``label`` as its local version and ``manifest`` inside."""
    wheel = Path(wheel)
    dist, ver, rest = split_wheel_name(wheel.name)
    new_ver = relabel_version(ver, label)
    old_info, new_info = f"{dist}-{ver}.dist-info", f"{dist}-{new_ver}.dist-info"
    target = Path(out_dir) / f"{dist}-{new_ver}{rest}.whl"
    files: list[tuple[zipfile.ZipInfo, bytes]] = []
    with zipfile.ZipFile(wheel) as zin:
        for zi in zin.infolist():
            if zi.is_dir():
                continue
            data = zin.read(zi)
            name = zi.filename
            if name.startswith(old_info + "/"):
                name = new_info + name[len(old_info):]
                base = name.rsplit("/", 1)[-1]
                if base == "RECORD" or base == MANIFEST_NAME:
                    continue
                if base == "METADATA":
                    data = re.sub(rb"(?m)^Version: .*$", f"Version: {new_ver}".encode(), data, count=1)
            nzi = zipfile.ZipInfo(name, date_time=zi.date_time)
            nzi.external_attr = zi.external_attr
            nzi.compress_type = zipfile.ZIP_DEFLATED
            files.append((nzi, data))
    mzi = zipfile.ZipInfo(f"{new_info}/{MANIFEST_NAME}", date_time=(2020, 1, 1, 0, 0, 0))
    mzi.external_attr = 0o644 << 16
    mzi.compress_type = zipfile.ZIP_DEFLATED
    files.append((mzi, (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode()))
    record_lines = [f"{zi.filename},{_record_hash(d)},{len(d)}" for zi, d in files]
    record_lines.append(f"{new_info}/RECORD,,")
    rzi = zipfile.ZipInfo(f"{new_info}/RECORD", date_time=(2020, 1, 1, 0, 0, 0))
    rzi.external_attr = 0o644 << 16
    rzi.compress_type = zipfile.ZIP_DEFLATED
    files.append((rzi, ("\n".join(record_lines) + "\n").encode()))
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".cudadoctor-", suffix=".whl", dir=out_dir)
    os.close(fd)
    try:
        with zipfile.ZipFile(tmp, "w") as zout:
            for zi, data in files:
                zout.writestr(zi, data)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def read_manifest(wheel: str | Path) -> dict | None:
    with zipfile.ZipFile(wheel) as z:
        for n in z.namelist():
            parts = n.split("/")
            if len(parts) == 2 and parts[0].endswith(".dist-info") and parts[1] == MANIFEST_NAME:
                return json.loads(z.read(n))
    return None


def source_hash(root: str | Path, files: Iterable[str] | None = None) -> str:
    """sha256 over the relative paths and contents of a source tree (build outputs and VCS folders skipped)."""
    root = Path(root)
    h = hashlib.sha256()
    for rel in sorted(files if files is not None else iter_source_files(root)):
        h.update(rel.encode() + b"\0")
        h.update((root / rel).read_bytes())
        h.update(b"\0")
    return h.hexdigest()


def iter_source_files(root: Path) -> list[str]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.endswith(".egg-info"))
        for f in sorted(filenames):
            if f.endswith((".pyc", ".so", ".o")):
                continue
            out.append(os.path.relpath(os.path.join(dirpath, f), root))
    return out


def move_log(log: Path, wheel: Path) -> Path:
    """Keep the build log next to the wheel, named after it."""
    dest = wheel.with_name(wheel.name[: -len(".whl")] + ".build.log")
    shutil.move(str(log), dest)
    return dest
