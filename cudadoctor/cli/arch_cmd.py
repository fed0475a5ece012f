"""`cudadoctor arch` and `cudadoctor env`."""

from __future__ import annotations

import json
from typing import List, Optional

import typer

from cudadoctor.cli import app


def _gpus_from_option(gpu: list[str] | None) -> list[dict] | None:
    if not gpu:
        return None
    from cudadoctor.archs import Arch
    from cudadoctor.errors import InputError

    out = []
    for n, g in enumerate(x for opt in gpu for x in opt.replace(";", ",").split(",") if x.strip()):
        a = Arch.parse(g)
        if a is None:
            raise InputError(f"--gpu {g!r} is not a compute capability.", hint="Write it like 8.9 or 89.")
        out.append({"index": n, "name": f"(given) {a.base.cc}", "cc": a.base.cc})
    return out


@app.command("arch")
def arch_command(
    spec: Optional[str] = typer.Argument(None, help="Arch spec: 8.6,8.9 / 8.9+PTX / sm_86 / compute_86 / Ampere / native / all. Default: the GPUs present."),
    arch_opt: Optional[str] = typer.Option(None, "--arch", help="The spec as an option, as `env` and `build` take it (the same as the argument)."),
    nvcc: Optional[str] = typer.Option(None, "--nvcc", help="The nvcc that will build (default: what torch would use)."),
    gpu: Optional[List[str]] = typer.Option(None, "--gpu", help="Judge these compute capabilities instead of the GPUs present (repeatable)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Print TORCH_CUDA_ARCH_LIST and -gencode flags for a spec, checked against the nvcc that will build."""
    from cudadoctor.archplan import make_plan, present_gpus, probe_nvcc
    from cudadoctor.errors import InputError
    from cudadoctor.runner import Runner

    if arch_opt is not None:
        if spec is not None and spec != arch_opt:
            raise InputError(f"two arch specs given: {spec!r} and --arch {arch_opt!r}.",
                             hint="Give the spec once, as the argument or as --arch.")
        spec = arch_opt
    runner = Runner()
    gpus = _gpus_from_option(gpu)
    driver = None
    if gpus is None:
        gpus, driver, _err = present_gpus(runner)
    nv = probe_nvcc(runner, nvcc)
    plan = make_plan(spec, nvcc=nv, gpus=gpus, driver=driver)
    if as_json:
        typer.echo(json.dumps(plan.to_json(), indent=2))
        return
    for note in plan.notes:
        typer.echo(f"• {note}")
    nv_line = f"nvcc {nv.version} ({nv.path}), checked with {plan._checked_with()}" if nv.version else "nvcc: not found"
    typer.echo(f"TORCH_CUDA_ARCH_LIST={plan.torch_cuda_arch_list}")
    typer.echo("gencode: " + " ".join(plan.gencode))
    typer.echo(nv_line)
    if not plan.gpus:
        typer.echo("GPUs: none present")
    for g in plan.gpus:
        name = f"GPU {g.get('index')}: {g.get('name')} (cc {g.get('cc') or '?'})"
        if g.get("runs") is None:
            typer.echo(f"! {name}: {g.get('note')}")
        elif g["runs"] and g["via"] == "sass":
            typer.echo(f"✓ {name}: runs native SASS")
        elif g["runs"]:
            typer.echo(f"• {name}: runs through PTX JIT (needs driver >= {g.get('needs_driver') or '?'}, CUDA {g.get('needs_driver_cuda') or '?'})")
        else:
            typer.echo(f"✗ {name}: cannot run this build" + (f" ({g['note']})" if g.get("note") else ""))


@app.command("env")
def env_command(
    shell: str = typer.Option("bash", "--shell", help="bash, zsh, fish, pwsh, cmd, github ($GITHUB_ENV lines) or dotenv."),
    spec: Optional[str] = typer.Option(None, "--arch", help="Arch spec for TORCH_CUDA_ARCH_LIST (default: the GPUs present)."),
    nvcc: Optional[str] = typer.Option(None, "--nvcc", help="The nvcc that will build."),
    gpu: Optional[List[str]] = typer.Option(None, "--gpu", help="Plan for these compute capabilities instead of the GPUs present."),
) -> None:
    """Print the exports that make CUDA extension builds work here: eval "$(cudadoctor env)"."""
    from cudadoctor.envcmd import SHELLS, make_env_plan, render
    from cudadoctor.errors import InputError

    if shell not in SHELLS:
        raise InputError(f"unknown shell {shell!r}.", hint="Use one of: " + ", ".join(SHELLS) + ".")
    plan = make_env_plan(spec=spec, nvcc_path=nvcc, gpus=_gpus_from_option(gpu))
    typer.echo(render(plan, shell), nl=False)
