"""`cudadoctor smoke [WHEEL | --installed [PACKAGE]]`: a wheel's ops on the GPU, under compute-sanitizer.

Exit codes: 0 every check and run passed; 1 a failure was found (import error, predicted
no-kernel-image or ABI mismatch, wrong result, sanitizer errors, crash, timeout); 2 smoke could not
run (missing or corrupt wheel, bad arguments); 3 nothing failed but runs were skipped (no GPU: the
install, import, manifest and arch checks still ran; no smoke cases; no compute-sanitizer).
"""

from __future__ import annotations

import sys
from typing import List, Optional

import typer

from cudadoctor.cli import app


def _can_encode(text: str) -> bool:
    enc = getattr(sys.stdout, "encoding", None) or "ascii"
    try:
        text.encode(enc)
        return True
    except (UnicodeEncodeError, LookupError):
        return False


@app.command("smoke")
def smoke_command(
    target: Optional[str] = typer.Argument(
        None, metavar="[WHEEL | PACKAGE]",
        help="The .whl to test (installed into a temporary folder); with --installed, the package name."),
    installed: bool = typer.Option(False, "--installed",
                                   help="Test an installed package (default cudadoctor_ops) instead of a wheel."),
    package: Optional[str] = typer.Option(None, "--package", help="Which top-level package of the wheel to test."),
    cases: Optional[str] = typer.Option(None, "--cases", metavar="MODULE",
                                        help="Module with the smoke cases (default: PACKAGE._smoke)."),
    tools: str = typer.Option("memcheck,racecheck,initcheck,synccheck", "--tools",
                              help="compute-sanitizer tools: a comma list, 'all' or 'none'."),
    gpu: Optional[List[str]] = typer.Option(None, "--gpu", metavar="CC",
                                            help="Also judge the binaries for this compute capability (repeatable)."),
    timeout: float = typer.Option(600.0, "--timeout", metavar="S", help="Seconds each child process may run."),
    jobs: Optional[int] = typer.Option(None, "--jobs", "-j", help="Child processes at once (default: cores/2, at most 8)."),
    device: str = typer.Option("cuda:0", "--device", help="Device the cases run on.", hidden=True),
    log_dir: Optional[str] = typer.Option(None, "--log-dir", help="Keep each child's full output here."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON (cudadoctor.smoke/1)."),
    json_out: Optional[str] = typer.Option(None, "--json-out", metavar="FILE",
                                           help="Also write the JSON report to FILE."),
    verbose: bool = typer.Option(False, "-v", "--verbose", help="More detail per finding and sanitizer report."),
    ascii_only: bool = typer.Option(False, "--ascii", help="ASCII marks instead of ✓ ✗ •."),
) -> None:
    """Run a wheel's ops against torch references on the GPU, plainly and under compute-sanitizer.

    Before anything runs, the import, the build manifest (torch, CUDA, C++11 ABI) and the SASS/PTX
    inside are checked against this runtime and every GPU (EXT_ABI_MISMATCH, EXT_NO_KERNEL_IMAGE).

    Exit 0: all passed; 1: a failure found; 2: could not run (bad or corrupt wheel); 3: skipped
    (no GPU, no smoke cases or no compute-sanitizer; the checks before the runs still ran).
    """
    from cudadoctor.archs import Arch
    from cudadoctor.errors import InputError
    from cudadoctor.smoke import SmokeRequest, run_smoke
    from cudadoctor.smoke import render
    from cudadoctor.smoke.sanitizer import parse_tools

    if installed:
        wheel, pkg_installed = None, target or "cudadoctor_ops"
        if pkg_installed.endswith(".whl"):
            raise InputError(f"--installed takes a package name, not a wheel ({pkg_installed}).",
                             hint="Drop --installed to test the wheel file.")
    elif target is None:
        raise InputError("nothing to test.", hint="Pass a wheel file, or --installed [PACKAGE] for an installed package.")
    else:
        wheel, pkg_installed = target, None
    if timeout <= 0:
        raise InputError(f"--timeout {timeout:g}: must be a positive number of seconds.")
    if jobs is not None and jobs < 1:
        raise InputError(f"--jobs {jobs}: must be at least 1.")
    ccs: list[str] = []
    for g in gpu or []:
        for part in g.replace(";", ",").split(","):
            if part.strip():
                a = Arch.parse(part)
                if a is None:
                    raise InputError(f"--gpu {part!r} is not a compute capability.", hint="Write it like 9.0 or 90.")
                ccs.append(a.base.cc)
    req = SmokeRequest(wheel=wheel, installed=pkg_installed, package=package, cases_module=cases,
                       tools=parse_tools(tools), timeout=timeout, gpus=ccs, device=device, jobs=jobs,
                       log_dir=log_dir)
    progress = None if as_json else (lambda msg: typer.echo(f"smoke: {msg}", err=True))
    report = run_smoke(req, progress=progress)
    if json_out:
        try:
            with open(json_out, "w", encoding="utf-8") as fh:
                fh.write(render.as_json(report))
        except OSError as exc:
            raise InputError(f"cannot write --json-out {json_out!r}: {exc.strerror or exc}.") from None
    if as_json:
        typer.echo(render.as_json(report), nl=False)
    else:
        typer.echo(render.human(report, ascii_only=ascii_only or not _can_encode("✓✗•"), verbose=verbose), nl=False)
    raise typer.Exit(report["exit_code"])
