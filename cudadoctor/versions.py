"""Version values as people and tools spell them, parsed leniently into packaging Versions.

Real snapshots carry "12.1", "V12.1.105", "release 12.1, V12.1.105", "2.7.0.dev20250310+cu124",
"cu121", "12040" (cuDriverGetVersion) and "550.54.15". Everything here is pure and never raises
on odd input: unparseable values give ``None``.
"""

from __future__ import annotations

import re
from functools import total_ordering

from packaging.version import InvalidVersion, Version

_NUM = re.compile(r"(\d+(?:\.\d+)*)")


def parse(text: object) -> Version | None:
    """Leading dotted number of ``text`` as a Version ("V12.1.105" -> 12.1.105), else None."""
    if text is None:
        return None
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        text = str(text)
    if not isinstance(text, str):
        return None
    s = text.strip()
    try:
        return Version(s)
    except InvalidVersion:
        pass
    m = _NUM.search(s)
    if not m:
        return None
    try:
        return Version(m.group(1))
    except InvalidVersion:
        return None


@total_ordering
class CudaVersion:
    """A CUDA major.minor, e.g. from "12.1", "V12.1.105", "cu121", "12040", "release 12.1"."""

    __slots__ = ("major", "minor")

    def __init__(self, major: int, minor: int):
        self.major = int(major)
        self.minor = int(minor)

    @classmethod
    def parse(cls, text: object) -> "CudaVersion | None":
        if text is None or isinstance(text, bool):
            return None
        if isinstance(text, CudaVersion):
            return text
        if isinstance(text, int):
            return cls._from_int(text)
        if isinstance(text, float):
            text = repr(text)
        if not isinstance(text, str):
            return None
        s = text.strip().lower()
        if not s:
            return None
        m = re.search(r"cu(\d{2,3})\b", s)
        if m and "." not in s.split("cu", 1)[-1][:4]:
            digits = m.group(1)
            return cls(int(digits[:-1]), int(digits[-1]))
        m = re.search(r"release\s+(\d+)\.(\d+)", s)
        if m:
            return cls(int(m.group(1)), int(m.group(2)))
        m = re.search(r"(\d+)\.(\d+)", s)
        if m:
            return cls(int(m.group(1)), int(m.group(2)))
        m = re.fullmatch(r"v?(\d+)", s)
        if m:
            n = int(m.group(1))
            if n >= 1000:
                return cls._from_int(n)
            return cls(n, 0)
        return None

    @classmethod
    def _from_int(cls, n: int) -> "CudaVersion | None":
        if n >= 1000:  # cuDriverGetVersion style: 12040 -> 12.4
            return cls(n // 1000, (n % 1000) // 10)
        if n > 0:
            return cls(n, 0)
        return None

    def _key(self) -> tuple[int, int]:
        return (self.major, self.minor)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CudaVersion):
            return NotImplemented
        return self._key() == other._key()

    def __lt__(self, other: "CudaVersion") -> bool:
        return self._key() < other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __str__(self) -> str:
        return f"{self.major}.{self.minor}"

    def __repr__(self) -> str:
        return f"CudaVersion({self.major}, {self.minor})"

    @property
    def tag(self) -> str:
        """Wheel index tag: 12.1 -> "cu121", 13.0 -> "cu130"."""
        return f"cu{self.major}{self.minor}"


def torch_release(text: object) -> Version | None:
    """The release part of a torch version: "2.7.0.dev20250310+cu124" -> 2.7.0."""
    v = parse(text)
    if v is None:
        return None
    return Version(".".join(str(p) for p in v.release[:3]))


def torch_local_cuda(text: object) -> CudaVersion | None:
    """CUDA from the local label of a torch version: "2.6.0+cu126" -> 12.6; "+cpu" or none -> None."""
    if not isinstance(text, str) or "+" not in text:
        return None
    local = text.split("+", 1)[1]
    m = re.search(r"cu(\d{2,3})", local)
    if not m:
        return None
    d = m.group(1)
    return CudaVersion(int(d[:-1]), int(d[-1]))
