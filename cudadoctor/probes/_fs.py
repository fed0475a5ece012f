"""Filesystem access relative to a root: "/" in production, a tmp tree in tests.

Paths inside facts are always written as the probed system sees them ("/usr/lib/wsl/lib/..."),
never with the test root prefixed. Every helper here swallows OSError and returns None/False/[].
"""

from __future__ import annotations

import glob
import os
from typing import Iterable, Mapping


class Root:
    def __init__(self, root: str = "/"):
        self.root = os.path.abspath(root or "/")

    @property
    def is_host(self) -> bool:
        return self.root == "/"

    def host(self, path: str) -> str:
        """The real path of ``path`` (as the probed system spells it) on this machine."""
        if self.is_host:
            return path
        if path.startswith("/"):
            path = self.realpath(path)  # absolute links inside the tree point into the tree
        return self._join(path)

    def _join(self, path: str) -> str:
        return os.path.join(self.root, path.lstrip("/"))

    def inner(self, host_path: str) -> str:
        """Inverse of :meth:`host`: a real path back to the probed system's spelling."""
        if self.is_host:
            return host_path
        rel = os.path.relpath(host_path, self.root)
        if rel.startswith(".."):
            return host_path
        return "/" + ("" if rel == "." else rel)

    def exists(self, path: str) -> bool:
        return os.path.exists(self.host(path)) or os.path.lexists(self._join(path))

    def isfile(self, path: str) -> bool:
        return os.path.isfile(self.host(path))

    def isdir(self, path: str) -> bool:
        return os.path.isdir(self.host(path))

    def read_text(self, path: str, limit: int = 1 << 20) -> str | None:
        try:
            with open(self.host(path), "r", encoding="utf-8", errors="replace") as fh:
                return fh.read(limit)
        except (OSError, ValueError):
            return None

    def listdir(self, path: str) -> list[str]:
        try:
            return sorted(os.listdir(self.host(path)))
        except (OSError, ValueError):
            return []

    def glob(self, pattern: str) -> list[str]:
        try:
            return sorted(self.inner(p) for p in glob.glob(self.host(pattern)))
        except (OSError, ValueError):
            return []

    def realpath(self, path: str) -> str:
        """Symlinks resolved inside the root (absolute links point into the root, as under chroot)."""
        if self.is_host:
            try:
                return os.path.realpath(path)
            except (OSError, ValueError):
                return path
        parts = [p for p in path.split("/") if p]
        resolved: list[str] = []
        hops = 0
        while parts:
            part = parts.pop(0)
            if part == ".":
                continue
            if part == "..":
                if resolved:
                    resolved.pop()
                continue
            candidate = "/" + "/".join(resolved + [part])
            host = self._join(candidate)
            if os.path.islink(host) and hops < 40:
                hops += 1
                try:
                    target = os.readlink(host)
                except (OSError, ValueError):
                    resolved.append(part)
                    continue
                if target.startswith("/"):
                    resolved = []
                parts = [p for p in target.split("/") if p] + parts
                continue
            resolved.append(part)
        return "/" + "/".join(resolved)

    def is_executable(self, path: str) -> bool:
        host = self.host(path)
        try:
            return os.path.isfile(host) and os.access(host, os.X_OK)
        except (OSError, ValueError):  # ValueError: a NUL byte in a path from the environment
            return False

    def which(self, name: str, path_var: str | None) -> str | None:
        """First executable ``name`` on ``path_var`` (a PATH string), spelled as inside the root."""
        for d in split_path(path_var):
            if not d.startswith("/"):
                continue
            cand = os.path.join(d, name)
            if self.is_executable(cand):
                return cand
        return None


def split_path(value: str | None) -> list[str]:
    if not value:
        return []
    return [p for p in value.split(os.pathsep) if p]


def env_get(env: Mapping[str, str], name: str) -> str | None:
    v = env.get(name)
    return v if v is not None else None


def unique(items: Iterable[str]) -> list[str]:
    seen: set[str] = set()
    out: list[str] = []
    for i in items:
        if i not in seen:
            seen.add(i)
            out.append(i)
    return out
