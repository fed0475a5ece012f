"""After a build, every shared object is inspected; a missing requested SASS (or PTX asked for with
+PTX) fails the build."""

from __future__ import annotations

from pathlib import Path

from cudadoctor.errors import RefusedError


def shared_object_archs(wheel: str | Path) -> dict[str, dict]:
    """{member path: {"sass": [...], "ptx": [...]}} for every shared object in the wheel."""
    from cudadoctor.inspect import inspect_path

    out: dict[str, dict] = {}
    for e in inspect_path(str(wheel)):
        member = str(e.get("path", "")).split("!", 1)[-1]
        if e.get("error"):
            out[member] = {"sass": [], "ptx": [], "error": e["error"]}
        else:
            out[member] = {"sass": list(e.get("sass") or []), "ptx": list(e.get("ptx") or [])}
    return out


def _arch_specific(got: dict) -> bool:
    """A shared object whose device code is all arch-specific SASS (sm_90a, sm_100a: code that uses
    instructions of one compute capability only, such as Hopper's wgmma) and no PTX: an add-on
    for those GPUs beside the project's portable module, not a build of every requested arch."""
    s = got.get("sass") or []
    return bool(s) and not got.get("ptx") and all(a.endswith("a") for a in s)


def missing(so_archs: dict[str, dict], sass: list[str], ptx: list[str]) -> dict[str, list[str]]:
    """Per shared object, the requested targets it lacks (a non-CUDA .so with no device code at all
    is not counted: pure host helpers are allowed). An arch-specific module (see _arch_specific)
    lacks nothing when each of its targets is the arch-specific form of a requested SASS (sm_90a
    for sm_90); one built for an arch not requested is reported."""
    gaps: dict[str, list[str]] = {}
    cuda_sos = {k: v for k, v in so_archs.items() if v.get("sass") or v.get("ptx") or v.get("error")}
    for member, got in cuda_sos.items():
        if not got.get("error") and _arch_specific(got):
            stray = [a for a in got["sass"] if a[:-1] not in sass]
            if stray:
                gaps[member] = [f"arch-specific {a} for an arch not requested" for a in stray]
            continue
        lack = [s for s in sass if s not in got.get("sass", [])] + [p for p in ptx if p not in got.get("ptx", [])]
        if got.get("error"):
            lack.append(f"unreadable: {got['error']}")
        if lack:
            gaps[member] = lack
    return gaps


def verify(wheel: str | Path, sass: list[str], ptx: list[str], *, allow_static_cxx_runtime: bool = False) -> dict[str, dict]:
    """Inspect the wheel; raise RefusedError (exit 1) naming each shared object and what it lacks, or
    that it carries its own C++ runtime (build/cxx_runtime.py) unless ``allow_static_cxx_runtime``."""
    archs = shared_object_archs(wheel)
    if not any(v.get("sass") or v.get("ptx") for v in archs.values()):
        raise RefusedError(
            f"the built wheel {Path(wheel).name} holds no CUDA device code in any shared object "
            f"({len(archs)} shared object(s) inspected).",
            hint="Fix: check that the project builds its extensions with CUDAExtension and that "
            "TORCH_CUDA_ARCH_LIST reaches it (see the build log).",
        )
    gaps = missing(archs, sass, ptx)
    if gaps:
        text = "; ".join(f"{m} lacks {', '.join(v)}" for m, v in sorted(gaps.items()))
        raise RefusedError(
            f"the built wheel {Path(wheel).name} is missing requested device code: {text}.",
            hint="Fix: the project may set its own -gencode flags or arch list (look for "
            "TORCH_CUDA_ARCH_LIST or -gencode in its setup.py); let TORCH_CUDA_ARCH_LIST decide.",
        )
    from cudadoctor.build.cxx_runtime import check

    check(wheel, allow=allow_static_cxx_runtime)
    return archs
