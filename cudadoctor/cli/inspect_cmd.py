"""`cudadoctor inspect PATH...`: which GPUs can run the CUDA code in files, wheels and folders."""

from __future__ import annotations

import json
from typing import List, Optional

import typer

from cudadoctor.cli import app


def _size(n: int | None) -> str:
    if n is None:
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _targets(gpu: list[str] | None, target: str | None) -> list[str] | None:
    from cudadoctor.archs import Arch, parse_spec
    from cudadoctor.errors import InputError

    ccs: list[str] = []
    for g in gpu or []:
        for part in g.replace(";", ",").split(","):
            if not part.strip():
                continue
            a = Arch.parse(part)
            if a is None:
                raise InputError(f"--gpu {part!r} is not a compute capability.", hint="Write it like 8.9 or 89.")
            ccs.append(a.base.cc)
    if target:
        ccs.extend(i.arch.base.cc for i in parse_spec(target))
    if gpu is None and target is None:
        return None
    return list(dict.fromkeys(ccs))


@app.command("inspect")
def inspect_command(
    paths: List[str] = typer.Argument(..., help=".so, .o, .cubin, .fatbin, .whl files or folders."),
    gpu: Optional[List[str]] = typer.Option(None, "--gpu", help="Judge for this compute capability (repeatable, e.g. 8.9)."),
    target: Optional[str] = typer.Option(None, "--target", help="Judge for these archs, an arch spec like 8.6,8.9."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON: {files, verdicts}."),
) -> None:
    """List SASS/PTX targets of CUDA binaries and say which GPUs can run them.

    Exit 0: every judged GPU can run every file; 1: some cannot; 2: a file could not be read.
    """
    from cudadoctor.archplan import driver_cuda_of, present_gpus
    from cudadoctor.binary import BinaryFormatError
    from cudadoctor.errors import EXIT_FINDING, EXIT_USAGE
    from cudadoctor.inspect import inspect_path, verdicts
    from cudadoctor.runner import Runner

    ccs = _targets(gpu, target)
    driver_cuda = None
    gpu_names: dict[str, str] = {}
    if ccs is None:
        found, driver, _err = present_gpus(Runner())
        ccs = list(dict.fromkeys(g["cc"] for g in found if g.get("cc")))
        gpu_names = {g["cc"]: g["name"] for g in found if g.get("cc")}
        driver_cuda = driver_cuda_of(driver)
    files: list[dict] = []
    errors: list[str] = []
    for p in paths:
        try:
            files.extend(inspect_path(p))
        except BinaryFormatError as exc:
            errors.append(str(exc))
            files.append({"path": p, "error": str(exc)})
    errors.extend(f["error"] for f in files if f.get("error") and f["error"] not in errors)
    vs = verdicts(files, ccs, driver_cuda=driver_cuda)
    if as_json:
        typer.echo(json.dumps({"files": files, "verdicts": vs, "gpus": ccs}, indent=2))
    else:
        _print_human(files, vs, ccs, gpu_names)
    if errors:
        if not as_json:
            for e in errors:
                typer.echo(f"cudadoctor: error: {e}", err=True)
        raise typer.Exit(EXIT_USAGE)
    if any(not v["runs"] for v in vs):
        raise typer.Exit(EXIT_FINDING)


def _print_human(files: list[dict], vs: list[dict], ccs: list[str], names: dict[str, str]) -> None:
    by_path: dict[str, list[dict]] = {}
    for v in vs:
        by_path.setdefault(v["path"], []).append(v)
    for f in files:
        if f.get("error"):
            typer.echo(f"✗ {f['path']}: {f['error']}")
            continue
        typer.echo(f"{f['path']}  ({f.get('format', '?')}, {_size(f.get('size'))})")
        if not f.get("sass") and not f.get("ptx") and not f.get("lto"):
            typer.echo("  no CUDA device code")
        if f.get("lto"):
            typer.echo("  LTO-IR: " + ", ".join(f["lto"]) + " (input to a device link with nvcc -dlto; not loadable as is)")
        if f.get("sass"):
            typer.echo("  SASS: " + ", ".join(f["sass"]))
        if f.get("ptx"):
            isa = f.get("ptx_isa") or {}
            typer.echo("  PTX:  " + ", ".join(f"{p} (ISA {isa.get(p, '?')})" for p in f["ptx"]))
        if f.get("compression"):
            typer.echo("  compressed: " + ", ".join(f["compression"]))
        total = sum(e.get("size", 0) for e in f.get("entries") or [])
        count = sum(e.get("count", 0) for e in f.get("entries") or [])
        if count:
            typer.echo(f"  {count} device images, {_size(total)}")
        bw = f.get("built_with") or {}
        if any(bw.get(k) is not None for k in ("torch", "cuda", "cxx11_abi")):
            typer.echo("  built with: " + ", ".join(f"{k} {bw[k]}" for k in ("torch", "cuda", "cxx11_abi") if bw.get(k) is not None))
        if f.get("manifest") is not None:
            typer.echo("  cudadoctor build manifest: " + json.dumps(f["manifest"], sort_keys=True))
        for v in by_path.get(f["path"], []):
            label = f"{names[v['gpu']]} (cc {v['gpu']})" if v["gpu"] in names else f"cc {v['gpu']}"
            if v["runs"] and v["via"] == "sass":
                typer.echo(f"  ✓ {label}: runs natively ({v['code']})")
            elif v["runs"]:
                typer.echo(f"  • {label}: runs through PTX JIT of {v['code']} (needs driver >= {v['needs_driver'] or '?'}, CUDA {v['needs_driver_cuda'] or '?'})")
            else:
                typer.echo(f"  ✗ {label}: cannot run: {v['reason']}")
    if not ccs:
        typer.echo("No GPU present and none given: pass --gpu 8.9 or --target 8.6,8.9 for verdicts.")
