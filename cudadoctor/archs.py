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
