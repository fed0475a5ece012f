"""Host C++ compiler: CUDAHOSTCXX, then CXX, then g++, then clang++; name, version, path."""

from __future__ import annotations

import os
import re
import shlex
from typing import Mapping

from cudadoctor.runner import Runner

from ._fs import Root


def _resolve(root: Root, value: str, path_var: str | None) -> str | None:
    try:
        word = shlex.split(value)[0] if value.strip() else ""
    except ValueError:
        word = value.strip().split()[0] if value.strip() else ""
    if not word:
        return None
    if "/" in word:
        return word if root.is_executable(word) else None
    return root.which(word, path_var)


def identify(runner: Runner, root: Root, path: str, timeout: float = 5.0) -> dict:
    exe = root.host(path)
    res = runner.run([exe, "--version"], timeout=timeout)
    text = (res.stdout or "") + (res.stderr or "")
    first = text.strip().splitlines()[0] if text.strip() else ""
    out: dict = {"name": None, "version": None, "path": path, "version_line": first or None}
    if not res.ok and not first:
        out["error"] = (res.error or f"exited {res.returncode}").replace(f"{exe}: ", "", 1)
        return out
    low = text.lower()
    if "clang" in low:
        out["name"] = "clang"
        m = re.search(r"clang version\s+(\d+(?:\.\d+)*)", text)
        out["version"] = m.group(1) if m else None
    elif "g++" in low or "gcc" in low or "free software foundation" in low:
        out["name"] = "gcc"
        dump = runner.run([exe, "-dumpfullversion", "-dumpversion"], timeout=timeout)
        v = dump.stdout.strip() if dump.ok else ""
        if re.fullmatch(r"\d+(\.\d+)*", v):
            out["version"] = v
        else:
            m = re.search(r"\)\s*(\d+\.\d+(?:\.\d+)?)", first)
            out["version"] = m.group(1) if m else None
    else:
        m = re.search(r"(\d+\.\d+(?:\.\d+)?)", first)
        out["name"] = os.path.basename(path)
        out["version"] = m.group(1) if m else None
    return out


def probe_host_compiler(runner: Runner, root: Root, env: Mapping[str, str]) -> dict | None:
    path_var = env.get("PATH")
    candidates: list[tuple[str, str]] = []
    for var in ("CUDAHOSTCXX", "CXX"):
        if env.get(var):
            candidates.append((env[var], var))
    candidates += [("g++", "PATH"), ("clang++", "PATH")]
    unresolved: list[str] = []
    for value, via in candidates:
        path = _resolve(root, value, path_var)
        if path is None:
            if via != "PATH":
                unresolved.append(f"{via}={value} not found")
            continue
        info = identify(runner, root, path)
        info["via"] = via
        if unresolved:
            info["skipped"] = unresolved
        cc = env.get("CC")
        if cc:
            # torch passes CC to nvcc as -ccbin when it is set
            cc_path = _resolve(root, cc, path_var)
            info["nvcc_ccbin"] = identify(runner, root, cc_path) if cc_path else {"path": None, "error": f"CC={cc} not found"}
        return info
    return {"name": None, "version": None, "path": None, "error": "; ".join(unresolved + ["no g++ or clang++ on PATH"])}
