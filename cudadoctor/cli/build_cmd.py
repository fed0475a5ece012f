"""`cudadoctor build [SOURCE]`: fat wheels for several GPU architectures, in a matched container or on
this host. Exit codes: 0 built, 1 refused or failed build, 2 bad arguments or no Docker daemon."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import List, Optional

import typer

from cudadoctor.cli import app


def _pip_settings(index_url, extra_index_url, find_links, ca_bundle, no_pip_config: bool):
    from cudadoctor.build.plan import PipSettings, pip_settings_from_config
    from cudadoctor.errors import InputError
    from cudadoctor.runner import Runner

    env = dict(os.environ)
    if index_url or extra_index_url or find_links or no_pip_config:
        ca = env.get("PIP_CERT") or env.get("SSL_CERT_FILE") or env.get("REQUESTS_CA_BUNDLE")
        pip = PipSettings(index_url=index_url, extra_index_urls=tuple(extra_index_url or ()),
                          find_links=tuple(find_links or ()), ca_bundle=ca or None)
    else:
        res = Runner(default_timeout=30).run([sys.executable, "-m", "pip", "config", "list"])
        pip = pip_settings_from_config(res.stdout if res.ok else "", env)
    if ca_bundle is not None:
        if ca_bundle and not Path(ca_bundle).is_file():
            raise InputError(f"--ca-bundle {ca_bundle!r} is not a file.", hint="Pass a PEM bundle such as /etc/ssl/certs/ca-certificates.crt.")
        from dataclasses import replace

        pip = replace(pip, ca_bundle=ca_bundle or None)
    return pip


@app.command("build")
def build_command(
    source: str = typer.Argument("opsrc", help="Folder of a torch extension project (setup.py/pyproject with BuildExtension)."),
    arch: Optional[str] = typer.Option(None, "--arch", help="Architectures: 8.6,8.9 or '8.0;9.0+PTX'."),
    torch: Optional[str] = typer.Option(None, "--torch", help="torch release to build against (default: newest; local: the installed one)."),
    cuda: Optional[str] = typer.Option(None, "--cuda", help="CUDA variant of torch (default: the one PyPI ships)."),
    python: Optional[str] = typer.Option(None, "--python", help="Python major.minor the image must have."),
    backend: str = typer.Option("docker", "--backend", help="docker or local."),
    base_image: Optional[str] = typer.Option(None, "--base-image", help="Base image (default nvidia/cuda:<cuda>-devel-ubuntu24.04)."),
    toolkit: str = typer.Option("image", "--toolkit", help="image: CUDA from the base image; pip: from nvidia-* wheels."),
    index_url: Optional[str] = typer.Option(None, "--index-url", help="pip index URL inside the build."),
    extra_index_url: Optional[List[str]] = typer.Option(None, "--extra-index-url", help="Extra pip index (repeatable)."),
    find_links: Optional[List[str]] = typer.Option(None, "--find-links", help="pip find-links (repeatable)."),
    ca_bundle: Optional[str] = typer.Option(None, "--ca-bundle", help="CA bundle for pip (default: PIP_CERT, SSL_CERT_FILE, REQUESTS_CA_BUNDLE)."),
    no_pip_config: bool = typer.Option(False, "--no-pip-config", help="Do not carry this machine's pip configuration into the build."),
    jobs: Optional[int] = typer.Option(None, "--jobs", "-j", help="Parallel compile jobs (default: sized to cores and free memory)."),
    out: str = typer.Option("dist", "--out", help="Where wheels and build logs go."),
    keep_container: bool = typer.Option(False, "--keep-container", help="Keep containers for debugging."),
    matrix: Optional[Path] = typer.Option(None, "--matrix", help="TOML file with several [[target]] entries."),
    emit_github_matrix: bool = typer.Option(False, "--emit-github-matrix", help="Print the GitHub Actions strategy matrix JSON and exit."),
    plan_only: bool = typer.Option(False, "--plan", help="Print the build plan as JSON and exit (nothing runs)."),
    no_compress: bool = typer.Option(False, "--no-compress", help="Do not compress device code (-Xfatbin -compress-all)."),
    work_dir: Optional[str] = typer.Option(None, "--work-dir", help="Persistent build folders (default ~/.cache/cudadoctor/build)."),
    force: bool = typer.Option(False, "--force", help="Build even when nothing changed since the last build."),
    allow_static_cxx_runtime: bool = typer.Option(False, "--allow-static-cxx-runtime", help="Accept shared objects that carry their own C++ runtime (define __cxa_throw); exceptions thrown in them crash the process."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Print every build line."),
) -> int:
    """Build fat wheels for several GPU architectures inside matched containers (or on this host)."""
    from rich.console import Console

    from cudadoctor.build import execute as X
    from cudadoctor.build import plan as P
    from cudadoctor.errors import InputError

    spec = P.TargetSpec(arch=arch or "", torch=torch, cuda=cuda, python=python, base_image=base_image, toolkit=toolkit)
    if matrix is not None:
        try:
            text = matrix.read_text(encoding="utf-8")
        except OSError as exc:
            raise InputError(f"cannot read the matrix file {str(matrix)!r}: {exc.strerror or exc}.") from None
        defaults = P.TargetSpec(arch=arch, torch=torch, cuda=cuda, python=python, base_image=base_image,
                                toolkit=toolkit)
        specs = P.read_matrix(text, defaults=defaults, where=str(matrix))
    else:
        if not arch:
            raise InputError("no architectures given.", hint="Pass --arch, for example --arch 8.6,8.9, or --matrix FILE.")
        specs = [spec]
    if backend not in P.BACKENDS:
        raise InputError(f"unknown backend {backend!r}.", hint="Use --backend docker or --backend local.")

    if emit_github_matrix:
        targets = [P.resolve_target(s, backend="docker") for s in specs]
        typer.echo(json.dumps(P.github_matrix(targets)))
        return 0

    pip = _pip_settings(index_url, extra_index_url, find_links, ca_bundle, no_pip_config)
    req = X.BuildRequest(source=source, specs=specs, backend=backend, pip=pip, jobs=jobs, out=out,
                         keep_container=keep_container, compress=not no_compress, work_root=work_dir, verbose=verbose, force=force,
                         allow_static_cxx_runtime=allow_static_cxx_runtime)
    if plan_only:
        plans = X.make_plans(req)
        typer.echo(json.dumps([p.to_dict() for p in plans], indent=2))
        return 0
    console = Console(stderr=True)
    results = X.build(req, console)
    for r in results:
        sos = r.manifest.get("shared_objects") or {}
        when = "up to date" if r.up_to_date else f"{r.seconds:.0f}s"
        typer.echo(f"✓ {r.wheel}  ({r.size / 1048576:.1f} MiB, {when})")
        for member, got in sorted(sos.items()):
            typer.echo(f"    {member}: SASS {' '.join(got.get('sass') or []) or '-'}; PTX {' '.join(got.get('ptx') or []) or '-'}")
        typer.echo(f"    log: {r.log}")
    return 0
