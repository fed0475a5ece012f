"""The CUDA fat binary container (magic 0xBA55ED50) and its entries, read from a buffer.

Layout (little endian), as produced by nvcc/fatbinary:
  container header (16 bytes): u32 magic, u16 version, u16 header_size, u64 payload size
  entry header (>= 64 bytes):  u16 kind (1 PTX, 2 ELF/SASS), u16 version, u32 header_size,
      u64 payload size, u32 compressed size, u32 options offset, u16 minor, u16 major,
      u32 arch (e.g. 86), u32 name offset, u32 name length, u64 flags, u64 reserved,
      u64 decompressed size
  flags: 0x1 64-bit, 0x2 debug, 0x10 Linux host, 0x2000 LZ4-compressed, 0x8000 zstd-compressed,
      0x100000 arch-specific target ('a'), 0x200000 family target ('f').
For PTX entries major.minor is the PTX ISA version (also in the text's ``.version`` line).
Compressed payloads are not decompressed: their kind, arch and sizes are all in the header.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass

from cudadoctor.binary.errors import BinaryFormatError

FATBIN_MAGIC = 0xBA55ED50
FATBIN_MAGIC_BYTES = struct.pack("<I", FATBIN_MAGIC)
KIND_PTX = 1
KIND_ELF = 2
KIND_LTO = 8  # NVVM IR for link-time optimisation (-gencode code=lto_XY); needs a device link
FLAG_DEBUG = 0x2
FLAG_LZ4 = 0x2000
FLAG_ZSTD = 0x8000
FLAG_ARCH_SPECIFIC = 0x100000
FLAG_FAMILY = 0x200000

_ENTRY = struct.Struct("<HHIQIIHHIIIQQQ")  # 64 bytes
_HEADER = struct.Struct("<IHHQ")  # 16 bytes
_NONZERO = re.compile(rb"[^\x00]")
_PTX_VERSION = re.compile(rb"\.version\s+(\d+)\.(\d+)")


@dataclass(frozen=True)
class FatbinEntry:
    kind: str  # "sass", "ptx", "lto" or "kind<N>"
    arch: str  # "sm_86" / "compute_89" / "sm_90a"; "" for other kinds
    size: int  # payload bytes in the container
    compressed_size: int
    decompressed_size: int
    compression: str | None  # "lz4", "zstd" or None
    ptx_isa: str | None  # "9.0" for PTX entries
    debug: bool


def _arch_name(kind: int, arch: int, flags: int) -> str:
    suffix = "a" if flags & FLAG_ARCH_SPECIFIC else ("f" if flags & FLAG_FAMILY else "")
    prefix = "sm" if kind == KIND_ELF else "compute"
    return f"{prefix}_{arch}{suffix}"


def iter_containers(buf, start: int, end: int, *, name: str = "file"):
    """Yield the entries of every fat binary container laid out in buf[start:end].

    Containers follow one another, separated only by zero padding; anything else between them
    is a damaged file (BinaryFormatError).
    """
    pos = start
    while pos < end:
        m = _NONZERO.search(buf, pos, end)
        if m is None:
            return
        pos = m.start()
        if end - pos < _HEADER.size:
            raise BinaryFormatError(f"{name}: truncated fat binary header at offset {pos}.")
        magic, _version, hsize, payload = _HEADER.unpack_from(buf, pos)
        if magic != FATBIN_MAGIC:
            raise BinaryFormatError(
                f"{name}: expected a CUDA fat binary (magic 0xBA55ED50) at offset {pos}, found 0x{magic:08X}."
            )
        if hsize < _HEADER.size or pos + hsize + payload > end:
            raise BinaryFormatError(
                f"{name}: fat binary container at offset {pos} claims {payload} bytes; only {end - pos - hsize} remain."
            )
        yield from _entries(buf, pos + hsize, pos + hsize + payload, name)
        pos += hsize + payload


def _entries(buf, pos: int, end: int, name: str):
    while pos < end:
        if end - pos < _ENTRY.size:
            if not _NONZERO.search(buf, pos, end):
                return  # trailing padding inside the container
            raise BinaryFormatError(f"{name}: truncated fat binary entry header at offset {pos}.")
        (kind, _ver, hsize, size, csize, _opt, minor, major, arch, _no, _nl, flags, _z, dsize) = _ENTRY.unpack_from(
            buf, pos
        )
        if kind == 0 and hsize == 0 and size == 0:
            if not _NONZERO.search(buf, pos, end):
                return
        if hsize < _ENTRY.size or pos + hsize + size > end:
            raise BinaryFormatError(
                f"{name}: fat binary entry at offset {pos} (header {hsize} bytes, payload {size}) does not fit its container."
            )
        if kind in (KIND_PTX, KIND_ELF, KIND_LTO) and not 10 <= arch <= 1000:
            raise BinaryFormatError(f"{name}: fat binary entry at offset {pos} names an impossible arch {arch}.")
        compression = "zstd" if flags & FLAG_ZSTD else ("lz4" if flags & FLAG_LZ4 else None)
        ptx_isa = None
        if kind == KIND_PTX:
            ptx_isa = f"{major}.{minor}"
            if compression is None:
                head = bytes(buf[pos + hsize : pos + hsize + min(size, 4096)])
                mv = _PTX_VERSION.search(head)
                if mv:
                    ptx_isa = f"{int(mv.group(1))}.{int(mv.group(2))}"
        if kind in (KIND_PTX, KIND_ELF):
            k = "ptx" if kind == KIND_PTX else "sass"
            an = _arch_name(kind, arch, flags)
        elif kind == KIND_LTO:
            k, an = "lto", "lto_" + _arch_name(kind, arch, flags).split("_", 1)[1]
        else:
            k, an = f"kind{kind}", ""
        yield FatbinEntry(k, an, size, csize if compression else 0, dsize if compression else 0, compression, ptx_isa,
                          bool(flags & FLAG_DEBUG))
        pos += hsize + size
