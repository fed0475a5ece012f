"""Plan every target first (all refusals happen here, before any container or compiler starts), then
build them one after another: backend -> inspect every shared object -> label + manifest -> dist/."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console

from cudadoctor.build import plan as P
from cudadoctor.build.manifest import finish_wheel, make_manifest, move_log, source_hash
from cudadoctor.build.progress import BuildProgress, error_excerpt
from cudadoctor.errors import InputError, RefusedError
from cudadoctor.versions import torch_release


@dataclass
class BuildRequest:
    source: str
    specs: list[P.TargetSpec]
    backend: str = "docker"
    pip: P.PipSettings = field(default_factory=P.PipSettings)
    jobs: int | None = None
    out: str = "dist"
    keep_container: bool = False
    compress: bool = True
    work_root: str | None = None
    verbose: bool = False
    force: bool = False
    allow_static_cxx_runtime: bool = False  # let shared objects that define __cxa_throw pass verification


@dataclass
class BuildResult:
    target: str
    wheel: Path
    log: Path
    seconds: float
    size: int
    manifest: dict
    up_to_date: bool = False


def check_source(source: str) -> str:
    p = Path(source)
    if not p.is_dir():
        raise InputError(f"the source {source!r} is not a folder.",
                         hint="Pass the folder of a torch extension project (with setup.py or pyproject.toml).")
    if not (p / "setup.py").is_file() and not (p / "pyproject.toml").is_file():
        raise InputError(f"{source!r} has neither setup.py nor pyproject.toml, so it is not a Python project.",
                         hint="Pass the folder of a torch extension project built with BuildExtension.")
    return str(p.resolve())


def host_resources() -> tuple[int, float | None]:
    from cudadoctor.probes.host import mem_available_gib, usable_cpus

    try:
        meminfo = Path("/proc/meminfo").read_text()
    except OSError:
        meminfo = None
    return usable_cpus(), mem_available_gib(meminfo)


def make_plans(req: BuildRequest, *, facts: dict | None = None, report: dict | None = None) -> list[P.BuildPlan]:
    """Every target's plan; raises before anything runs when one of them is impossible."""
    source = check_source(req.source)
    cores, mem = host_resources()
    default_torch = host_gcc = None
    host_nvcc = None
    if req.backend == "local":
        from cudadoctor.build import local_backend as L

        if report is not None:
            blocking = L.blocking_findings(report)
            if blocking:
                raise L.refuse_findings(blocking)
        if facts is not None:
            installed, host_gcc, host_nvcc = L.facts_summary(facts)
            if installed:
                rel = torch_release(installed)
                default_torch = str(rel) if rel else installed
    from cudadoctor.build.docker_backend import scripts_digest

    digest = scripts_digest()
    plans = []
    for spec in req.specs:
        if req.backend == "local" and default_torch and spec.torch and P._minor(spec.torch) != P._minor(default_torch):
            raise RefusedError(
                f"the local backend builds against the torch installed here ({default_torch}), not torch {spec.torch}.",
                hint=f"Fix: leave out --torch, install torch {spec.torch} first, or use --backend docker.",
            )
        plan = P.make_plan(
            spec, source=source, out=str(Path(req.out).resolve()), backend=req.backend, pip=req.pip, cores=cores,
            mem_gib=mem, jobs=req.jobs, default_torch=default_torch, host_gcc=host_gcc,
            keep_container=req.keep_container, compress=req.compress, script_digest=digest,
        )
        if req.backend == "local" and host_nvcc:
            from cudadoctor import archs as A

            bad = [i for i in plan.target.archs if not A.nvcc_can_target(i.arch, host_nvcc)]
            if bad:
                raise RefusedError(
                    f"this host's nvcc ({host_nvcc}) cannot compile for {', '.join(i.arch.sm for i in bad)}: "
                    + "; ".join(A.describe_nvcc_range(i.arch) for i in bad) + ".",
                    hint="Fix: drop those from --arch, or use --backend docker with a matching CUDA.",
                )
        plans.append(plan)
    names = [p.target.name for p in plans]
    if len(set(names)) != len(names):
        raise InputError("two targets have the same name: " + ", ".join(sorted({n for n in names if names.count(n) > 1}))
                         + ".", hint="Give each [[target]] a distinct name or distinct versions.")
    return plans


def work_dir_for(plan: P.BuildPlan, work_root: str | None) -> Path:
    root = Path(work_root) if work_root else Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "cudadoctor" / "build"
    key = hashlib.sha256(plan.source.encode()).hexdigest()[:10]
    return root / f"{Path(plan.source).name}-{key}" / f"{plan.target.name}-{plan.backend}"


STAMP = "cudadoctor-stamp.json"
_ENV_KEYS = ("CUDA_HOME", "CUDA_PATH", "CPATH", "CC", "CXX", "CUDAHOSTCXX", "CFLAGS", "CXXFLAGS", "LDFLAGS",
             "NVCC_PREPEND_FLAGS")


def _file_id(path: str | None) -> list | None:
    if not path:
        return None
    try:
        real = os.path.realpath(path)
        st = os.stat(real)
        return [real, st.st_size, int(st.st_mtime)]
    except OSError:
        return None


def fingerprint(plan: P.BuildPlan, src_hash: str) -> dict:
    """Everything a wheel depends on: the plan, the source, and (local backend) the toolchain here."""
    d = plan.to_dict()
    # where the wheel goes and how many jobs/threads compile it do not change the wheel
    for key in ("out", "jobs", "nvcc_threads"):
        d.pop(key, None)
    d["env"] = {k: v for k, v in d["env"].items() if k != "MAX_JOBS"}
    strip = lambda flags: [f for f in flags if not f.startswith("--threads")]  # noqa: E731
    if "NVCC_APPEND_FLAGS" in d["env"]:
        d["env"]["NVCC_APPEND_FLAGS"] = " ".join(strip(d["env"]["NVCC_APPEND_FLAGS"].split()))
    d["nvcc_flags"] = strip(d["nvcc_flags"])
    fp = {"plan": d, "source_hash": src_hash}
    if plan.backend == "local":
        from importlib import metadata

        try:
            fp["torch"] = metadata.version("torch")
        except metadata.PackageNotFoundError:
            fp["torch"] = None
        fp["env"] = {k: os.environ.get(k) for k in _ENV_KEYS}
        nvcc = os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc") if os.environ.get("CUDA_HOME") else shutil.which("nvcc")
        fp["nvcc"] = _file_id(nvcc)
        fp["cxx"] = _file_id(shutil.which(os.environ.get("CXX") or "c++"))
    return fp


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def up_to_date(plan: P.BuildPlan, req: BuildRequest) -> BuildResult | None:
    """The wheel of the last build when nothing it depends on changed and it is still in --out."""
    if req.force:
        return None
    stamp = work_dir_for(plan, req.work_root) / STAMP
    try:
        old = json.loads(stamp.read_text())
    except (OSError, ValueError):
        return None
    wheel = Path(plan.out) / str(old.get("wheel", ""))
    if not old.get("wheel") or not wheel.is_file() or _sha256(wheel) != old.get("wheel_sha256"):
        return None
    if old.get("fingerprint") != fingerprint(plan, source_hash(plan.source)):
        return None
    from cudadoctor.build.manifest import read_manifest

    log = wheel.with_name(wheel.name[: -len(".whl")] + ".build.log")
    return BuildResult(plan.target.name, wheel, log, 0.0, wheel.stat().st_size, read_manifest(wheel) or {},
                       up_to_date=True)


def write_stamp(plan: P.BuildPlan, req: BuildRequest, result: BuildResult) -> None:
    work = work_dir_for(plan, req.work_root)
    work.mkdir(parents=True, exist_ok=True)
    fp = fingerprint(plan, str(result.manifest.get("source_hash", "")).removeprefix("sha256:"))
    (work / STAMP).write_text(json.dumps({"wheel": result.wheel.name, "wheel_sha256": _sha256(result.wheel),
                                          "fingerprint": fp}, indent=1, sort_keys=True))


def refuse_unloadable(wheel: Path, check: dict | None) -> None:
    """RefusedError (exit 1) when a shared object of the built wheel did not load next to the torch it
    was built against (build_wheel.py's load check): it would fail the same way at import."""
    errors = (check or {}).get("errors") or []
    if not errors:
        return
    text = "; ".join(f"{e.get('member')}: {e.get('error')}" for e in errors)
    undefined = any("undefined symbol" in str(e.get("error")) for e in errors)
    hint = ("Fix: link the library that defines the symbol (libraries= / extra_link_args in setup.py; "
            "`c++filt` names a C++ symbol), or, for a torch or c10 symbol, build against the torch "
            "the wheel will run with." if undefined else
            "Fix: the library named above must be found at run time: link it with a run path "
            "(-Wl,-rpath,...), or depend on the package that installs it.")
    raise RefusedError(f"the built wheel {Path(wheel).name} does not load in its build environment: {text}.", hint=hint)


def _log_tail(log: Path, lines: int = 400) -> str:
    try:
        return "\n".join(log.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def explain_failure(log_text: str, *, facts: dict | None = None, jobs: int | None = None) -> str | None:
    """The doctor's reading of a failed build's log: the first finding its messages implicate (the
    compiler killed for memory, an old C++ standard, missing Python or CUDA headers, ...), as a hint
    that starts with what to do; None when the log names nothing the doctor knows."""
    from cudadoctor.doctor import diagnose, implicated_ids

    ids = implicated_ids(log_text)
    if not ids:
        return None
    try:
        findings = {f["id"]: f for f in diagnose(facts or {}, error_text=log_text)["findings"]}
    except Exception:  # noqa: BLE001 - the explanation is a bonus; the failure itself is reported either way
        return None
    for fid in ids:
        f = findings.get(fid)
        if f is None:
            continue
        if fid == "BUILD_OUT_OF_MEMORY" and jobs:
            return (f"{f['title'].split(':')[0]} ({fid}): this build ran {jobs} job(s) at once; run it again with "
                    f"--jobs {max(1, jobs // 2)}.")
        fixes = "; ".join((f.get("fix") or [])[:2])
        return f"{f['title']} ({fid}). Fix: {fixes}." if fixes else f"{f['title']} ({fid})."
    return None


def run_plan(plan: P.BuildPlan, req: BuildRequest, console: Console, *, local_env: dict | None = None,
             facts: dict | None = None) -> BuildResult:
    """Build one plan; ``facts``: the host's (local backend), which a failure's explanation reads."""
    from cudadoctor.build.docker_backend import BuildFailed
    from cudadoctor.build.verify import verify

    out = Path(plan.out)
    out.mkdir(parents=True, exist_ok=True)
    log = out / f"{plan.target.name}.build.log"
    log.unlink(missing_ok=True)
    staging = out / f".cudadoctor-staging-{os.getpid()}-{plan.target.name}"
    shutil.rmtree(staging, ignore_errors=True)
    work = work_dir_for(plan, req.work_root)
    t0 = time.monotonic()
    src_hash = source_hash(plan.source)
    try:
        with BuildProgress(console, log, f"cudadoctor build {plan.target.name}", verbose=req.verbose) as prog:
            prog.write("[cudadoctor] plan " + json.dumps(plan.to_dict(), sort_keys=True))
            try:
                if plan.backend == "docker":
                    from cudadoctor.build import docker_backend

                    raw = docker_backend.build(plan, work_dir=work, staging=staging, progress=prog)
                else:
                    from cudadoctor.build import local_backend

                    raw = local_backend.build(plan, work_dir=work, staging=staging, progress=prog,
                                              env=local_env or dict(os.environ))
            except BuildFailed as exc:
                excerpt = error_excerpt(log)
                known = explain_failure(_log_tail(log), facts=facts, jobs=plan.jobs)
                raise RefusedError(
                    f"the build of {plan.target.name} failed (exit status {exc.status}). The compiler said:\n"
                    f"{excerpt}\nThe full log is kept at {log}.",
                    hint=known or ("Fix: correct the error above in the source; when it names a missing header or "
                                   "library, `cudadoctor check` shows what the environment lacks."),
                ) from None
            prog.set_stage("inspecting every shared object")
            info = json.loads((staging / "build-info.json").read_text())
            try:
                archs = verify(raw, plan.target.sass, plan.target.ptx, allow_static_cxx_runtime=req.allow_static_cxx_runtime)
                refuse_unloadable(raw, info.get("load_check"))
            except RefusedError as exc:
                exc.message += f" The build log is kept at {log}."
                raise
            manifest = make_manifest(plan, info, archs, src_hash)
            wheel = finish_wheel(raw, out, plan.label, manifest)
            prog.write(f"[cudadoctor] wheel {wheel}")
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    final_log = move_log(log, wheel)
    result = BuildResult(plan.target.name, wheel, final_log, time.monotonic() - t0, wheel.stat().st_size, manifest)
    write_stamp(plan, req, result)
    return result


def build(req: BuildRequest, console: Console) -> list[BuildResult]:
    facts = report = None
    env = None
    if req.backend == "local" and not req.force:
        # Nothing changed since the last build (source, plan, torch, toolkit files): no compiler runs,
        # so the toolchain checks are skipped too.
        from importlib import metadata

        try:
            light = {"torch": {"version": metadata.version("torch")}}
        except metadata.PackageNotFoundError:
            light = {}
        try:
            quick = [up_to_date(p, req) for p in make_plans(req, facts=light, report=None)]
        except (InputError, RefusedError):
            quick = [None]
        if quick and all(quick):
            for r in quick:
                console.print(f"{r.target}: up to date ({r.wheel.name}); --force rebuilds", highlight=False)
            return quick  # type: ignore[return-value]
    if req.backend == "local":
        from cudadoctor.build import local_backend as L
        from cudadoctor.doctor import diagnose

        console.print("checking the host toolchain (cudadoctor check)...", highlight=False)
        facts = L.host_facts()
        report = diagnose(facts)
    plans = make_plans(req, facts=facts, report=report)
    results = []
    for plan in plans:
        done = up_to_date(plan, req)
        if done is not None:
            console.print(f"{plan.target.name}: up to date ({done.wheel.name}); --force rebuilds", highlight=False)
            results.append(done)
            continue
        if req.backend == "local":
            from cudadoctor.build import local_backend as L

            env, notes = L.local_env(plan, facts or {}, report or {}, dict(os.environ))
            for n in notes:
                console.print(f"  • {n}", highlight=False, soft_wrap=True)  # a path stays one line to copy
        results.append(run_plan(plan, req, console, local_env=env, facts=facts))
    return results
