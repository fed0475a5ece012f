"""The command line: one thin typer app; each command lives in its own module and calls library code.

Expected errors (CudadoctorError) become one paragraph on stderr and their exit code; a usage
error exits 2; Ctrl-C exits 130. No traceback reaches the user unless CUDADOCTOR_DEBUG=1.
"""

from __future__ import annotations

import importlib
import os
import sys

import click
import typer

from cudadoctor import __version__
from cudadoctor.errors import EXIT_USAGE, CudadoctorError

app = typer.Typer(
    name="cudadoctor",
    help="Diagnose CUDA / PyTorch extension environments; inspect, build and smoke-test CUDA wheels.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)

# Each module registers its commands on ``app`` when imported.
COMMAND_MODULES = ("check_cmd", "arch_cmd", "inspect_cmd", "build_cmd", "smoke_cmd")


try:  # newer typer vendors click as typer._click; its usage errors are not click's
    from typer._click.exceptions import ClickException as _VendoredClickException
except ImportError:  # pragma: no cover - typer that uses click itself
    _VendoredClickException = click.ClickException


def _version_callback(value: bool) -> None:
    if value:
        typer.echo(f"cudadoctor {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version_callback, is_eager=True, help="Print the version."),
) -> None:
    """cudadoctor: ends the worst days of custom CUDA-op work."""


def _load_commands() -> None:
    for name in COMMAND_MODULES:
        try:
            importlib.import_module(f"cudadoctor.cli.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"cudadoctor.cli.{name}":
                raise


def error_paragraph(message: str) -> None:
    """Print a user-facing error paragraph to stderr."""
    typer.echo(f"cudadoctor: error: {message}", err=True)


def main(argv: list[str] | None = None) -> int:
    from cudadoctor.cli.check_cmd import fast_check  # `check --from` skips building the typer app

    fast = fast_check(list(sys.argv[1:] if argv is None else argv))
    if fast is not None:
        if argv is None:
            sys.exit(fast)
        return fast
    _load_commands()
    try:
        rv = app(args=argv, standalone_mode=False, prog_name="cudadoctor")
    except CudadoctorError as exc:
        if os.environ.get("CUDADOCTOR_DEBUG"):
            raise
        error_paragraph(str(exc))
        code = exc.exit_code
    except click.exceptions.Exit as exc:
        code = exc.exit_code
    except click.exceptions.Abort:
        typer.echo("cudadoctor: interrupted", err=True)
        code = 130
    except KeyboardInterrupt:
        typer.echo("cudadoctor: interrupted", err=True)
        code = 130
    except (click.ClickException, _VendoredClickException) as exc:
        exc.show()
        code = EXIT_USAGE if exc.exit_code in (None, 1, 2) else exc.exit_code
    else:
        code = rv if isinstance(rv, int) else 0
        if code == 130:  # typer returns 130 for Ctrl-C inside a command
            typer.echo("cudadoctor: interrupted", err=True)
    if argv is None:
        sys.exit(code)
    return code
