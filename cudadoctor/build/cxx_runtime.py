"""The C++ runtime of built extensions: link with libstdc++.so, never a private copy.

Before a local build: when the doctor's facts show that the compiler extensions would be linked with
has only libstdc++.a (host_compiler ... links_static_libstdcxx) and another compiler here links
libstdc++.so, CXX and LDSHARED (and CC / CUDAHOSTCXX when they name the same compiler) are pointed at
that one, and the build log says so. HOST_COMPILER_STATIC_LIBSTDCXX then no longer refuses the build.

After any build: a shared object that defines __cxa_throw / __gxx_personality_v0 fails the build
(each TORCH_CHECK failure inside it would kill the process with SIGSEGV instead of raising), unless
``--allow-static-cxx-runtime``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, MutableMapping

from cudadoctor.cxx_runtime import defines_runtime, describe, fix_env, linking_static, shared_alternative
from cudadoctor.errors import RefusedError

FINDING_ID = "HOST_COMPILER_STATIC_LIBSTDCXX"
# the build environment carries the replaced compiler, so the build log can say what changed and why
MARK = "CUDADOCTOR_REPLACED_STATIC_CXX"
_ENV_NAMES = ("CXX", "CC", "CUDAHOSTCXX", "LDSHARED")


def _d(v: Any) -> dict:
    return v if isinstance(v, dict) else {}


def _env_of(facts: dict) -> dict:
    env = _d(_d(facts).get("env"))
    return {k: env[k] for k in ("CXX", "CC", "CUDAHOSTCXX") if isinstance(env.get(k), str)}


def replacement(facts: Any) -> tuple[dict[str, str], str] | None:
    """(variables, why) when the facts show a static-runtime link compiler and a shared-runtime one exists."""
    hc = _d(_d(facts).get("host_compiler"))
    env = _env_of(facts)
    values = fix_env(hc, env)
    if not values:
        return None
    bad = linking_static(hc, env)
    verb = "link" if len(bad) > 1 else "links"
    why = " and ".join(c.path for c in bad) + f" {verb} libstdc++ statically: exceptions thrown in the extension would crash"
    return values, why


def auto_fixed(finding: dict, report: dict) -> bool:
    """Whether the local backend fixes this finding itself instead of refusing the build."""
    return isinstance(finding, dict) and finding.get("id") == FINDING_ID and replacement(_d(report).get("facts")) is not None


def apply(env: MutableMapping[str, str], facts: Any) -> list[str]:
    """Point the build environment at the shared-runtime compiler; the notes say what changed and why."""
    fix = replacement(facts)
    if fix is None:
        return []
    values, why = fix
    for k, v in values.items():
        env[k] = v
    hc = _d(_d(facts).get("host_compiler"))
    env[MARK] = "; ".join(describe(c) for c in linking_static(hc, _env_of(facts)))
    alt = shared_alternative(hc) or {}
    notes = [f"CXX={values['CXX']} ({why}; {values['CXX']} links {alt.get('shared_libstdcxx') or 'libstdc++.so'})"]
    notes += [f'{k}="{v}"' if " " in v else f"{k}={v}" for k, v in values.items() if k != "CXX"]
    return notes


def log_lines(env: dict) -> list[str]:
    """Build-log lines for a compiler replaced by :func:`apply` (none when nothing was replaced)."""
    replaced = env.get(MARK)
    if not replaced:
        return []
    first = replaced.split(" ", 1)[0]
    lines = [f"[cudadoctor] CXX={env.get('CXX')} ({first} links libstdc++ statically: exceptions thrown in the "
             "extension would crash)"]
    lines += [f"[cudadoctor] {k}={env[k]}" for k in _ENV_NAMES if k != "CXX" and env.get(k)]
    lines.append(f"[cudadoctor] replaced: {replaced}")
    return lines


# --- after the build --------------------------------------------------------------------------


def static_runtime_objects(wheel: str | Path) -> dict[str, list[str]]:
    """{member: runtime symbols it defines} for the shared objects of a wheel (or file / folder)."""
    from cudadoctor.inspect import inspect_path

    out: dict[str, list[str]] = {}
    for e in inspect_path(str(wheel)):
        syms = defines_runtime(e)
        if syms:
            out[str(e.get("path", "")).split("!", 1)[-1]] = syms
    return out


def check(wheel: str | Path, *, allow: bool = False) -> dict[str, list[str]]:
    """Raise RefusedError (exit 1) when a shared object carries its own C++ runtime, unless ``allow``."""
    found = static_runtime_objects(wheel)
    if not found or allow:
        return found
    text = "; ".join(f"{m} defines {', '.join(s)}" for m, s in sorted(found.items()))
    raise RefusedError(
        f"the built wheel {Path(wheel).name} carries its own C++ runtime: {text}. It was linked against "
        "libstdc++.a, so an exception thrown inside it (every TORCH_CHECK failure) would kill Python with "
        "SIGSEGV instead of raising RuntimeError.",
        hint="Fix: build with a compiler that links libstdc++.so, e.g. "
        'export CXX=/usr/bin/g++ LDSHARED="/usr/bin/g++ -shared" (`cudadoctor env` prints the exports for this '
        "machine), and drop -static-libstdc++ from LDFLAGS / extra_link_args; or pass --allow-static-cxx-runtime "
        "when the library is meant to be self-contained.",
    )
