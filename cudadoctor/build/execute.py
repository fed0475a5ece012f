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
from cudadoctor.build.manifest import finish_wheel, make_manifest, move_log
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


@dataclass
class BuildResult:
    target: str
    wheel: Path
    log: Path
    seconds: float
    size: int
    manifest: dict


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
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    mem = None
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    mem = int(line.split()[1]) / (1024 * 1024)
    except OSError:
        pass
    return cores, mem


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


def run_plan(plan: P.BuildPlan, req: BuildRequest, console: Console, *, local_env: dict | None = None) -> BuildResult:
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
                raise RefusedError(
                    f"the build of {plan.target.name} failed (exit status {exc.status}). The compiler said:\n"
                    f"{excerpt}\nThe full log is kept at {log}.",
                    hint="Fix: correct the error above in the source; when it names a missing header or "
                    "library, `cudadoctor check` shows what the environment lacks.",
                ) from None
            prog.set_stage("inspecting every shared object")
            try:
                archs = verify(raw, plan.target.sass, plan.target.ptx)
            except RefusedError as exc:
                exc.message += f" The build log is kept at {log}."
                raise
            info = json.loads((staging / "build-info.json").read_text())
            src_hash = P.source_hash(plan.source)
            manifest = make_manifest(plan, info, archs, src_hash)
            wheel = finish_wheel(raw, out, plan.label, manifest)
            prog.write(f"[cudadoctor] wheel {wheel}")
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    final_log = move_log(log, wheel)
    return BuildResult(plan.target.name, wheel, final_log, time.monotonic() - t0, wheel.stat().st_size, manifest)


def build(req: BuildRequest, console: Console) -> list[BuildResult]:
    facts = report = None
    env = None
    if req.backend == "local":
        from cudadoctor.build import local_backend as L
        from cudadoctor.doctor import diagnose

        console.print("checking the host toolchain (cudadoctor check)...", highlight=False)
        facts = L.host_facts()
        report = diagnose(facts)
    plans = make_plans(req, facts=facts, report=report)
    results = []
    for plan in plans:
        if req.backend == "local":
            from cudadoctor.build import local_backend as L

            env, notes = L.local_env(plan, facts or {}, report or {}, dict(os.environ))
            for n in notes:
                console.print(f"  • {n}", highlight=False)
        results.append(run_plan(plan, req, console, local_env=env))
    return results
