"""Host C++ compiler: CUDAHOSTCXX, then CXX, then g++, then clang++; name, version, path, and which
C++ runtime it links into shared objects.

Runtime fields (on ``host_compiler``, on ``link_compiler`` and on ``nvcc_ccbin``):
  shared_libstdcxx        ``<cxx> -print-file-name=libstdc++.so``; null when the compiler prints the
                          bare name back (it has no shared libstdc++ on its library path)
  static_libstdcxx        the same for libstdc++.a
  links_static_libstdcxx  true when only libstdc++.a is found: every shared object it links (torch
                          extensions included) then carries a private copy of the C++ runtime
                          (__cxa_throw, __gxx_personality_v0); null when the compiler did not say
  wrapper_of              the program a small ``#!`` wrapper script execs, when it is one
``link_compiler``: CXX when CUDAHOSTCXX picked another compiler (setuptools links C++ extensions
with CXX). ``candidates``: only when some compiler links libstdc++ statically, the other g++ /
clang++ found on PATH, /usr/bin and /usr/local/bin with the same runtime fields, best replacement
first (a shared libstdc++, the same major version, the same family).
"""

from __future__ import annotations

import os
import re
import shlex
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Mapping

from cudadoctor.runner import Runner

from ._fs import Root, split_path, unique

RUNTIME_TIMEOUT = 5.0
CANDIDATE_TIMEOUT = 3.0
MAX_CANDIDATES = 8
_WRAPPER_HEAD = 8192
_CANDIDATE_NAME = re.compile(r"^(?:[\w.-]+-)?(?:g\+\+|c\+\+|clang\+\+)(?:-\d+(?:\.\d+)*)?$")


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


# --- C++ runtime ------------------------------------------------------------------------------


def wrapper_of(root: Root, path: str) -> str | None:
    """The program a small ``#!`` script execs (``exec /opt/gcc/bin/g++-real -B... "$@"``)."""
    host = root.host(path)
    try:
        with open(host, "rb") as fh:
            head = fh.read(_WRAPPER_HEAD + 1)
    except (OSError, ValueError):
        return None
    if not head.startswith(b"#!") or len(head) > _WRAPPER_HEAD:
        return None
    for line in head.decode("utf-8", "replace").splitlines():
        line = line.strip()
        if not line.startswith("exec ") and not line.startswith("exec\t"):
            continue
        try:
            words = shlex.split(line)[1:]
        except ValueError:
            words = line.split()[1:]
        skip = False
        for w in words:
            if skip:
                skip = False
                continue
            if w.startswith("-"):
                skip = w == "-a"  # `exec -a NAME prog`
                continue
            if "=" in w and not w.startswith("/"):
                continue  # `exec VAR=value prog`
            return None if "$" in w else w
        return None
    return None


def _print_file_name(runner: Runner, exe: str, lib: str, timeout: float) -> tuple[str | None, str | None]:
    """(path, error): the compiler's answer to -print-file-name=LIB; path None when it printed the
    bare name back (not on its library path) or failed."""
    res = runner.run([exe, f"-print-file-name={lib}"], timeout=timeout)
    if not res.ok:
        return None, (res.error or f"exited {res.returncode}").replace(f"{exe}: ", "", 1)
    lines = [ln.strip() for ln in (res.stdout or "").splitlines() if ln.strip()]
    text = lines[-1] if lines else ""
    if not text:
        return None, "printed nothing"
    if "/" not in text:  # the bare name: not found
        return None, None
    return text, None


_GLIBCXX = re.compile(rb"GLIBCXX_3\.4\.(\d+)")


def glibcxx_max(path: str | None, max_bytes: int = 16 << 20) -> str | None:
    """The newest GLIBCXX_3.4.N symbol version a libstdc++.so.6 defines ("3.4.32"), read from its
    version strings; None for no file, a linker script or a file without them."""
    if not path:
        return None
    try:
        with open(path, "rb") as fh:
            data = fh.read(max_bytes)
    except OSError:
        return None
    found = [int(m.group(1)) for m in _GLIBCXX.finditer(data)]
    return f"3.4.{max(found)}" if found else None


def runtime_facts(runner: Runner, root: Root, path: str, *, timeout: float = RUNTIME_TIMEOUT,
                  map_fn: Callable | None = None) -> dict:
    """shared_libstdcxx, static_libstdcxx, links_static_libstdcxx and wrapper_of of one compiler.
    The two compiler calls run concurrently (``map_fn``, default: a two-thread pool)."""
    exe = root.host(path)
    libs = ("libstdc++.so", "libstdc++.a")

    def ask(lib):
        return _print_file_name(runner, exe, lib, timeout)

    if map_fn is None:
        with ThreadPoolExecutor(max_workers=2, thread_name_prefix="cudadoctor-cxxrt") as pool:
            (shared, err_s), (static, err_a) = list(pool.map(ask, libs))
    else:
        (shared, err_s), (static, err_a) = list(map_fn(ask, libs))
    out: dict = {"shared_libstdcxx": shared, "static_libstdcxx": static,
                 "links_static_libstdcxx": None, "wrapper_of": wrapper_of(root, path),
                 "shared_libstdcxx_glibcxx": glibcxx_max(root.host(shared)) if shared else None}
    if shared is not None:
        out["links_static_libstdcxx"] = False
    elif static is not None and err_s is None:
        out["links_static_libstdcxx"] = True
    errs = [f"libstdc++.so: {err_s}" if err_s else "", f"libstdc++.a: {err_a}" if err_a else ""]
    if any(errs):
        out["runtime_error"] = "; ".join(e for e in errs if e)
    return out


def _cxx_family(entry: dict) -> str | None:
    name = str(entry.get("name") or "").lower()
    if name in ("gcc", "clang"):
        return name
    base = os.path.basename(str(entry.get("path") or ""))
    if "clang" in base:
        return "clang"
    if "g++" in base or "c++" in base:
        return "gcc"
    return None


def c_sibling(root: Root, path: str) -> str | None:
    """The C driver next to a C++ one: g++-13 -> gcc-13, c++ -> cc, clang++ -> clang."""
    d, base = os.path.split(path)
    for cxx, c in (("clang++", "clang"), ("g++", "gcc"), ("c++", "cc")):
        if cxx in base:
            cand = os.path.join(d, base.replace(cxx, c, 1))
            return cand if root.is_executable(cand) else None
    return None


def _major(v) -> int | None:
    m = re.match(r"(\d+)", str(v or ""))
    return int(m.group(1)) if m else None


def find_candidates(root: Root, env: Mapping[str, str], exclude: list[str]) -> list[str]:
    """Other C++ compilers on PATH, /usr/bin and /usr/local/bin (g++, g++-N, c++, clang++[-N])."""
    dirs = unique([d for d in split_path(env.get("PATH")) if d.startswith("/")] + ["/usr/bin", "/usr/local/bin"])
    seen_real = {root.realpath(p) for p in exclude}
    out: list[str] = []
    for d in dirs:
        for name in root.listdir(d):
            if not _CANDIDATE_NAME.match(name):
                continue
            p = os.path.join(d, name)
            real = root.realpath(p)
            if real in seen_real or not root.is_executable(p):
                continue
            seen_real.add(real)
            out.append(p)
            if len(out) >= MAX_CANDIDATES:
                return out
    return out


def _rank_candidates(cands: list[dict], want_family: str | None, want_major: int | None) -> list[dict]:
    def key(c):
        shared = c.get("links_static_libstdcxx") is False
        fam = _cxx_family(c)
        major = _major(c.get("version"))
        return (not shared, want_major is None or major != want_major, fam != want_family,
                -(major or 0), c.get("path") or "")

    return sorted(cands, key=key)


def _static(entry) -> bool:
    return isinstance(entry, dict) and entry.get("links_static_libstdcxx") is True


def probe_host_compiler(runner: Runner, root: Root, env: Mapping[str, str]) -> dict | None:
    path_var = env.get("PATH")
    candidates: list[tuple[str, str]] = []
    for var in ("CUDAHOSTCXX", "CXX"):
        if env.get(var):
            candidates.append((env[var], var))
    candidates += [("g++", "PATH"), ("clang++", "PATH")]
    unresolved: list[str] = []
    chosen: tuple[str, str] | None = None
    for value, via in candidates:
        path = _resolve(root, value, path_var)
        if path is None:
            if via != "PATH":
                unresolved.append(f"{via}={value} not found")
            continue
        chosen = (path, via)
        break
    if chosen is None:
        return {"name": None, "version": None, "path": None,
                "error": "; ".join(unresolved + ["no g++ or clang++ on PATH"])}
    path, via = chosen
    # the compiler setuptools links C++ extensions with: CXX, else g++ on PATH
    link_path = None
    if via == "CUDAHOSTCXX":
        link_path = _resolve(root, env["CXX"], path_var) if env.get("CXX") else root.which("g++", path_var)
        if link_path == path:
            link_path = None
    cc = env.get("CC")
    cc_path = _resolve(root, cc, path_var) if cc else None  # torch passes CC to nvcc as -ccbin

    with ThreadPoolExecutor(max_workers=MAX_CANDIDATES, thread_name_prefix="cudadoctor-cxx") as pool:
        # every compiler call runs concurrently: identify (two calls in turn) beside runtime_facts (two
        # calls at once, in its own pool), for each compiler that matters
        jobs = {"host": (pool.submit(identify, runner, root, path), pool.submit(runtime_facts, runner, root, path))}
        if link_path:
            jobs["link"] = (pool.submit(identify, runner, root, link_path),
                            pool.submit(runtime_facts, runner, root, link_path))
        if cc_path:
            jobs["cc"] = (pool.submit(identify, runner, root, cc_path), pool.submit(runtime_facts, runner, root, cc_path))
        done = {k: {**a.result(), **b.result()} for k, (a, b) in jobs.items()}

        info = done["host"]
        info["via"] = via
        if unresolved:
            info["skipped"] = unresolved
        if "link" in done:
            info["link_compiler"] = dict(done["link"], via="CXX" if env.get("CXX") else "PATH")
        if cc:
            info["nvcc_ccbin"] = done.get("cc") or {"path": None, "error": f"CC={cc} not found"}

        static = [e for e in (info, info.get("link_compiler"), info.get("nvcc_ccbin")) if _static(e)]
        if static:
            # a wrapper's target stays a candidate: called directly it may well find libstdc++.so
            exclude = [e["path"] for e in static]

            def one(p):
                e = {**identify(runner, root, p, timeout=CANDIDATE_TIMEOUT),
                     **runtime_facts(runner, root, p, timeout=CANDIDATE_TIMEOUT)}
                if e.get("name") is None:
                    return None
                e["cc"] = c_sibling(root, p)
                return e

            probed = [e for e in pool.map(one, find_candidates(root, env, exclude)) if e is not None]
            ranked = _rank_candidates(probed, _cxx_family(static[0]), _major(static[0].get("version")))
            info["candidates"] = ranked
    return info
