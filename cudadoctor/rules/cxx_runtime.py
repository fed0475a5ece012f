"""C++ runtime rules: extensions must use the process's libstdc++.so.6, not a private copy.

HOST_COMPILER_STATIC_LIBSTDCXX: the compiler extensions would be linked with has only libstdc++.a
(host_compiler[.link_compiler|.nvcc_ccbin].links_static_libstdcxx). EXT_STATIC_CXX_RUNTIME: an
inspected extension defines __cxa_throw / __gxx_personality_v0 (extensions[].cxx_runtime_defined).
Pure: reads facts only.
"""

from __future__ import annotations

from cudadoctor.cxx_runtime import (
    defines_runtime,
    describe,
    fix_env,
    linking_static,
    shared_alternative,
    shell_exports,
)
from cudadoctor.findings import Finding
from cudadoctor.rules import Facts, rule

REBUILD = "pip install --no-build-isolation --no-deps --force-reinstall --no-cache-dir <the extension's source or sdist>"
CRASH = ("Every shared object it links (torch extensions included) gets a private copy of the C++ runtime "
         "(__cxa_throw, __gxx_personality_v0), so an exception thrown inside an extension (every TORCH_CHECK "
         "failure) is never caught by torch, which uses the process's libstdc++.so.6: Python dies with SIGSEGV "
         "instead of raising RuntimeError.")


def _env(f: Facts) -> dict:
    return {k: f.env(k) for k in ("CXX", "CC", "CUDAHOSTCXX") if f.env(k)}


def _fix_lines(values: dict[str, str]) -> list[str]:
    lines = [f"export CXX={values['CXX']}   # links libstdc++.so",
             f"export LDSHARED=\"{values['LDSHARED']}\"   # setuptools links extensions with LDSHARED when set"]
    rest = {k: v for k, v in values.items() if k not in ("CXX", "LDSHARED")}
    if rest:
        lines.append(shell_exports(rest) + "   # these named the static-runtime compiler too")
    return lines


@rule("HOST_COMPILER_STATIC_LIBSTDCXX", severity="error", area="compiler", priority=37,
      summary="the compiler extensions would be linked with has only libstdc++.a (no shared libstdc++)")
def host_compiler_static_libstdcxx(f: Facts):
    hc = f.section("host_compiler")
    env = _env(f)
    bad = linking_static(hc, env)
    if not bad:
        return None
    first = bad[0]
    alt = shared_alternative(hc)
    values = fix_env(hc, env)
    who = "; ".join(describe(c) for c in bad)
    static = first.static_lib or "libstdc++.a"
    detail = (f"{who}: `-print-file-name=libstdc++.so` prints the bare name back (no shared libstdc++ on its "
              f"library path) while `-print-file-name=libstdc++.a` finds {static}. {CRASH}")
    if alt is not None:
        detail += (f" {alt['path']} ({' '.join(str(x) for x in (alt.get('name'), alt.get('version')) if x)}) "
                   f"links {alt.get('shared_libstdcxx') or 'libstdc++.so'}.")
        fix = _fix_lines(values) + [f"then rebuild the extension: {REBUILD}"]
    else:
        fix = ["sudo apt-get install -y g++   # a g++ whose library folder has libstdc++.so",
               'export CXX=/usr/bin/g++ LDSHARED="/usr/bin/g++ -shared"',
               f"then rebuild the extension: {REBUILD}"]
    refs = []
    for c in bad:
        for where in c.facts_paths:
            refs += [f"{where}.links_static_libstdcxx", f"{where}.static_libstdcxx"]
    if alt is not None:
        refs.append("host_compiler.candidates")
    return Finding(
        id="HOST_COMPILER_STATIC_LIBSTDCXX", severity="error",
        title=f"{first.path} links libstdc++ statically: exceptions in extensions it builds crash the process",
        detail=detail, fix=fix, facts=refs, area="compiler")


@rule("EXT_STATIC_CXX_RUNTIME", severity="error", area="extensions", priority=57,
      summary="an inspected extension defines __cxa_throw / __gxx_personality_v0 (its own C++ runtime)")
def ext_static_cxx_runtime(f: Facts):
    hc = f.section("host_compiler")
    env = _env(f)
    values = fix_env(hc, env)
    here = hc if hc.get("links_static_libstdcxx") is False and isinstance(hc.get("path"), str) else None
    out = []
    for n, e in enumerate(f.list("extensions")):
        if not isinstance(e, dict) or not isinstance(e.get("path"), str) or e.get("error"):
            continue
        syms = defines_runtime(e)
        if not syms:
            continue
        needed = e.get("needed") if isinstance(e.get("needed"), list) else None
        linked = ""
        if needed is not None:
            linked = (" and does not link libstdc++.so.6" if not any(str(x).startswith("libstdc++.so") for x in needed)
                      else " although it also links libstdc++.so.6")
        name = e["path"].split("!")[-1].rsplit("/", 1)[-1] or e["path"]
        if values:
            rebuild = [shell_exports(values) + f"; {REBUILD}"]
        elif here is not None and not linking_static(hc, env):
            rebuild = [f'export CXX={here["path"]} LDSHARED="{here["path"]} -shared"; {REBUILD}']
        else:
            rebuild = [f'export CXX=/usr/bin/g++ LDSHARED="/usr/bin/g++ -shared"; {REBUILD}   '
                       "(any g++ whose -print-file-name=libstdc++.so prints a path)"]
        out.append(Finding(
            id="EXT_STATIC_CXX_RUNTIME", severity="error",
            title=f"{name} carries its own C++ runtime: an error raised inside it crashes Python",
            detail=(f"{e['path']} defines {', '.join(syms)} itself{linked}: it was linked against libstdc++.a "
                    "(a compiler without the shared libstdc++, or -static-libstdc++). Exceptions raised inside it "
                    "(every TORCH_CHECK failure) are thrown with that private runtime, which torch's catch sites do "
                    "not recognise: the process dies with SIGSEGV instead of raising RuntimeError."),
            fix=["rebuild it with a compiler that links libstdc++.so, without -static-libstdc++ in LDFLAGS or "
                 "extra_link_args: " + rebuild[0]],
            facts=[f"extensions[{n}].cxx_runtime_defined"] + ([f"extensions[{n}].needed"] if needed is not None else []),
            area="extensions"))
    return out
