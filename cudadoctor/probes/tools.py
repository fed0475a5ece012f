"""Versions of helper tools: ninja, compute-sanitizer, docker (None when absent)."""

from __future__ import annotations

import os
import re
from typing import Mapping, Sequence

from cudadoctor.runner import Runner

from ._fs import Root


def _version(runner: Runner, root: Root, path: str | None, args: Sequence[str], pattern: str) -> str | None:
    if not path:
        return None
    res = runner.run([root.host(path), *args], timeout=5)
    text = (res.stdout or "") + "\n" + (res.stderr or "")
    m = re.search(pattern, text)
    return m.group(1) if m else None


def probe_tools(runner: Runner, root: Root, env: Mapping[str, str], toolkit_roots: Sequence[str] = ()) -> dict:
    path_var = env.get("PATH")
    ninja = root.which("ninja", path_var)
    sanitizer = root.which("compute-sanitizer", path_var)
    if sanitizer is None:
        # a toolkit's bin/ is often not on PATH: look where the toolkit probe looks first
        roots = list(toolkit_roots) + [env.get("CUDA_HOME") or "", env.get("CUDA_PATH") or "", "/usr/local/cuda"]
        roots += sorted(root.glob("/usr/local/cuda-*"), reverse=True)
        for tk in [r for r in roots if r.startswith("/")]:
            for cand in (os.path.join(tk, "bin", "compute-sanitizer"), os.path.join(tk, "compute-sanitizer", "compute-sanitizer")):
                if root.is_executable(cand):
                    sanitizer = cand
                    break
            if sanitizer:
                break
    docker = root.which("docker", path_var)
    return {
        "ninja": _version(runner, root, ninja, ["--version"], r"(\d+\.\d+(?:\.\d+)?(?:\.\S+)?)"),
        "compute_sanitizer": _version(runner, root, sanitizer, ["--version"], r"Version\s+(\d[\w.]*)"),
        "docker": _version(runner, root, docker, ["--version"], r"version\s+(\d[\w.\-+~]*?)(?:,|\s|$)"),
        "paths": {"ninja": ninja, "compute_sanitizer": sanitizer, "docker": docker},
    }
