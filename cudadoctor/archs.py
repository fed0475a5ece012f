"""GPU architectures: one type for sm_XY / compute_XY / X.Y (+a/f suffix) and the rules of which
code runs on which device. Pure; no subprocess, no torch.

Rules (CUDA programming guide, "binary compatibility"; torch/cuda/__init__.py):
- SASS sm_XY runs on a device X.Z with Z >= Y (same major only).
- Jetson/integrated targets (5.3, 6.2, 7.2, 8.7) run only on exactly that device.
- ``a`` suffix (sm_90a): only on exactly that compute capability.
- ``f`` suffix (sm_100f): the same major with an equal or higher minor.
- PTX compute_XY is JIT-compiled by the driver for any device with capability >= X.Y
  (compute_XYa: only that device; compute_XYf: same major, minor >= Y).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

JETSON_ONLY = frozenset({(5, 3), (6, 2), (7, 2), (8, 7)})

_ARCH_RE = re.compile(
    r"^\s*(?:(?P<kind>sm|compute|lto)_)?(?P<num>\d+)(?:\.(?P<minor>\d+))?(?P<suffix>[af]?)\s*$",
    re.IGNORECASE,
)


@dataclass(frozen=True, order=True)
class Arch:
    major: int
    minor: int
    suffix: str = ""  # "", "a" or "f"

    @classmethod
    def parse(cls, text: object) -> "Arch | None":
        """'sm_86', 'compute_90a', '8.6', '86', '9.0a', '100f' -> Arch; anything else -> None."""
        if isinstance(text, Arch):
            return text
        if not isinstance(text, str):
            return None
        m = _ARCH_RE.match(text)
        if not m:
            return None
        num, minor, suffix = m.group("num"), m.group("minor"), m.group("suffix").lower()
        if minor is not None:
            return cls(int(num), int(minor), suffix)
        if len(num) < 2:
            return None
        return cls(int(num[:-1]), int(num[-1]), suffix)

    @property
    def cc(self) -> str:
        return f"{self.major}.{self.minor}{self.suffix}"

    @property
    def sm(self) -> str:
        return f"sm_{self.major}{self.minor}{self.suffix}"

    @property
    def compute(self) -> str:
        return f"compute_{self.major}{self.minor}{self.suffix}"

    @property
    def base(self) -> "Arch":
        return Arch(self.major, self.minor)

    def __str__(self) -> str:
        return self.cc


def _device(cc: object) -> Arch | None:
    a = Arch.parse(cc) if not isinstance(cc, Arch) else cc
    return None if a is None else a.base


def sass_runs_on(code: object, cc: object) -> bool:
    """True when SASS built for ``code`` runs natively on a device of capability ``cc``."""
    a, d = Arch.parse(code), _device(cc)
    if a is None or d is None:
        return False
    if a.suffix == "a" or (a.major, a.minor) in JETSON_ONLY or (d.major, d.minor) in JETSON_ONLY:
        return (a.major, a.minor) == (d.major, d.minor)
    return a.major == d.major and d.minor >= a.minor


def ptx_runs_on(code: object, cc: object) -> bool:
    """True when PTX for ``code`` can be JIT-compiled by the driver for a device ``cc``."""
    a, d = Arch.parse(code), _device(cc)
    if a is None or d is None:
        return False
    if a.suffix == "a":
        return (a.major, a.minor) == (d.major, d.minor)
    if a.suffix == "f":
        return a.major == d.major and d.minor >= a.minor
    return (d.major, d.minor) >= (a.major, a.minor)


def runs_on(sass: list[str] | None, ptx: list[str] | None, cc: object) -> tuple[bool, str | None]:
    """(runs, via) for a binary with these SASS and PTX targets on a device ``cc``."""
    if any(sass_runs_on(s, cc) for s in (sass or [])):
        return True, "sass"
    if any(ptx_runs_on(p, cc) for p in (ptx or [])):
        return True, "ptx"
    return False, None


# ---------------------------------------------------------------------------------------------
# What nvcc can target (knowledge table nvcc_targets.toml) and GPU names -> compute capability.

from functools import lru_cache  # noqa: E402

from cudadoctor.errors import InputError  # noqa: E402
from cudadoctor.versions import CudaVersion  # noqa: E402


@lru_cache(maxsize=None)
def _targets() -> dict[Arch, dict]:
    from cudadoctor.knowledge import load_table

    out: dict[Arch, dict] = {}
    for row in load_table("nvcc_targets"):
        a = Arch.parse(row.get("arch"))
        if a is not None:
            out[a] = row
    return out


def known_archs() -> list[Arch]:
    """Every architecture the nvcc table knows, sorted."""
    return sorted(_targets())


def is_known_arch(arch: object) -> bool:
    a = Arch.parse(arch)
    return a is not None and a in _targets()


def nvcc_target_range(arch: object) -> tuple[str, str | None]:
    """(first, last) CUDA release whose nvcc can target ``arch``; last is None while still supported.

    Raises InputError for text that is not an architecture the table knows.
    """
    a = Arch.parse(arch)
    row = _targets().get(a) if a is not None else None
    if row is None:
        raise InputError(
            f"{arch!r} is not a CUDA GPU architecture known to cudadoctor.",
            hint="Known: " + ", ".join(x.cc for x in known_archs()) + ".",
        )
    return str(row["first"]), (str(row["last"]) if row.get("last") else None)


def nvcc_can_target(arch: object, nvcc_version: object) -> bool:
    """True when the nvcc of ``nvcc_version`` ("12.1", "V12.1.105", CudaVersion) can target ``arch``.

    An unknown architecture is False. An unparseable nvcc version is True for a known architecture
    (nothing to refuse without a version).
    """
    a = Arch.parse(arch)
    if a is None or a not in _targets():
        return False
    v = CudaVersion.parse(nvcc_version)
    if v is None:
        return True
    first, last = nvcc_target_range(a)
    if v < CudaVersion.parse(first):
        return False
    return last is None or v <= CudaVersion.parse(last)


def describe_nvcc_range(arch: object) -> str:
    """'sm_120 needs CUDA >= 12.8', 'sm_35 needs CUDA <= 11.8 (removed in 12.0)', ..."""
    a = Arch.parse(arch)
    first, last = nvcc_target_range(a)
    if last is None:
        return f"{a.sm} needs nvcc from CUDA >= {first}"
    removed = _next_release(last)
    if CudaVersion.parse(first) <= CudaVersion(7, 0):
        return f"{a.sm} needs nvcc from CUDA <= {last} (removed in CUDA {removed})"
    return f"{a.sm} needs nvcc from CUDA {first} to {last} (removed in CUDA {removed})"


_RELEASES = (
    "7.0 7.5 8.0 9.0 9.1 9.2 10.0 10.1 10.2 11.0 11.1 11.2 11.3 11.4 11.5 11.6 11.7 11.8 "
    "12.0 12.1 12.2 12.3 12.4 12.5 12.6 12.8 12.9 13.0 13.1 13.2"
).split()


def _next_release(version: str) -> str:
    """The CUDA release after ``version`` (12.6 -> 12.8: 12.7 was never released)."""
    v = CudaVersion.parse(version)
    for r in _RELEASES:
        if CudaVersion.parse(r) > v:
            return r
    return f"{v.major}.{v.minor + 1}"


def torch_supported(arch: object) -> bool:
    a = Arch.parse(arch)
    row = _targets().get(a) if a is not None else None
    return bool(row and row.get("torch"))


@lru_cache(maxsize=None)
def _gpu_patterns() -> tuple[tuple[re.Pattern, str], ...]:
    from cudadoctor.knowledge import load_table

    return tuple((re.compile(r["pattern"], re.IGNORECASE), str(r["cc"])) for r in load_table("gpus"))


def cc_from_name(gpu_name: object) -> str | None:
    """Compute capability ("8.9") for a GPU name ("NVIDIA GeForce RTX 4090"); None when unknown."""
    if not isinstance(gpu_name, str) or not gpu_name.strip():
        return None
    for pat, cc in _gpu_patterns():
        if pat.search(gpu_name):
            return cc
    return None


# ---------------------------------------------------------------------------------------------
# Arch specs: what people write in TORCH_CUDA_ARCH_LIST and on the command line.

# Family names as torch.utils.cpp_extension expands them (combined names first).
FAMILIES: dict[str, str] = {
    "kepler+tesla": "3.7",
    "kepler": "3.5+PTX",
    "maxwell+tegra": "5.3",
    "maxwell": "5.0;5.2+PTX",
    "pascal": "6.0;6.1+PTX",
    "volta+tegra": "7.2",
    "volta": "7.0+PTX",
    "turing": "7.5+PTX",
    "ampere+tegra": "8.7",
    "ampere": "8.0;8.6+PTX",
    "ada": "8.9+PTX",
    "hopper": "9.0+PTX",
    "blackwell+tegra": "11.0",
    "blackwell": "10.0;10.3;12.0;12.1+PTX",
}

VALID_FORMS = (
    "'8.6', '86', 'sm_86' (SASS), 'compute_86' (PTX only), '8.9+PTX' (SASS and PTX), "
    "'9.0a' / '10.0f' (arch- and family-specific), a family name (Ampere, Ada, Hopper, Blackwell, "
    "Turing, Volta, Pascal, Maxwell, Kepler), 'native' (the GPUs present) or 'all' (everything the "
    "nvcc targets that torch supports); separate items with ',', ';' or spaces"
)

_SPLIT = re.compile(r"[,;\s]+")


@dataclass(frozen=True)
class ArchItem:
    """One target of an arch spec: SASS for ``arch`` and/or its PTX. ``token`` is what the user wrote."""

    arch: Arch
    sass: bool = True
    ptx: bool = False
    token: str = ""

    @property
    def cc(self) -> str:
        return self.arch.cc

    def gencode(self) -> list[str]:
        out = []
        if self.sass:
            out.append(f"-gencode=arch={self.arch.compute},code={self.arch.sm}")
        if self.ptx:
            out.append(f"-gencode=arch={self.arch.compute},code={self.arch.compute}")
        return out


def _parse_token(tok: str, gpus: list[str] | None, nvcc_version: object) -> list[ArchItem] | None:
    """Items for one token; None when the token is not valid."""
    low = tok.lower()
    if low in FAMILIES:
        out = []
        for part in FAMILIES[low].split(";"):
            out.extend(_parse_token(part, gpus, nvcc_version) or [])
        return [ArchItem(i.arch, i.sass, i.ptx, tok) for i in out]
    if low == "native":
        ccs = sorted({a for a in (Arch.parse(g) for g in (gpus or [])) if a is not None})
        return [ArchItem(a, True, n == len(ccs) - 1, tok) for n, a in enumerate(ccs)]
    if low == "all":
        archs = [
            a for a in known_archs()
            if not a.suffix and torch_supported(a) and (nvcc_version is None or nvcc_can_target(a, nvcc_version))
        ]
        return [ArchItem(a, True, n == len(archs) - 1, tok) for n, a in enumerate(archs)]
    ptx = False
    body = tok
    if low.endswith("+ptx"):
        ptx, body = True, tok[:-4]
    a = Arch.parse(body)
    if a is None or "lto_" in body.lower() or a not in _targets():
        return None
    if body.strip().lower().startswith("compute_"):
        return [ArchItem(a, False, True, tok)]
    if body.strip().lower().startswith("sm_") and ptx:
        return [ArchItem(a, True, True, tok)]
    return [ArchItem(a, True, ptx, tok)]


def _merge(items: list[ArchItem]) -> list[ArchItem]:
    by: dict[Arch, ArchItem] = {}
    for it in items:
        old = by.get(it.arch)
        if old is None:
            by[it.arch] = it
        else:
            by[it.arch] = ArchItem(it.arch, old.sass or it.sass, old.ptx or it.ptx, old.token)
    return [by[a] for a in sorted(by)]


def parse_arch_list(text: object, *, gpus: list[str] | None = None, nvcc_version: object = None) -> list[ArchItem]:
    """Lenient TORCH_CUDA_ARCH_LIST parser: never raises; skips tokens that are not architectures.

    ``native`` expands to ``gpus`` (compute capabilities) when given, ``all`` to what
    ``nvcc_version`` can target (every known torch arch when None). Items are merged per arch and sorted.
    """
    if not isinstance(text, str):
        return []
    items: list[ArchItem] = []
    for tok in _SPLIT.split(text.strip()):
        if not tok:
            continue
        got = _parse_token(tok, gpus, nvcc_version)
        if got:
            items.extend(got)
    return _merge(items)


def parse_spec(text: object, *, gpus: list[str] | None = None, nvcc_version: object = None) -> list[ArchItem]:
    """Strict arch spec parser: like parse_arch_list, but bad input raises InputError quoting it."""
    if not isinstance(text, str) or not text.strip():
        raise InputError(f"empty architecture list {text!r}.", hint=f"Valid forms: {VALID_FORMS}.")
    items: list[ArchItem] = []
    bad: list[str] = []
    for tok in _SPLIT.split(text.strip()):
        if not tok:
            continue
        got = _parse_token(tok, gpus, nvcc_version)
        if got is None:
            bad.append(tok)
        else:
            items.extend(got)
    if bad:
        what = ", ".join(repr(b) for b in bad)
        raise InputError(
            f"cannot read architecture {what} in {text!r}.",
            hint=f"Valid forms: {VALID_FORMS}.",
        )
    return _merge(items)


def torch_arch_list(items: list[ArchItem]) -> str:
    """TORCH_CUDA_ARCH_LIST value for ``items`` ("8.6;8.9+PTX"). A PTX-only item becomes X.Y+PTX."""
    return ";".join(i.cc + ("+PTX" if i.ptx else "") for i in items)


def gencode_flags(items: list[ArchItem]) -> list[str]:
    return [g for i in items for g in i.gencode()]
