"""Expected errors: each carries the exit code the CLI returns and a one-paragraph message.

The CLI turns these into a message ending in what to do next, never a traceback.
Exit codes (documented in the README):
  0  success / no error finding
  1  an error finding, a refused request, or a failed build/smoke (the check ran)
  2  the command itself could not run: bad arguments, unreadable input
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_FINDING = 1
EXIT_USAGE = 2


class CudadoctorError(Exception):
    """An expected failure. ``str(err)`` is a complete, user-facing paragraph."""

    exit_code = EXIT_USAGE

    def __init__(self, message: str, *, hint: str | None = None, exit_code: int | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint
        if exit_code is not None:
            self.exit_code = exit_code

    def __str__(self) -> str:
        if self.hint:
            return f"{self.message} {self.hint}"
        return self.message


class InputError(CudadoctorError):
    """Bad user input: malformed JSON, unreadable file, bogus arch spec (exit 2)."""

    exit_code = EXIT_USAGE


class RefusedError(CudadoctorError):
    """A valid request that cannot be satisfied (arch nvcc cannot target, impossible build) (exit 1)."""

    exit_code = EXIT_FINDING
