"""Pure-Python reader for CUDA device code in ELF files, cubins and fat binaries (no cuobjdump)."""

from cudadoctor.binary.errors import BinaryFormatError
from cudadoctor.binary.fatbin import FatbinEntry
from cudadoctor.binary.reader import BinaryInfo, read_binary, read_buffer

__all__ = ["BinaryFormatError", "BinaryInfo", "FatbinEntry", "read_binary", "read_buffer"]
