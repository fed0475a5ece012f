"""Knowledge queries the rules share: driver <-> CUDA, host compiler limits, torch wheel choice.

Pure functions over the tables in cudadoctor/data (driver_cuda, host_compilers, torch_wheels).
Every function accepts odd or missing input and returns None / [] instead of raising.
"""

from __future__ import annotations

from dataclasses import dataclass

from packaging.version import Version

from cudadoctor import archs
from cudadoctor.knowledge import load_table
from cudadoctor.versions import CudaVersion, parse, torch_release

WHEEL_INDEX = "https://download.pytorch.org/whl/"


# --- driver ---------------------------------------------------------------------------------


def _driver_column(os_name: str | None) -> str:
    return "windows" if os_name == "windows" else "linux"


def min_driver(cuda: CudaVersion | None, os_name: str | None = "linux") -> str | None:
    """Oldest driver whose own CUDA version is at least ``cuda`` (release notes, table 3)."""
    if cuda is None:
        return None
    col = _driver_column(os_name)
    best: tuple[CudaVersion, str] | None = None
    for row in load_table("driver_cuda"):
        if row.get("kind") != "release" or not row.get(col):
            continue
        c = CudaVersion.parse(row.get("cuda"))
        if c is None or c < cuda:
            continue
        if best is None or c < best[0]:
            best = (c, row[col])
    return best[1] if best else None


def minor_compat_floor(major: int, os_name: str | None = "linux") -> str | None:
    col = _driver_column(os_name)
    for row in load_table("driver_cuda"):
        if row.get("kind") == "minor_compat" and row.get("major") == major:
            return row.get(col)
    return None


def cuda_of_driver(version: object, os_name: str | None = "linux") -> CudaVersion | None:
    """Newest CUDA a driver of this version supports, from the minimum-driver table."""
    v = parse(version)
    if v is None:
        return None
    col = _driver_column(os_name)
    best: CudaVersion | None = None
    for row in load_table("driver_cuda"):
        if row.get("kind") != "release" or not row.get(col):
            continue
        need = parse(row[col])
        c = CudaVersion.parse(row.get("cuda"))
        if need is None or c is None or v < need:
            continue
        if best is None or c > best:
            best = c
    return best


@dataclass(frozen=True)
class DriverView:
    """What the facts say about the driver: its version string and the CUDA it supports."""

    version: str | None
    cuda: CudaVersion | None
    os: str | None

    def supports(self, cuda: CudaVersion | None) -> bool | None:
        """Can an application built with ``cuda`` run here? None when unknown.

        True when the driver's own CUDA is at least ``cuda``, or (minor-version compatibility) the
        major versions match and the driver is at or above that major's compatibility floor.
        """
        if cuda is None or self.cuda is None:
            return None
        if self.cuda >= cuda:
            return True
        if self.cuda.major != cuda.major:
            return False
        floor = parse(minor_compat_floor(cuda.major, self.os))
        have = parse(self.version)
        if floor is not None and have is not None:
            return have >= floor
        # Without a driver version: a driver reporting X.1+ is past every X.0 floor.
        return self.cuda.major >= 12 or self.cuda.minor >= 1


# --- host compilers -------------------------------------------------------------------------


def compiler_max(nvcc: CudaVersion | None, family: str) -> int | None:
    """Newest gcc (family "gcc") / clang major the given nvcc accepts; None when unknown."""
    if nvcc is None:
        return None
    key = "clang_max" if family == "clang" else "gcc_max"
    best: tuple[CudaVersion, int] | None = None
    for row in load_table("host_compilers"):
        c = CudaVersion.parse(row.get("cuda"))
        if c is None or key not in row or c > nvcc:
            continue
        if best is None or c > best[0]:
            best = (c, int(row[key]))
    if best is None:
        return None
    # An nvcc newer than every row: trust the newest row only within the same major.
    if best[0].major != nvcc.major:
        return None
    return best[1]


# --- torch wheels ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Wheel:
    torch: str
    cuda: CudaVersion
    tag: str
    pypi_default: bool
    arch_list: tuple[str, ...]
    ptx: str | None
    cxx11_abi: bool | None
    index_url: str

    @property
    def release(self) -> Version:
        return Version(self.torch)

    def covers(self, cc: object, *, sass_only: bool = False) -> bool:
        sass = [f"sm_{a.replace('.', '')}" for a in self.arch_list]
        ptx = [f"compute_{self.ptx.replace('.', '')}"] if self.ptx and not sass_only else []
        return archs.runs_on(sass, ptx, cc)[0]

    def command(self, version: str | None = None) -> str:
        return f"pip install torch=={version or self.torch} --index-url {self.index_url}"


def wheels() -> list[Wheel]:
    out = []
    for row in load_table("torch_wheels"):
        cuda = CudaVersion.parse(row.get("cuda"))
        if cuda is None or parse(row.get("torch")) is None:
            continue
        out.append(
            Wheel(
                torch=str(row["torch"]),
                cuda=cuda,
                tag=str(row.get("tag") or cuda.tag),
                pypi_default=bool(row.get("pypi_default")),
                arch_list=tuple(str(a) for a in row.get("arch_list", [])),
                ptx=row.get("ptx"),
                cxx11_abi=row.get("cxx11_abi"),
                index_url=str(row.get("index_url") or WHEEL_INDEX + cuda.tag),
            )
        )
    return out


def _minor(v: Version | None) -> tuple[int, int] | None:
    if v is None or len(v.release) < 2:
        return None
    return (v.release[0], v.release[1])


def pick_wheel(
    *,
    driver: DriverView | None = None,
    ccs: list[str] | None = None,
    current_torch: object = None,
    cuda: CudaVersion | None = None,
    cuda_major: int | None = None,
) -> tuple[Wheel, str] | None:
    """The torch wheel to recommend and the exact version to pin, or None.

    Candidates must run on the driver (its CUDA at least the wheel's, or the same major under
    minor-version compatibility, where only SASS counts since the driver cannot JIT newer PTX),
    cover every GPU in ``ccs``, and match ``cuda`` / ``cuda_major`` when given.
    Preference: the installed torch's minor series (pinning the installed release), then the
    smallest newer release, then the newest; within a release the newest CUDA that fits.
    """
    ccs = [c for c in (ccs or []) if archs.Arch.parse(c) is not None]
    cur = torch_release(current_torch)
    cur_minor = _minor(cur)
    cands = []
    for w in wheels():
        if cuda is not None and (w.cuda.major, w.cuda.minor) != (cuda.major, cuda.minor):
            continue
        if cuda_major is not None and w.cuda.major != cuda_major:
            continue
        native = driver is None or driver.cuda is None or driver.cuda >= w.cuda
        if not native and not driver.supports(w.cuda):
            continue
        # under minor-version compatibility the driver cannot JIT the wheel's newer PTX: SASS only
        if ccs and not all(w.covers(c, sass_only=not native) for c in ccs):
            continue
        cands.append(w)
    if not cands:
        return None

    same = [w for w in cands if cur_minor is not None and _minor(w.release) == cur_minor]
    newer = [w for w in cands if cur is not None and w.release > cur]
    if same:
        best = max(same, key=lambda w: w.cuda)
    elif newer:  # the smallest upgrade that works disturbs the rest of the environment least
        low = min(w.release for w in newer)
        best = max((w for w in newer if w.release == low), key=lambda w: w.cuda)
    else:
        best = max(cands, key=lambda w: (w.release, w.cuda))
    pin = best.torch
    if cur is not None and cur_minor == _minor(best.release) and cur.release[:3] != (0, 0, 0):
        pin = str(cur)
    return best, pin


def wheel_fix(**kw) -> list[str]:
    """``pip install torch==X --index-url ...`` for :func:`pick_wheel`, or [] when none fits."""
    got = pick_wheel(**kw)
    if got is None:
        return []
    w, pin = got
    return [w.command(pin)]


# --- views over facts -----------------------------------------------------------------------


def driver_view(f) -> DriverView:
    """The driver of ``f`` (a rules.Facts): version, CUDA (reported, else derived), OS column."""
    version = f.get("driver.version")
    os_name = f.get("host.os")
    if f.get("host.wsl") in (1, 2):
        os_name = "windows"  # under WSL the driver is the Windows one
    cuda = CudaVersion.parse(f.get("driver.cuda"))
    if cuda is None and version is not None:
        cuda = cuda_of_driver(version, os_name)
    return DriverView(str(version) if version is not None else None, cuda, os_name)


def gpu_ccs(f) -> list[tuple[int, str, str]]:
    """(index, name, cc) of every GPU whose compute capability is known or derivable from its name."""
    out = []
    for n, g in enumerate(f.list("gpus")):
        if not isinstance(g, dict):
            continue
        name = g.get("name") if isinstance(g.get("name"), str) else ""
        cc = g.get("cc")
        a = archs.Arch.parse(str(cc)) if cc is not None else None
        if a is None and name:
            lookup = getattr(archs, "cc_from_name", None)
            if lookup is not None:
                try:
                    a = archs.Arch.parse(lookup(name))
                except Exception:  # noqa: BLE001 - a lookup problem must not stop the rule
                    a = None
        if a is None:
            continue
        idx = g.get("index") if isinstance(g.get("index"), int) else n
        out.append((idx, name, a.base.cc))
    return out


def gpus_present(f) -> bool:
    return bool(f.list("gpus"))


def toolkits(f) -> list[dict]:
    return [t for t in f.list("toolkits") if isinstance(t, dict)]


def build_toolkit(f) -> dict | None:
    """The toolkit extension builds would use: the first one listed."""
    tks = toolkits(f)
    return tks[0] if tks else None


def torch_cuda(f) -> CudaVersion | None:
    """torch.version.cuda, else the +cuXYZ of the torch version."""
    c = CudaVersion.parse(f.get("torch.cuda"))
    if c is None:
        c = _local_cuda(f.get("torch.version"))
    return c


def _local_cuda(version: object) -> CudaVersion | None:
    from cudadoctor.versions import torch_local_cuda

    return torch_local_cuda(version)


def error_texts(f) -> str:
    """Every error string the facts carry, lower-cased, for message matching."""
    parts = [
        f.get("error_text"),
        f.get("driver.error"),
        f.get("torch.device_error"),
        f.get("torch.import_error"),
    ]
    parts += [w for w in f.list("torch.warnings") if isinstance(w, str)]  # warnings torch printed on import
    return "\n".join(p for p in parts if isinstance(p, str)).lower()


def pypi_default_cuda(torch_version: object) -> CudaVersion | None:
    """CUDA of the wheel plain `pip install torch==X` gets from PyPI for this torch minor series."""
    rel = _minor(torch_release(torch_version))
    if rel is None:
        return None
    for w in wheels():
        if w.pypi_default and _minor(w.release) == rel:
            return w.cuda
    return None
