"""Which C++ runtime extensions get linked with, read from the facts (pure: no processes, no files).

A g++ whose library path holds only libstdc++.a (``-print-file-name=libstdc++.so`` prints the bare
name back) links a private copy of the C++ runtime into every shared object it builds. An exception
thrown inside such a torch extension (every TORCH_CHECK failure) is thrown by that copy and never
recognised by torch's catch sites, which use the process's libstdc++.so.6: the process dies with
SIGSEGV instead of raising RuntimeError.

The probe (probes/compiler.py) records, on ``host_compiler``, ``link_compiler`` and ``nvcc_ccbin``:
shared_libstdcxx, static_libstdcxx, links_static_libstdcxx, wrapper_of; and ``candidates``: other
compilers, best replacement first. The rules, ``cudadoctor env`` and the local build all read those
through the functions here, so they name the same compiler.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

# entry points a shared object should import from libstdc++.so.6 / libgcc_s.so.1, never define
RUNTIME_SYMBOLS = ("__cxa_throw", "__gxx_personality_v0", "__cxa_begin_catch")
# defining either of these means the object throws (or unwinds) with its own runtime copy
CRASH_SYMBOLS = ("__cxa_throw", "__gxx_personality_v0")


@dataclass(frozen=True)
class StaticCompiler:
    path: str
    roles: tuple[str, ...]  # "CXX", "CUDAHOSTCXX", "CC", "g++ on PATH"
    facts_paths: tuple[str, ...]  # "host_compiler", "host_compiler.link_compiler", "host_compiler.nvcc_ccbin"
    static_lib: str | None
    wrapper_of: str | None
    links: bool  # whether setuptools links extensions with it (CXX / the default g++, or CC through LDSHARED)


def _d(v: Any) -> dict:
    return v if isinstance(v, dict) else {}


def _s(v: Any) -> str | None:
    return v if isinstance(v, str) and v else None


def _role(via: Any) -> str:
    return {"CUDAHOSTCXX": "CUDAHOSTCXX", "CXX": "CXX", "PATH": "g++ on PATH"}.get(str(via), "the host compiler")


def static_compilers(host_compiler: Any, env: Mapping[str, Any] | None = None) -> list[StaticCompiler]:
    """The compilers of a host_compiler section that link libstdc++ statically, one per path, with every
    role it plays (the probe's entries, plus CXX/CC/CUDAHOSTCXX of ``env`` spelled as that path)."""
    hc = _d(host_compiler)
    env = env if isinstance(env, Mapping) else {}
    link = _d(hc.get("link_compiler"))
    entries = [("host_compiler", hc, _role(hc.get("via")))]
    if link:
        entries.append(("host_compiler.link_compiler", link, _role(link.get("via"))))
    if _d(hc.get("nvcc_ccbin")):
        entries.append(("host_compiler.nvcc_ccbin", _d(hc.get("nvcc_ccbin")), "CC"))
    groups: dict[str, dict] = {}
    for where, e, role in entries:
        path = _s(e.get("path"))
        if not path or e.get("links_static_libstdcxx") is not True:
            continue
        g = groups.setdefault(path, {"roles": [], "where": [], "lib": _s(e.get("static_libstdcxx")),
                                     "wrapper": _s(e.get("wrapper_of")), "links": False})
        g["roles"].append(role)
        g["where"].append(where)
        # setuptools links C++ extensions with CXX (the host compiler, unless CUDAHOSTCXX chose it and
        # CXX is recorded apart as link_compiler) and other languages with LDSHARED = CC -shared
        if not (where == "host_compiler" and role == "CUDAHOSTCXX" and link):
            g["links"] = True
    for path, g in groups.items():
        for var in ("CXX", "CUDAHOSTCXX", "CC"):
            if env.get(var) == path and var not in g["roles"]:
                g["roles"].append(var)
                g["links"] = g["links"] or var != "CUDAHOSTCXX"
    order = {"CXX": 0, "g++ on PATH": 1, "CC": 2, "CUDAHOSTCXX": 3}
    return [StaticCompiler(path, tuple(sorted(g["roles"], key=lambda r: order.get(r, 9))), tuple(g["where"]),
                           g["lib"], g["wrapper"], g["links"]) for path, g in groups.items()]


def linking_static(host_compiler: Any, env: Mapping[str, Any] | None = None) -> list[StaticCompiler]:
    """Static-runtime compilers that extension links would actually use."""
    return [c for c in static_compilers(host_compiler, env) if c.links]


def shared_alternative(host_compiler: Any) -> dict | None:
    """The best recorded compiler that links libstdc++.so (the probe ranks ``candidates``)."""
    for c in _d(host_compiler).get("candidates") or []:
        if isinstance(c, dict) and _s(c.get("path")) and c.get("links_static_libstdcxx") is False:
            return c
    return None


def fix_env(host_compiler: Any, env: Mapping[str, Any] | None = None) -> dict[str, str]:
    """The variables that make extension builds link the shared libstdc++: CXX and LDSHARED, and CC /
    CUDAHOSTCXX when they name a static-runtime compiler. Empty when no link uses a static-runtime
    compiler or no replacement was found."""
    alt = shared_alternative(host_compiler)
    if not linking_static(host_compiler, env) or alt is None:
        return {}
    cxx = str(alt["path"])
    out = {"CXX": cxx, "LDSHARED": f"{cxx} -shared"}
    roles = {r for c in static_compilers(host_compiler, env) for r in c.roles}
    if "CC" in roles:
        out["CC"] = _s(alt.get("cc")) or cxx
    if "CUDAHOSTCXX" in roles:
        out["CUDAHOSTCXX"] = cxx
    return out


def describe(c: StaticCompiler) -> str:
    """'/opt/gcc/bin/g++ (CXX, CC, CUDAHOSTCXX; a wrapper of /opt/gcc/bin/g++-real)'."""
    inner = ", ".join(c.roles) + (f"; a wrapper of {c.wrapper_of}" if c.wrapper_of else "")
    return f"{c.path} ({inner})"


def shell_exports(values: Mapping[str, str]) -> str:
    """``export CXX=/usr/bin/g++ LDSHARED="/usr/bin/g++ -shared"`` (values quoted when they need it)."""
    parts = []
    for k, v in values.items():
        parts.append(f'{k}="{v}"' if any(ch in v for ch in " \t'\"$") else f"{k}={v}")
    return "export " + " ".join(parts)


def defines_runtime(entry: Any) -> list[str]:
    """RUNTIME_SYMBOLS an inspected extensions[] entry defines, when it defines one of CRASH_SYMBOLS."""
    got = _d(entry).get("cxx_runtime_defined")
    if not isinstance(got, list) or not any(s in got for s in CRASH_SYMBOLS):
        return []
    return [s for s in RUNTIME_SYMBOLS if s in got]
