"""`cudadoctor check` and `cudadoctor collect`: probe (or read) the facts, diagnose, render.

Exit codes: 0 no error finding, 1 at least one error finding (or a warning with --strict),
2 the command could not run (bad arguments, unreadable or malformed snapshot).
Heavy modules (probes, redaction) are imported only when needed, so ``check --from FILE`` is fast.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Optional

import typer

from cudadoctor.cli import app
from cudadoctor.errors import EXIT_FINDING, EXIT_OK, CudadoctorError, InputError

FORMATS = ("human", "json", "github")
_HINT = ("Pass a facts snapshot written by `cudadoctor collect -o FILE`, a `check --json` report, "
         "or a scenario file with a \"facts\" object.")


def load_facts_file(path: str) -> dict[str, Any]:
    """Facts from a snapshot, a report (its ``facts``) or a scenario file (its ``facts``)."""
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputError(f"cannot read facts file {path!r}: no such file.", hint=_HINT) from None
    except IsADirectoryError:
        raise InputError(f"cannot read facts file {path!r}: it is a directory.", hint=_HINT) from None
    except UnicodeDecodeError as exc:
        raise InputError(f"cannot read facts file {path!r}: not UTF-8 text ({exc.reason} at byte {exc.start}).",
                         hint=_HINT) from None
    except OSError as exc:
        raise InputError(f"cannot read facts file {path!r}: {exc.strerror or exc}.", hint=_HINT) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(
            f"facts file {path!r} is not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno} "
            f"(character {exc.pos}).",
            hint=_HINT,
        ) from None
    if not isinstance(data, dict):
        raise InputError(f"facts file {path!r} holds a JSON {type(data).__name__}, not an object.", hint=_HINT)
    inner = data.get("facts")
    if isinstance(inner, dict) and ("expect" in data or "source" in data or "findings" in data):
        return inner
    if "facts" in data and inner is None and ("expect" in data or "findings" in data):
        return {}
    return data


def read_error_text(error: Optional[str], error_file: Optional[str]) -> Optional[str]:
    if error is not None and error_file is not None:
        raise InputError("give the error message with --error or --error-file, not both.")
    if error == "-" or error_file == "-":
        return sys.stdin.read()
    if error_file is not None:
        try:
            return Path(error_file).read_text(encoding="utf-8", errors="replace")
        except OSError as exc:
            raise InputError(f"cannot read error file {error_file!r}: {exc.strerror or exc}.") from None
    return error


def _installed_ops() -> list:
    from cudadoctor.inspect import installed_extension_entries

    return installed_extension_entries("cudadoctor_ops", load_check=True)


DEFAULT_TORCH_TIMEOUT = 20.0


def torch_timeout_arg(value: Any) -> float:
    """--torch-timeout S: a positive number of seconds, at most an hour."""
    try:
        t = float(value)
    except (TypeError, ValueError):
        raise InputError(f"--torch-timeout {value!r}: not a number of seconds.",
                         hint="Give the seconds the torch child may take to import torch, e.g. --torch-timeout 120.") from None
    if not (0 < t <= 3600):
        raise InputError(f"--torch-timeout {value}: must be more than 0 and at most 3600 seconds.",
                         hint=f"The default is {DEFAULT_TORCH_TIMEOUT:g}; a slow first import rarely needs more than 180.")
    return t


def _collect(redacted: bool, *, with_installed_ops: bool = False,
             torch_timeout: float = DEFAULT_TORCH_TIMEOUT) -> dict[str, Any]:
    try:
        from cudadoctor.probes import collect_facts
    except ImportError as exc:
        raise CudadoctorError(f"the probes could not be loaded ({exc}).",
                              hint="Run `cudadoctor check --from FILE` on a saved snapshot instead.") from None
    # The installed cudadoctor_ops is inspected (and import-checked) concurrently with the probes.
    extra = {"extensions": _installed_ops} if with_installed_ops else None
    try:
        facts = collect_facts(extra=extra, torch_timeout=torch_timeout)
    except CudadoctorError:
        raise
    except Exception as exc:  # noqa: BLE001 - a probe bug must end in a paragraph, not a traceback
        raise CudadoctorError(f"probing this machine failed ({type(exc).__name__}: {exc}).",
                              hint="Set CUDADOCTOR_DEBUG=1 for the traceback, or run `cudadoctor check --from FILE`.") from None
    if redacted:
        from cudadoctor.redact import redact

        facts = redact(facts)
    return facts


def add_extensions(facts: dict[str, Any], ext: Optional[list] = None,
                   ext_packages: Optional[list] = None) -> dict[str, Any]:
    """Put inspected extensions into ``facts["extensions"]``: each --ext PATH (file, wheel, folder) and each
    --ext-package NAME (an installed package, import-checked in a child process). A live check inspects an
    installed cudadoctor_ops while probing (see _collect)."""
    from cudadoctor.inspect import inspect_path, installed_extension_entries

    found: list = []
    for path in ext or []:
        found.extend(inspect_path(path))
    for name in ext_packages or []:
        got = installed_extension_entries(name, load_check=True)
        if not got:
            raise InputError(f"--ext-package {name!r}: no installed package of that name with shared objects.",
                             hint="Give the import name (e.g. cudadoctor_ops), or inspect files with --ext PATH.")
        found.extend(got)
    if found:
        have = facts.get("extensions") if isinstance(facts.get("extensions"), list) else []
        facts["extensions"] = have + found
    return facts


def run_check(
    *,
    from_file: Optional[str] = None,
    error: Optional[str] = None,
    error_file: Optional[str] = None,
    json_out: bool = False,
    fmt: str = "human",
    strict: bool = False,
    verbose: bool = False,
    list_rules: bool = False,
    ascii_only: bool = False,
    ext: Optional[list] = None,
    ext_packages: Optional[list] = None,
    torch_timeout: Any = DEFAULT_TORCH_TIMEOUT,
) -> int:
    """The whole of `check`: print the rendered report and return the exit code."""
    from cudadoctor import render

    if list_rules:
        from cudadoctor.rules import load_rules

        rules = sorted(load_rules().values(), key=lambda r: ({"error": 0, "warning": 1}.get(r.severity, 2), r.priority))
        typer.echo(render.rule_list([(r.id, r.severity, r.summary) for r in rules]), nl=False)
        return EXIT_OK
    if fmt not in FORMATS:
        raise InputError(f"unknown --format {fmt!r}.", hint=f"Use one of: {', '.join(FORMATS)}.")
    if json_out:
        fmt = "json"
    if from_file == "-" and (error == "-" or error_file == "-"):
        raise InputError("only one of --from and --error/--error-file can read stdin.")
    torch_timeout = torch_timeout_arg(torch_timeout)
    text = read_error_text(error, error_file)
    if from_file is not None:
        facts = load_facts_file(from_file)
    else:
        facts = _collect(redacted=False, with_installed_ops=not ext_packages, torch_timeout=torch_timeout)
    facts = add_extensions(facts, ext, ext_packages)
    from cudadoctor.doctor import diagnose

    report = diagnose(facts, error_text=text)
    if fmt == "json":
        out = render.as_json(report)
    elif fmt == "github":
        out = render.github(report)
    else:
        out = render.human(report, verbose=verbose, ascii_only=ascii_only or not _can_encode("✓✗•"))
    typer.echo(out, nl=False)
    sev = {f.get("severity") for f in report["findings"]}
    if "error" in sev or (strict and "warning" in sev):
        return EXIT_FINDING
    return EXIT_OK


@app.command("check")
def check(
    from_file: Optional[str] = typer.Option(None, "--from", metavar="FILE",
                                            help="Diagnose a saved facts snapshot or scenario file ('-' = stdin)."),
    error: Optional[str] = typer.Option(None, "--error", metavar="TEXT",
                                        help="An error message you saw ('-' = stdin); ranks the causes it implicates first."),
    error_file: Optional[str] = typer.Option(None, "--error-file", metavar="PATH",
                                             help="Read the error message from a file ('-' = stdin)."),
    json_out: bool = typer.Option(False, "--json", help="Print the report as JSON (cudadoctor.report/1)."),
    fmt: str = typer.Option("human", "--format", metavar="FORMAT", help="human | json | github (workflow annotations)."),
    strict: bool = typer.Option(False, "--strict", help="Exit 1 on warnings too."),
    verbose: bool = typer.Option(False, "-v", "--verbose", help="Show more facts per area."),
    list_rules: bool = typer.Option(False, "--list", help="List every rule: id, severity, one line."),
    ascii_only: bool = typer.Option(False, "--ascii", help="ASCII marks instead of ✓ • ! ✗."),
    ext: Optional[list[str]] = typer.Option(None, "--ext", metavar="PATH",
                                            help="Inspect a compiled extension (.so, .whl or folder; repeatable)."),
    ext_packages: Optional[list[str]] = typer.Option(None, "--ext-package", metavar="NAME",
                                                     help="Inspect an installed extension package (repeatable)."),
    torch_timeout: float = typer.Option(DEFAULT_TORCH_TIMEOUT, "--torch-timeout", metavar="S",
                                        help="Seconds the torch child may take to import torch (default 20)."),
) -> None:
    """Diagnose this machine (or a saved snapshot): driver, GPUs, torch, toolkit, compiler, arch list.

    Exit 0: no error finding; 1: an error finding (or a warning with --strict); 2: could not run.
    """
    raise typer.Exit(run_check(from_file=from_file, error=error, error_file=error_file, json_out=json_out,
                               fmt=fmt, strict=strict, verbose=verbose, list_rules=list_rules,
                               ascii_only=ascii_only, ext=ext, ext_packages=ext_packages,
                               torch_timeout=torch_timeout))


def fast_check(argv: list[str]) -> Optional[int]:
    """`check --from FILE ...` / `check --list` without building the typer app (it costs more than the
    diagnosis). Returns the exit code, or None to let the typer app handle anything else."""
    if not argv or argv[0] != "check":
        return None
    rest = argv[1:]
    if any(a in ("-h", "--help") for a in rest) or not any(a == "--list" or a.startswith("--from") for a in rest):
        return None
    import argparse

    ap = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)
    ap.add_argument("--from", dest="from_file")
    ap.add_argument("--error")
    ap.add_argument("--error-file")
    ap.add_argument("--json", dest="json_out", action="store_true")
    ap.add_argument("--format", dest="fmt", default="human")
    ap.add_argument("--strict", action="store_true")
    ap.add_argument("-v", "--verbose", action="store_true")
    ap.add_argument("--list", dest="list_rules", action="store_true")
    ap.add_argument("--ascii", dest="ascii_only", action="store_true")
    ap.add_argument("--ext", action="append")
    ap.add_argument("--ext-package", dest="ext_packages", action="append")
    ap.add_argument("--torch-timeout", dest="torch_timeout", default=DEFAULT_TORCH_TIMEOUT)
    try:
        ns, extra = ap.parse_known_args(rest)
    except (argparse.ArgumentError, SystemExit):
        return None
    if extra:
        return None  # let the typer app report the unknown argument
    import os

    from cudadoctor.cli import error_paragraph

    try:
        return run_check(**vars(ns))
    except CudadoctorError as exc:
        if os.environ.get("CUDADOCTOR_DEBUG"):
            raise
        error_paragraph(str(exc))
        return exc.exit_code
    except KeyboardInterrupt:
        typer.echo("cudadoctor: interrupted", err=True)
        return 130


def _can_encode(s: str) -> bool:
    enc = getattr(sys.stdout, "encoding", None) or "utf-8"
    try:
        s.encode(enc)
    except (UnicodeEncodeError, LookupError):
        return False
    return True


@app.command("collect")
def collect(
    output: Optional[str] = typer.Option(None, "-o", "--output", metavar="FILE", help="Write the snapshot here (default: stdout)."),
    no_redact: bool = typer.Option(False, "--no-redact", help="Keep user names, home paths and host names."),
    torch_timeout: float = typer.Option(DEFAULT_TORCH_TIMEOUT, "--torch-timeout", metavar="S",
                                        help="Seconds the torch child may take to import torch (default 20)."),
) -> None:
    """Probe this machine and print the facts snapshot (cudadoctor.facts/1), redacted by default."""
    facts = _collect(redacted=not no_redact, torch_timeout=torch_timeout_arg(torch_timeout))
    text = json.dumps(facts, indent=2, default=str) + "\n"
    if output is None or output == "-":
        typer.echo(text, nl=False)
    else:
        try:
            Path(output).write_text(text, encoding="utf-8")
        except OSError as exc:
            raise InputError(f"cannot write {output!r}: {exc.strerror or exc}.") from None
        typer.echo(f"wrote {output}", err=True)
    raise typer.Exit(EXIT_OK)
