"""Errors of the binary reader."""

from __future__ import annotations

from cudadoctor.errors import InputError


class BinaryFormatError(InputError):
    """A file that is not, or is a damaged, ELF / CUDA fat binary / wheel (exit 2)."""
